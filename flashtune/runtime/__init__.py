"""Runtime dispatcher: resolves a config for each call and launches the kernel."""

from __future__ import annotations

from flashtune.runtime.lookup import ConfigChoice
from flashtune.runtime.ops import attention, lookup_config, reload_configs, warmup

__all__ = ["ConfigChoice", "attention", "lookup_config", "reload_configs", "warmup"]

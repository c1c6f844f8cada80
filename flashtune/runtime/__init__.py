"""Runtime dispatcher: resolves a config for each call and launches the kernel."""

from __future__ import annotations

from flashtune.runtime.ops import attention

__all__ = ["attention"]

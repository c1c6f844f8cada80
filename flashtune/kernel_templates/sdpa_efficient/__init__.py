"""sdpa_efficient: torch SDPA's memory-efficient backend as an extern implementation (no
knobs; see :mod:`flashtune.kernel_templates.sdpa_extern`). CUDA only."""

from __future__ import annotations

from flashtune.kernel_templates.registry import register_template
from flashtune.kernel_templates.sdpa_extern import extern_spec, sdpa_efficient

SPEC = register_template(extern_spec("efficient"))

__all__ = ["SPEC", "sdpa_efficient"]

"""sdpa_flash: torch SDPA's FlashAttention-2 backend as an extern implementation (no knobs;
see :mod:`flashtune.kernel_templates.sdpa_extern`). CUDA only, sm_80 and newer."""

from __future__ import annotations

from flashtune.kernel_templates.registry import register_template
from flashtune.kernel_templates.sdpa_extern import extern_spec, sdpa_flash

SPEC = register_template(extern_spec("flash"))

__all__ = ["SPEC", "sdpa_flash"]

"""sdpa_cudnn: torch SDPA's cuDNN backend as an extern implementation (no knobs; see
:mod:`flashtune.kernel_templates.sdpa_extern`). CUDA only, sm_80 and newer, cuDNN 9."""

from __future__ import annotations

from flashtune.kernel_templates.registry import register_template
from flashtune.kernel_templates.sdpa_extern import extern_spec, sdpa_cudnn

SPEC = register_template(extern_spec("cudnn"))

__all__ = ["SPEC", "sdpa_cudnn"]

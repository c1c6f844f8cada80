"""sdpa_cudnn: torch SDPA's cuDNN backend as an extern implementation (no knobs; see
:mod:`flashtune.kernel_templates.sdpa_extern`). CUDA only, sm_80 and newer, cuDNN 9.

Its training step is torch's autograd over the aten op; where a call's backward must be
flashtune's custom op (under ``torch.compile``), cuDNN's own backward runs as
``sdpa_cudnn_bwd`` (``paired_backward``) from the forward's output and LSE: the same
kernels."""

from __future__ import annotations

from dataclasses import replace

from flashtune.kernel_templates.registry import register_template
from flashtune.kernel_templates.sdpa_extern import extern_spec, sdpa_cudnn

SPEC = register_template(replace(extern_spec("cudnn"), paired_backward="sdpa_cudnn_bwd"))

__all__ = ["SPEC", "sdpa_cudnn"]

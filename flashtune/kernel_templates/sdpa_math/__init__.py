"""sdpa_math: torch SDPA's math backend as an extern implementation (no knobs; see
:mod:`flashtune.kernel_templates.sdpa_extern`). Runs on any device, CPU included; no LSE."""

from __future__ import annotations

from flashtune.kernel_templates.registry import register_template
from flashtune.kernel_templates.sdpa_extern import extern_spec, sdpa_math

SPEC = register_template(extern_spec("math"))

__all__ = ["SPEC", "sdpa_math"]

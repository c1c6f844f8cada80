"""attn_bwd: recompute-based flash-attention backward (dQ, dK, dV)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from flashtune.core.spec import SCORE_MODS, Limits
from flashtune.kernel_templates.attn_bwd.case import make_case
from flashtune.kernel_templates.attn_bwd.kernel import (
    attn_bwd_dkdv,
    attn_bwd_dq,
    attn_bwd_preprocess,
)
from flashtune.kernel_templates.attn_bwd.launcher import attn_bwd, kernel_args
from flashtune.kernel_templates.attn_bwd.reference import attn_bwd_reference
from flashtune.kernel_templates.attn_bwd.space import SPACE as _BARE_SPACE
from flashtune.kernel_templates.attn_bwd.space import default_config
from flashtune.kernel_templates.attn_bwd.warmup import warmup_launches
from flashtune.kernel_templates.knob_scope import split_d_scope
from flashtune.kernel_templates.registry import TemplateSpec, register_template, source_hash

_HERE = Path(__file__).parent
# the search proposes SPLIT_D 1 only where two tiles save padding (knob_scope)
SPACE = dataclasses.replace(_BARE_SPACE, narrow=split_d_scope)

SPEC = register_template(TemplateSpec(
    name="attn_bwd",
    op="bwd",
    source_hash=source_hash(_HERE / "kernel.py", _HERE / "launcher.py"),
    launcher=attn_bwd,
    reference=attn_bwd_reference,
    space=SPACE,
    default_config=default_config,
    warmup_launches=warmup_launches,
    kernel=attn_bwd_dkdv,  # the main kernel; precompile warms every launch (kernel_args)
    make_case=make_case,
    limits=Limits(score_mods=SCORE_MODS, packed=True, dropout=True),
))

__all__ = ["SPACE", "SPEC", "attn_bwd", "attn_bwd_dkdv", "attn_bwd_dq", "attn_bwd_preprocess",
           "attn_bwd_reference", "default_config", "kernel_args", "make_case"]

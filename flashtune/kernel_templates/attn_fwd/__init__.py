"""attn_fwd: exact attention forward with online-softmax tiling."""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

from flashtune.core.case import forward_case
from flashtune.core.spec import SCORE_MODS, Limits
from flashtune.kernel_templates.attn_fwd.kernel import attn_fwd_kernel
from flashtune.kernel_templates.attn_fwd.launcher import attn_fwd
from flashtune.kernel_templates.attn_fwd.reference import attn_fwd_reference
from flashtune.kernel_templates.attn_fwd.space import SPACE as _BARE_SPACE
from flashtune.kernel_templates.attn_fwd.space import default_config
from flashtune.kernel_templates.attn_fwd.warmup import warmup_launches
from flashtune.kernel_templates.dropout import dropout_mask
from flashtune.kernel_templates.knob_scope import split_d_scope
from flashtune.kernel_templates.registry import TemplateSpec, register_template, source_hash

_HERE = Path(__file__).parent
# the space with where its knobs apply (knob_scope: SPLIT_D where two tiles save padding)
SPACE = dataclasses.replace(_BARE_SPACE, narrow=split_d_scope)

SPEC = register_template(TemplateSpec(
    name="attn_fwd",
    op="fwd",
    source_hash=source_hash(_HERE / "kernel.py", _HERE / "launcher.py"),
    launcher=attn_fwd,
    reference=attn_fwd_reference,
    space=SPACE,
    default_config=default_config,
    make_case=functools.partial(forward_case, attn_fwd_reference, dropout_mask=dropout_mask),
    warmup_launches=warmup_launches,
    kernel=attn_fwd_kernel,
    serves=("fwd", "train", "decode"),
    backward="attn_bwd",
    limits=Limits(score_mods=SCORE_MODS, packed=True, dropout=True),
))

__all__ = ["SPEC", "attn_fwd", "attn_fwd_reference", "attn_fwd_kernel", "default_config", "SPACE"]

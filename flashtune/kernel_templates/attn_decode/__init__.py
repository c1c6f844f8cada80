"""attn_decode: split-KV flash-decoding over dense, ragged or paged KV caches."""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

from flashtune.core.case import forward_case
from flashtune.core.spec import SCORE_MODS, Limits
from flashtune.kernel_templates.attn_decode.full import attn_decode_full
from flashtune.kernel_templates.attn_decode.kernel import attn_decode_split_kernel
from flashtune.kernel_templates.attn_decode.launcher import attn_decode, attn_decode_kvcache
from flashtune.kernel_templates.attn_decode.lending import lend
from flashtune.kernel_templates.attn_decode.reference import attn_decode_reference
from flashtune.kernel_templates.attn_decode.space import SPACE as _BARE_SPACE
from flashtune.kernel_templates.attn_decode.space import default_config
from flashtune.kernel_templates.attn_decode.warmup import warmup_launches
from flashtune.kernel_templates.knob_scope import split_d_scope
from flashtune.kernel_templates.registry import TemplateSpec, register_template, source_hash

_HERE = Path(__file__).parent
# the space with its lending rule (lending.py: a nearest entry's split count follows the batch)
# and where its knobs apply (knob_scope: SPLIT_D where two tiles save padding)
SPACE = dataclasses.replace(_BARE_SPACE, lend=lend, narrow=split_d_scope)

SPEC = register_template(TemplateSpec(
    name="attn_decode",
    op="decode",
    source_hash=source_hash(_HERE / "kernel.py", _HERE / "launcher.py"),
    # dense K/V through the cache variant, lengths full (full.py): what the KV-cache path
    # runs, so the tuner times what runs
    launcher=attn_decode_full,
    reference=attn_decode_reference,
    space=SPACE,
    default_config=default_config,
    make_case=functools.partial(forward_case, attn_decode_reference),
    warmup_launches=warmup_launches,
    kernel=attn_decode_split_kernel,  # precompile warms the combine kernel too
    serves=("decode",),
    # max_seqlen_q: flashtune.runtime.kvcache.DECODE_MAX_QUERIES; window, softcap, ALiBi
    limits=Limits(max_seqlen_q=16, score_mods=SCORE_MODS),
))

__all__ = ["SPACE", "SPEC", "attn_decode", "attn_decode_full", "attn_decode_kvcache",
           "attn_decode_reference", "attn_decode_split_kernel", "default_config"]

"""attn_bwd_gluon: a Hopper flash-attention backward in Gluon with FlashAttention-3's
structure (``hopper/mainloop_bwd_sm90_tma_gmma_ws.hpp``), an implementation of the op
``bwd`` beside ``attn_bwd`` (sm_90, head dims 64, 128 and 256, fp16 and bf16, GQA/MQA,
bottom-right causal, Nq != Nk, ragged lengths, packed batches (FlashAttention-2's varlen
layout, the kernels' ``VARLEN``), a causal sliding window and a softcap, as the Gluon forward
serves them; no dropout, ALiBi or other windows: its ``Limits`` refuse them).

* a **preprocess** launch: ``delta = rowsum(dO * O) - dLSE`` and ``lse * log2 e`` per query
  row into padded float32 rows, and the fp32 dQ accumulator zeroed (FA3's
  ``flash_bwd_preprocess``);
* the **main** launch, one CTA per (key block of ``BLOCK_N`` keys, batch x KV head), in
  the order the ``LPT`` knob picks (0: a head's key blocks side by side, sharing its Q and
  dO in L2; 1: FA3's longest-processing-time order, the key blocks outer and first, in
  sections of as many heads as L2 holds the Q, dO and dQ accumulator of: under a causal
  mask a GQA group's first key blocks walk every query block of every query head of the
  group, and in the other order one of them can start last and run alone), warp
  specialized: a **producer**
  warp TMA-loads K and V once and streams Q and dO tiles (with the rows' LSE and delta,
  by cp.async on the same mbarrier) through a ring of ``NUM_STAGES`` buffers (``q_ready``
  / ``do_ready`` / ``qdo_empty`` mbarriers) for every query block at or below the diagonal
  (causal) of every query head of the GQA group;
  ``NUM_CONSUMERS`` **consumer** warpgroups, each owning ``BLOCK_N / NUM_CONSUMERS`` keys,
  compute ``S^T = K Q^T`` and ``dP^T = V dO^T`` (two async wgmma, the exp2 of ``P^T``
  while the second runs), ``dS^T = P^T (dP^T - delta)`` (its rows of a double-buffered
  shared tile, ``ds_ready``), ``dV += P^T dO`` and ``dK += dS^T Q`` accumulated in
  registers (fp32) over the whole walk, and ``HEAD_D / NUM_CONSUMERS`` columns of ``dS K``
  over all the CTA's keys (FA3's split of the dQ product: one partial a CTA and step);
  a **dQ writer** (2 warps, the producer's warpgroup) adds each partial to the accumulator
  with fp32 vector atomics off the consumers' path (or, ``DQ_TMA``, with TMA bulk
  reduce-adds as FA3's writer does);
* a **convert** launch: ``dQ = scale * accumulator`` in the input dtype.

At D256 the consumers split the head dim instead of the keys (FA3's hdim 256 backward,
``kernel._consumer_d``): dK and dV of a 64-key block, 64 x 256 fp32 each, do not fit one
warpgroup's 240 registers, so each of the two consumers holds half their columns for every
key of the block; it computes ``S^T`` and ``dP^T`` for half the step's 64 query rows,
writes its columns of the step's ``P^T`` and ``dS^T`` to shared memory, and once both halves
are in runs its columns of ``dV``, ``dK`` and the step's ``dS K``, which it adds to the
accumulator itself with fp32 atomics (in two 64-column slices, the first's atomics under
the dV and dK wgmmas): the dQ writer's staging tile would not fit beside the ring of two Q
and dO tiles (the kernel takes 225 of the 227 KiB). One tile shape (64 x 64, two stages),
a grid launch; ``LPT``, ``TMA_STORE`` and ``EXPAND_GQA`` as at the other head dims.

With ``PERSISTENT`` (dense batches) the main launch is at most one CTA an SM walking the same
tiles in the same order, each CTA several: the next tile's K, V and first Q and dO load
while the last tile's dK and dV are stored, where a grid launch starts every CTA cold. At
short sequences, where a CTA walks few steps, that pays: on an H200 D64 MHA training steps
ran 1.00-1.07x the grid launch at N 512-4k (causal with ``LPT`` 1), so the default uses it
there (``space.persistent_by_default``; causal up to 2k since the walks below); at D128 the
tile loop spills in the consumers and ran slower (the tuner may still time it).

A causal sliding window (``WINDOW``, FlashAttention-2's ``window_size = (left, 0)``) ends a
key block's walk at the last query block that sees it (``kernel._steps``), so the work is
O(N x window) as in the forward, and masks the window's edge behind the causal mask's
branch (one unsigned compare of the distance ``pos - key``). A softcap (``SOFTCAP``,
Gemma 2's and Grok's) recomputes the forward's capped scores with the same hardware tanh and
takes ``dS`` through it, ``1 - tanh^2``, the tanh read back from P (``log2 P + lse``: kept
instead, the score tile's registers spilled the D128 consumers' loop). Either is a constexpr
off by default: a kernel without them compiles to the instructions it had.

Under a causal mask at D64 (``kernel.DIAGONAL_LAST_MAX_D``; not with a window) every partition walks a CTA's
query blocks that no key of its block is masked in first, from the last down, and the
mask's diagonal last (``kernel._step_block``), and the consumers run the two in loops of
their own: the unmasked loop has no mask and no branch on one, 30% fewer instructions
(FA3's backward splits its loop the same way). On an H200 the main kernel ran 1.02-1.04x
the one loop's at N 4k-16k (``benchmarks/results/bwd_diag_last_d64_h200.json``). At D128
ptxas spills in the unmasked loop of the split (1.03-1.20x slower), so D128 keeps one loop
with the mask behind a branch. With ``DQ_TMA`` the dQ writer adds each partial
by TMA bulk reduce-adds (FA3's writer) instead of vector atomics: 1.03x the main kernel at
D128 without a mask, the default there (``space.dq_tma_by_default``).

With ``EXPAND_GQA`` a GQA problem runs as MHA, a CTA per key block and query head (the
kernel's ``KV_GROUP`` reads the group's K and V), dK and dV written per query head and
summed over the group after (FlashAttention-2's GQA backward). Under a causal mask the
grouped walk's CTAs drift apart across the group's heads and keep more Q, dO and dQ rows in
flight than L2 holds: on an H200 8:1 D128 ran 0.74x cuDNN's step grouped and 0.89-0.93x per
query head, the default where the group outgrows L2 (``space.expand_gqa_by_default``).

dQ's atomics make its last bits depend on the CTAs' order: ``Limits.deterministic`` is
False, and a caller asking for reproducible gradients (FlashAttention-2's
``deterministic=True``) runs ``attn_fwd`` with ``attn_bwd``. dK and dV are exact sums in a
fixed order.

Registered: this backward (op ``bwd``, serving no user op by itself, as ``attn_bwd``), and
its training pair ``attn_fwd_gluon_bwd_gluon``: attn_fwd_gluon's forward (same kernel, same
source hash, ``serves=("train",)`` only) whose ``backward`` is this template, so ``flashtune
tune --op train`` searches the pair beside the others and the router runs it only where a
tuning run stored it as the measured winner (nothing routes to it by default). And a
second pair, ``attn_fwd_bwd_gluon``: attn_fwd's forward (same kernel and hash,
``serves=("train",)``) with this backward, which serves what attn_fwd_gluon's forward cannot
and this backward can: packed batches (attn_fwd's varlen forward, then this kernel's
``VARLEN``). :func:`flashtune.attention_varlen` with gradients runs it on sm_90 by default
(``runtime.scored.PACKED_TRAIN_DEFAULT``): on an H200, a 7-document 16k-token GQA 32:8 D128
causal batch's backward ran 1.50x attn_bwd's (393 against 262 TFLOP/s, and 1.46x
FlexAttention's; ``benchmarks/results/packed_bwd_h200.json``). ``Limits.packed`` also lets
the tuner time this backward on packed ``bwd`` problems (attn_bwd's ``make_case`` passes the
``cu_seqlens``). And a third, ``sdpa_cudnn_bwd_gluon``: SDPA cuDNN's forward (it returns
the LSE, natural log, as this backward reads it) with this backward, where cuDNN's forward
leads flashtune's (short causal sequences) and this backward leads or ties cuDNN's: on an
H200, tuned, D64 causal training steps at N 512-4k ran 1.02-1.18x cuDNN's step
(``benchmarks/results/train_d64_causal_h200.json``). Its hash carries torch's and cuDNN's
versions (``TemplateSpec.torch_bound``), as an SDPA backend's does.

Gluon has no interpreter mode: ``needs_gpu``, sm_90 only. ``space.py``'s predicate reads
``sm90_compile.json`` (:mod:`.prefilter`); numerics are checked on the GPU
(``tests/kernel_templates_tests/test_attn_bwd_gluon.py`` and ``..._varlen.py``, marked
``gpu``) and by the tuner against fp32 before timing, as for every implementation.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from flashtune.core.spec import Limits
from flashtune.kernel_templates.attn_bwd.case import make_case
from flashtune.kernel_templates.attn_bwd.reference import attn_bwd_reference
from flashtune.kernel_templates.attn_bwd_gluon.kernel import gluon_attn_bwd_kernel
from flashtune.kernel_templates.attn_bwd_gluon.launcher import HEAD_DIMS, attn_bwd_gluon
from flashtune.kernel_templates.attn_bwd_gluon.space import SPACE, default_config
from flashtune.kernel_templates.attn_bwd_gluon.warmup import warmup_launches
from flashtune.kernel_templates.attn_fwd import SPEC as FWD_TL
from flashtune.kernel_templates.attn_fwd_gluon import SPEC as FWD_GLUON
from flashtune.kernel_templates.registry import TemplateSpec, register_template, source_hash
from flashtune.kernel_templates.sdpa_cudnn import SPEC as FWD_CUDNN

_HERE = Path(__file__).parent
# the training pair's name: attn_fwd_gluon's forward with this backward
PAIR_NAME = "attn_fwd_gluon_bwd_gluon"

SPEC = register_template(TemplateSpec(
    name="attn_bwd_gluon",
    op="bwd",
    source_hash=source_hash(_HERE / "kernel.py", _HERE / "launcher.py"),
    launcher=attn_bwd_gluon,
    reference=attn_bwd_reference,
    space=SPACE,
    default_config=default_config,
    make_case=make_case,
    warmup_launches=warmup_launches,
    kernel=gluon_attn_bwd_kernel,
    kind="gluon",
    limits=Limits(head_dims=HEAD_DIMS, dtypes=("fp16", "bf16"), gqa=True,
                  causal_unaligned=True, lse=True, needs_gpu=True, capabilities=((9, 0),),
                  packed=True, deterministic=False, score_mods=("causal_window", "softcap")),
))

# the pair's forward: attn_fwd_gluon as it is (its kernel, space, hash), for train only
PAIR_SPEC = register_template(replace(FWD_GLUON, name=PAIR_NAME, serves=("train",),
                                      backward=SPEC.name))
# attn_fwd's forward (its kernel, space, hash) with this backward, for train only: the
# pair of packed batches (attn_fwd_gluon has no varlen)
TL_PAIR_NAME = "attn_fwd_bwd_gluon"
TL_PAIR_SPEC = register_template(replace(FWD_TL, name=TL_PAIR_NAME, serves=("train",),
                                         backward=SPEC.name))

# SDPA cuDNN's forward (it returns the LSE, natural log, (batch, heads, seqlen_q), as this
# backward reads it) with this backward, for train only: where cuDNN's forward leads
# flashtune's (short causal sequences) and this backward leads cuDNN's (D64 causal)
CUDNN_PAIR_NAME = "sdpa_cudnn_bwd_gluon"
CUDNN_PAIR_SPEC = register_template(replace(
    FWD_CUDNN, name=CUDNN_PAIR_NAME, kind="gluon", serves=("train",), backward=SPEC.name,
    paired_backward=None))

__all__ = ["CUDNN_PAIR_NAME", "CUDNN_PAIR_SPEC", "PAIR_NAME", "PAIR_SPEC", "SPACE", "SPEC",
           "TL_PAIR_NAME", "TL_PAIR_SPEC", "attn_bwd_gluon", "default_config",
           "gluon_attn_bwd_kernel"]

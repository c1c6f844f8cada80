"""attn_fwd_gluon: a Hopper flash-attention forward in Gluon with FlashAttention-3's
structure, an implementation of the user op ``fwd`` (sm_90, head dims 64, 128 and 256, fp16
and bf16, GQA, bottom-right causal, the LSE, a causal sliding window, a softcap); the tuner
searches it beside ``attn_fwd``.

Issue 7's remaining gap to cuDNN is what Triton's ``tl`` cannot say on Hopper in 3.6 (see
``benchmarks/README.md``): wgmma left in flight while the softmax runs, and producer/consumer
warp specialization with explicit barriers. Gluon (``triton.experimental.gluon``) says both.
This kernel is FA3's forward (Shah et al. 2024, Algorithm 1 and 2) written in Gluon:

* a **producer** partition (1 warp, 24 registers) issues the TMA loads: each consumer's Q
  tile once, then K and V tiles into a ring of ``NUM_STAGES`` buffers; ``k_ready`` /
  ``v_ready`` mbarriers say a buffer is full, ``kv_empty`` (one arrival per consumer) that
  every consumer is done with it;
* ``NUM_CONSUMERS`` **consumer** warpgroups (4 warps each), each owning ``ROWS`` query rows of
  the CTA's ``NUM_CONSUMERS * ROWS``; the warp scheduler runs one's softmax while the other's
  wgmmas use the tensor cores (inter-warpgroup overlap, without FA3's explicit ping-pong
  barriers unless ``PINGPONG``);
* inside a consumer, **intra-warpgroup overlap** (FA3 Algorithm 2): ``S_j = Q K_j^T`` and
  ``O += P_{j-1} V_{j-1}`` are issued back to back as async wgmma, the wait lets only the
  first complete, and the softmax of ``S_j`` runs while ``P_{j-1} V_{j-1}`` is still on the
  tensor cores; ``O`` is rescaled after that second wait;
* exp2 with the softmax scale folded in; masking (causal diagonal, ragged key end) only on
  the blocks that need it; causal query tiles launched longest first; ``lse`` in natural log
  as ``attn_fwd`` stores it;
* ``SOFTCAP`` (a constexpr: the cap times log2 e): the scores capped as FlashAttention's
  softcap, ``cap * tanh(s / cap)``, with the hardware's ``tanh.approx.f32`` (FA2's and
  FA3's ``fast_tanh``), the scale into the tanh and the cap's log2 e out of it; Gemma 2
  caps every layer at 50;
* ``PERSISTENT``: a CTA per SM looping over the tiles (FA3's persistent kernel: the next
  tile's loads overlap this one's epilogue), with ``LPT`` the causal tiles longest first
  across the heads of an L2-sized section (FA3's longest-processing-time order; the
  head-major order gives a CTA striding by a multiple of the query blocks tiles of one
  length only).
* ``TMA_STORE``: the epilogue writes a whole tile's O into the consumer's Q buffer (free once
  its last ``S`` is issued and done) and stores it with one TMA copy, FA3's epilogue,
  instead of each thread's scattered stores from registers; a tile that runs past the
  sequence's end stores from registers (the 2-D view's next rows are another head's). A
  persistent consumer then releases its Q buffer after the store is read out, not before
  its last ``P V``.
* ``Q_BUFFERS`` 2 (persistent): two sets of Q buffers, the tiles of a CTA alternating
  between them, so the next tile's Q lands while this tile's epilogue still holds (or,
  with ``TMA_STORE``, stores O through) its buffer; FA3 keeps O in a buffer of its own.
* ``SPLIT_KV``: a K buffer is released once its ``S`` is done and a V buffer once its
  ``P V`` is (FA3's separate K and V pipelines), so the producer loads the next K a step
  earlier and 2 stages feed the main loop as 3 did, leaving room for the second Q set.

``kernel.py`` holds the ``@gluon.jit`` code, ``launcher.py`` plans and launches it (and
compiles it for sm_90 without a GPU), ``space.py`` is the search space, whose validity
predicate reads ``sm90_compile.json`` (registers, spills, shared memory of every point,
compiled on the CPU by ``prefilter.py``), ``warmup.py`` the compile-only launch,
``protocol.py`` model-checks the barrier protocol, ``plan.py`` replays a call signature
without the launcher's per-call work (the runtime's hot path). Gluon has no interpreter mode, so the
spec declares ``needs_gpu`` and sm_90 only (``Limits``); its numerics are checked on the GPU
(``tests/kernel_templates_tests/test_attn_fwd_gluon.py``, marked ``gpu``, and
``benchmarks/explore_fwd_gluon.py``), and the tuner checks every trial against the float32
reference like any implementation's. Importing this package imports triton's Gluon frontend
(no GPU needed) but compiles nothing.
"""

from __future__ import annotations

import functools
from pathlib import Path

from flashtune.core.case import forward_case
from flashtune.core.spec import Limits
from flashtune.kernel_templates.attn_fwd.reference import attn_fwd_reference
from flashtune.kernel_templates.attn_fwd_gluon.kernel import gluon_attn_fwd_kernel
from flashtune.kernel_templates.attn_fwd_gluon.launcher import HEAD_DIMS, attn_fwd_gluon
from flashtune.kernel_templates.attn_fwd_gluon.plan import AttnFwdGluonPlan
from flashtune.kernel_templates.attn_fwd_gluon.space import SPACE, default_config, seed_configs
from flashtune.kernel_templates.attn_fwd_gluon.warmup import warmup_launches
from flashtune.kernel_templates.registry import TemplateSpec, register_template, source_hash

_HERE = Path(__file__).parent

SPEC = register_template(TemplateSpec(
    name="attn_fwd_gluon",
    op="fwd",
    source_hash=source_hash(_HERE / "kernel.py", _HERE / "launcher.py"),
    launcher=attn_fwd_gluon,
    reference=attn_fwd_reference,
    space=SPACE,
    default_config=default_config,
    seed_configs=seed_configs,
    make_case=functools.partial(forward_case, attn_fwd_reference),
    warmup_launches=warmup_launches,
    kernel=gluon_attn_fwd_kernel,
    kind="gluon",
    serves=("fwd", "train"),
    backward="attn_bwd",
    plan=AttnFwdGluonPlan,
    limits=Limits(head_dims=HEAD_DIMS, dtypes=("fp16", "bf16"), gqa=True,
                  causal_unaligned=True, lse=True, needs_gpu=True, capabilities=((9, 0),),
                  score_mods=("causal_window", "softcap")),
))

__all__ = ["SPACE", "SPEC", "attn_fwd_gluon", "default_config", "gluon_attn_fwd_kernel",
           "seed_configs"]

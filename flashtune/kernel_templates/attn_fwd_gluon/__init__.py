"""attn_fwd_gluon: a Hopper flash-attention forward in Gluon, FlashAttention-3's structure
(an experiment; not registered as a template yet).

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
  as ``attn_fwd`` stores it.

``kernel.py`` holds the ``@gluon.jit`` code, ``launcher.py`` plans and launches it (and
compiles it for sm_90 without a GPU), ``protocol.py`` model-checks its barrier protocol.
Its numerics cannot be checked under the CPU interpreter (Gluon has none), so it is checked
on the GPU (``benchmarks/explore_fwd_gluon.py``) before anything else; on the CPU,
``tests/kernel_templates_tests/test_gluon_fwd_compile.py`` compiles it for sm_90. Importing
this package imports nothing of Gluon: the modules do.
"""

from __future__ import annotations

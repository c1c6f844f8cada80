"""attn_bwd_gluon on packed variable-length sequences (FlashAttention-2's varlen layout, the
kernels' ``VARLEN``): the declaration, the packed plan (grids over the longest sequence,
scratch padded per sequence, ``(total, H * D)`` TMA views), the launcher's refusals by
argument name, the VARLEN kernel compiled for sm_90 (CPU), and (GPU, sm_90,
``FLASHTUNE_TEST_DEVICE=cuda``) the gradients of packed batches against an fp32 reference
computed sequence by sequence, and against attn_bwd's varlen gradients.

The forward's out and LSE ``(Hq, total_q)`` come from attn_fwd with the same ``cu_seqlens``
(as the tuner's packed case makes them).
"""

from __future__ import annotations

import itertools
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flashtune.core.device import DeviceFingerprint
from flashtune.core.errors import DeviceError, InputError, InputTypeError
from flashtune.core.problem import AttentionProblem
from flashtune.kernel_templates import get_template
from flashtune.kernel_templates.attn_bwd_gluon import space
from flashtune.kernel_templates.attn_bwd_gluon.launcher import (
    DEFAULT_CONFIG,
    PRE_BLOCK,
    attn_bwd_gluon,
    packed_layout,
    plan,
    scratch_shapes,
)
from flashtune.kernel_templates.shaped import Shaped
from tests.helpers import assert_grads_close

SPEC = get_template("attn_bwd_gluon")
H100 = DeviceFingerprint("NVIDIA_H100_80GB_HBM3", "9.0", 132, 232448, 85 * 2**30)
ROOT = Path(__file__).resolve().parents[2]


def _config(**knobs: int) -> dict[str, int]:
    return {**DEFAULT_CONFIG, **knobs}


def _cu(lengths: list[int], device: str = "cpu") -> torch.Tensor:
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=device)


# -- the declaration ---------------------------------------------------------------------------

def test_it_declares_packed_batches_within_its_other_limits() -> None:
    for d in (64, 128, 256):
        p = AttentionProblem.from_lengths([1, 17, 200, 333], [40, 17, 129, 333], heads_q=8,
                                          heads_kv=2, head_dim=d, causal=True, dtype="bf16")
        assert SPEC.refuse(p, H100) is None
        assert space.check(SPEC.default_config(p, H100), p, H100) is None
    p96 = AttentionProblem.from_lengths([17, 200], None, heads_q=4, heads_kv=4, head_dim=96,
                                        causal=False, dtype="fp16")
    assert "head_dim 96" in SPEC.refuse(p96, H100)
    assert "dropout" in SPEC.refuse(
        AttentionProblem.from_lengths([17, 200], None, heads_q=4, heads_kv=4, head_dim=64,
                                      causal=False, dtype="fp16", dropout=0.1), H100)


# -- the packed plan, from shapes --------------------------------------------------------------

def _plan(lens_q: list[int], lens_k: list[int], hq: int, hkv: int, d: int,
          config: dict[str, int], causal: bool = True, dlse: bool = False) -> dict:
    dt = torch.bfloat16
    tq, tk = sum(lens_q), sum(lens_k)
    q, k = Shaped(dt, (tq, hq, d)), Shaped(dt, (tk, hkv, d))
    mq, mk = max(lens_q), max(lens_k)
    scratch = {n: Shaped(torch.float32, s)
               for n, s in scratch_shapes((len(lens_q), hq, mq, d), config).items()}
    lse = Shaped(torch.float32, (hq, tq))
    return plan(q, k, k, Shaped(dt, q.shape), lse, Shaped(dt, q.shape), Shaped(dt, q.shape),
                Shaped(dt, k.shape), Shaped(dt, k.shape), scratch, config, causal=causal,
                scale=0.125, dlse=lse if dlse else None, cu_seqlens_q=_cu(lens_q),
                cu_seqlens_k=_cu(lens_k), max_seqlen_q=mq, max_seqlen_k=mk)


def test_the_packed_plan_covers_the_longest_sequence_of_every_sequence() -> None:
    """Grids ``(key blocks of the longest key sequence, sequences x KV heads)``, the scratch
    rows padded per sequence to the longest query rounded up to BLOCK_M, the TMA views
    ``(total, H * D)`` (a head's tile at column ``h * D``), the LSE's row length total_q,
    no batch strides, VARLEN and the cu_seqlens on all three launches."""
    lens_q, lens_k = [1, 17, 200, 129, 64, 333], [5, 17, 200, 1000, 64, 0]
    config = _config(BLOCK_M=128)
    tq, tk = sum(lens_q), sum(lens_k)
    shapes = scratch_shapes((6, 8, 333, 64), config)
    assert shapes == {"lse2": (48, 384), "delta": (48, 384), "dq_acc": (48 * 384, 64)}
    launches = _plan(lens_q, lens_k, 8, 2, 64, config)
    assert list(launches) == ["preprocess", "main", "convert"]
    pre_k, pre_args, pre_kw, pre_grid = launches["preprocess"]
    assert pre_grid == (384 // PRE_BLOCK, 6 * 8)
    assert pre_kw["VARLEN"] and pre_kw["cu_q_ptr"] is not None and not pre_kw["HAS_DLSE"]
    assert pre_args[7:10] == (0, 64, 8 * 64)  # out: (batch, head, token) strides
    assert pre_args[-3:] == (8, tq, 384)  # heads_q, the LSE's row length, Nq_pad
    kernel, args, kwargs, grid = launches["main"]
    assert grid == (math.ceil(1000 / 128), 6 * 2)
    q_desc, k_desc, v_desc, do_desc = args[:4]
    assert q_desc.shape == do_desc.shape == [tq, 8 * 64] and q_desc.block_shape == [128, 64]
    assert k_desc.shape == v_desc.shape == [tk, 2 * 64] and k_desc.block_shape == [128, 64]
    assert q_desc.strides == [8 * 64, 1] and k_desc.strides == [2 * 64, 1]
    assert args[9:12] == (0, 64, 2 * 64)  # dK's strides: no batch stride
    assert args[12:15] == (333, 1000, 384)  # the longest sequences, Nq_pad
    assert kwargs["VARLEN"] and kwargs["CAUSAL"] and not kwargs["LPT"]
    assert kwargs["cu_q_ptr"] is not None and kwargs["cu_k_ptr"] is not None
    conv = launches["convert"]
    assert conv[3] == (math.ceil(333 / PRE_BLOCK), 6 * 8) and conv[2]["VARLEN"]
    assert conv[1][2:5] == (0, 64, 8 * 64)
    assert _plan(lens_q, lens_k, 8, 2, 64, config, dlse=True)["preprocess"][2]["HAS_DLSE"]


def test_the_packed_plan_walks_longest_first_in_sections_of_sequences_x_heads() -> None:
    lens = [4096, 1000, 3000, 8000]
    launches = _plan(lens, lens, 32, 8, 128, _config(LPT=1))
    kernel, args, kwargs, grid = launches["main"]
    assert kwargs["LPT"] and grid == (math.ceil(8000 / 128) * 4 * 8, 1)
    # one (sequence, KV head) pair a section: the longest's Q, dO and fp32 dQ accumulator
    # (4 query heads of 8000 rows) take 33 of L2's 40 MB
    assert args[-1] == 0


def test_dense_plans_pass_no_cu_seqlens_and_varlen_off() -> None:
    """Dense launches bind the cu_seqlens pointers to None (no parameter: the dense kernels
    compile to the code they did before VARLEN)."""
    dt = torch.bfloat16
    q, k = Shaped(dt, (2, 8, 333, 64)), Shaped(dt, (2, 2, 517, 64))
    scratch = {n: Shaped(torch.float32, s)
               for n, s in scratch_shapes(q.shape, DEFAULT_CONFIG).items()}
    launches = plan(q, k, k, Shaped(dt, q.shape), Shaped(torch.float32, q.shape[:3]),
                    Shaped(dt, q.shape), Shaped(dt, q.shape), Shaped(dt, k.shape),
                    Shaped(dt, k.shape), scratch, DEFAULT_CONFIG, causal=True, scale=0.125)
    for _, _, kwargs, _ in launches.values():
        assert kwargs["VARLEN"] is False
        assert all(kwargs[n] is None for n in ("cu_q_ptr", "cu_k_ptr") if n in kwargs)


def test_packed_tensors_are_read_in_place_where_tma_can_address_them() -> None:
    """Contiguous ``(total, H, D)`` and a slice of a packed qkv (token stride 3 H D) are read
    through their own views; heads not ``D`` apart, or a token stride TMA cannot take, are
    copied."""
    x = torch.empty(77, 4, 64, dtype=torch.bfloat16)
    assert packed_layout(x)
    qkv = torch.empty(77, 3, 4, 64, dtype=torch.bfloat16)
    assert packed_layout(qkv[:, 0]) and packed_layout(qkv[:, 2])
    assert not packed_layout(torch.empty(77, 4, 72, dtype=torch.bfloat16)[..., :64])
    assert not packed_layout(torch.empty(77, 4 * 64 + 4, dtype=torch.bfloat16)[:, :256]
                             .view(77, 4, 64))
    assert not packed_layout(x.transpose(0, 1).contiguous().transpose(0, 1))
    lens = [30, 47]
    cu = _cu(lens)
    q = qkv[:, 0]
    k = torch.empty(77, 2, 64, dtype=torch.bfloat16)
    scratch = {n: torch.empty(s) for n, s in
               scratch_shapes((2, 4, 47, 64), DEFAULT_CONFIG).items()}
    lse = torch.empty(4, 77)
    launches = plan(q, k, k, q, lse, q, torch.empty_like(x), k, k, scratch, DEFAULT_CONFIG,
                    causal=False, scale=0.125, cu_seqlens_q=cu, cu_seqlens_k=cu,
                    max_seqlen_q=47, max_seqlen_k=47)
    q_desc = launches["main"][1][0]
    assert q_desc.shape == [77, 4 * 64] and q_desc.strides == [3 * 4 * 64, 1]


# -- the launcher's refusals (CPU tensors: every argument check comes before the device's) ---

def _packed(d: int = 64, hq: int = 4, hkv: int = 2, lens: tuple[int, ...] = (30, 47)):
    t = sum(lens)
    q = torch.zeros(t, hq, d, dtype=torch.bfloat16)
    k = torch.zeros(t, hkv, d, dtype=torch.bfloat16)
    return q, k, torch.zeros(hq, t), _cu(list(lens))


def test_the_packed_launcher_refuses_what_it_cannot_serve_by_argument() -> None:
    q, k, lse, cu = _packed()

    def call(**kw):
        args = dict(q=q, k=k, v=k, out=q, lse=lse, dout=q, config=DEFAULT_CONFIG,
                    cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=47, max_seqlen_k=47)
        args.update(kw)
        return attn_bwd_gluon(**args)

    with pytest.raises(InputTypeError, match="cu_seqlens_q must be int32"):
        call(cu_seqlens_q=cu.long())
    with pytest.raises(InputTypeError, match="cu_seqlens_k must be a torch.Tensor"):
        call(cu_seqlens_k=[0, 30, 77])
    with pytest.raises(InputError, match="cu_seqlens_k must be 1-D"):
        call(cu_seqlens_k=cu[None])
    with pytest.raises(InputError, match="cu_seqlens_q must be 1-D"):
        call(cu_seqlens_q=cu[:1])
    with pytest.raises(InputError, match="cu_seqlens_k has 4 entries and cu_seqlens_q 3"):
        call(cu_seqlens_k=_cu([30, 40, 7]))
    with pytest.raises(InputError, match="cu_seqlens_q is on meta"):
        call(cu_seqlens_q=torch.zeros(3, dtype=torch.int32, device="meta"))
    with pytest.raises(InputError, match="cu_seqlens_k is required"):
        call(cu_seqlens_k=None)
    with pytest.raises(InputError, match="cu_seqlens_q is required"):
        call(cu_seqlens_q=None)
    with pytest.raises(InputError, match="max_seqlen_q must be a non-negative int"):
        call(max_seqlen_q=-1)
    with pytest.raises(InputError, match="max_seqlen_k .100. exceeds the 77"):
        call(max_seqlen_k=100)
    with pytest.raises(InputError, match=r"packed lse \(and dlse\) must be \(heads_q, "
                                         r"total_q\) = \(4, 77\)"):
        call(lse=torch.zeros(1, 4, 77))
    with pytest.raises(InputError, match="dlse"):
        call(dlse=torch.zeros(77, 4))
    with pytest.raises(InputError, match="packed q, k, v, out, dout must be 3-D"):
        call(q=q[None], out=q[None], dout=q[None])
    with pytest.raises(InputError, match="heads_q .4. must be a multiple of heads_kv .3."):
        k3 = torch.zeros(77, 3, 64, dtype=torch.bfloat16)
        call(k=k3, v=k3)
    q96, k96, _, _ = _packed(d=96)
    with pytest.raises(InputError, match="head_dim must be one of"):
        call(q=q96, k=k96, v=k96, out=q96, dout=q96)
    with pytest.raises(InputTypeError, match="fp16 or bf16"):
        call(q=q.float(), out=q.float(), dout=q.float())
    # every argument right: what is left is the device
    with pytest.raises(DeviceError, match="CUDA GPU"):
        call()
    with pytest.raises(DeviceError, match="CUDA GPU"):
        call(max_seqlen_q=None, max_seqlen_k=None)


# -- the VARLEN kernel compiled for sm_90 (CPU) -----------------------------------------------

_COMPILE = """
import json, sys
from flashtune.kernel_templates.attn_bwd_gluon.launcher import DEFAULT_CONFIG, compile_sm90
from flashtune.kernel_templates.attn_fwd_gluon.launcher import ptxas_stats
for case in json.loads(sys.argv[1]):
    c = compile_sm90(DEFAULT_CONFIG, case["head_dim"], case["causal"], varlen=True)
    print(json.dumps({**case, "shared": c.metadata.shared, "warps": c.metadata.num_warps,
                      **ptxas_stats(c.asm["ptx"])}))
"""


def test_the_varlen_kernel_compiles_for_sm90_within_its_budget_at_each_head_dim() -> None:
    """The default config's VARLEN kernel at D64 and D128 (causal: the masks by each
    sequence's lengths): spills within the table's allowance, shared memory as the dense
    kernel's, the register split and the wgmma left in flight kept."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    cases = [{"head_dim": 64, "causal": False}, {"head_dim": 128, "causal": True}]
    proc = subprocess.run([sys.executable, "-c", _COMPILE, json.dumps(cases)],
                          capture_output=True, check=False, text=True, env=env, timeout=600,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(got) == len(cases)
    table = space.load_table()
    for g in got:
        dense = table[space.entry_key(g["head_dim"], g["causal"], {**DEFAULT_CONFIG, "LPT": 0})]
        print(f"VARLEN d{g['head_dim']} causal={g['causal']}: spill "
              f"{sum(g['spill_store_bytes'])} B (dense {dense.spill_bytes} B), shared "
              f"{g['shared']} B")
        assert sum(g["spill_store_bytes"]) <= space.SPILL_LIMIT, g
        assert g["shared"] == dense.shared, g
        assert g["warps"] == 12, g
        assert ["dec", "24"] in g["setmaxnreg"] and ["inc", "240"] in g["setmaxnreg"], g
        assert 1 in g["wgmma_wait_depths"], g


# -- numerics on the GPU (sm_90) ---------------------------------------------------------------

SEQS = [1, 17, 200, 129, 64, 333]
GPU_CASES = [  # (id, lengths_q, lengths_k, heads_q, heads_kv, head_dim, causal)
    ("gqa-d128-causal", SEQS, SEQS, 4, 2, 128, True),
    ("mha-d64", SEQS, SEQS, 2, 2, 64, False),
    ("gqa-d64-causal", SEQS, SEQS, 4, 2, 64, True),
    ("mha-d128", SEQS, SEQS, 2, 2, 128, False),
    # empty sequences: no tokens at all, queries without keys (dQ 0), keys without queries
    # (dK, dV 0: their CTAs walk no step)
    ("empty-gqa-d128-causal", [64, 0, 129, 0, 17], [64, 0, 129, 40, 0], 4, 2, 128, True),
    ("empty-mha-d64", [64, 0, 129, 0, 17], [64, 0, 129, 40, 0], 2, 2, 64, False),
    # Nq != Nk per sequence: bottom-right alignment by each one's lengths, rows that see
    # no key where Nq > Nk
    ("cross-mqa-d64-causal", [17, 200, 1, 333, 70], [40, 129, 64, 333, 300], 4, 1, 64, True),
    # several key blocks per sequence, GQA 4:1 as packed training batches
    ("long-gqa-d128-causal", [1000, 517, 2048, 3], [1000, 517, 2048, 3], 8, 2, 128, True),
    # D256: the consumers split the head dim
    ("gqa-d256-causal", SEQS, SEQS, 4, 2, 256, True),
    ("empty-mha-d256", [64, 0, 129, 0, 17], [64, 0, 129, 40, 0], 2, 2, 256, False),
    ("cross-mqa-d256-causal", [17, 200, 1, 333, 70], [40, 129, 64, 333, 300], 4, 1, 256,
     True),
]
CASE_IDS = [c[0] for c in GPU_CASES]


def _packed_inputs(lens_q, lens_k, hq, hkv, d, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    tq, tk = sum(lens_q), sum(lens_k)

    def rand(n, h):
        return torch.randn(n, h, d, device="cuda", dtype=dtype, generator=g)
    return (rand(tq, hq), rand(tk, hkv), rand(tk, hkv), rand(tq, hq), _cu(lens_q, "cuda"),
            _cu(lens_k, "cuda"))


def _forward(q, k, v, cu_q, cu_k, lens_q, lens_k, causal):
    from flashtune.core.device import cuda_device

    fwd = get_template("attn_fwd")
    p = AttentionProblem.from_lengths(lens_q, lens_k, heads_q=q.shape[1], heads_kv=k.shape[1],
                                      head_dim=q.shape[2], causal=causal,
                                      dtype="bf16" if q.dtype == torch.bfloat16 else "fp16")
    out, lse = fwd.launcher(q, k, v, fwd.default_config(p, cuda_device()), causal=causal,
                            return_lse=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                            max_seqlen_q=max(lens_q), max_seqlen_k=max(lens_k))
    return p, out, lse


def _references(q, k, v, do, lens_q, lens_k, causal):
    """``(exact, low)``: sequence by sequence, fp32 autograd through plain attention and
    the same in the inputs' precision (torch's own error, the tolerance's baseline), packed
    again; zeros for a sequence with no queries or no keys."""
    from flashtune.kernel_templates.attn_bwd.reference import attn_bwd_reference

    refs = []
    for dtype in (torch.float32, q.dtype):
        grads = [torch.zeros(t.shape, device="cuda", dtype=dtype) for t in (q, k, v)]
        sq, sk = 0, 0
        for nq, nk in zip(lens_q, lens_k):
            if nq and nk:
                seq = [t[a:a + n].transpose(0, 1)[None]
                       for t, a, n in ((q, sq, nq), (k, sk, nk), (v, sk, nk), (do, sq, nq))]
                dq, dk, dv = attn_bwd_reference(*seq, causal=causal, dtype=dtype)
                grads[0][sq:sq + nq] = dq[0].transpose(0, 1)
                grads[1][sk:sk + nk] = dk[0].transpose(0, 1)
                grads[2][sk:sk + nk] = dv[0].transpose(0, 1)
            sq, sk = sq + nq, sk + nk
        refs.append(tuple(grads))
    return refs[0], refs[1]


def _tl_backward(p, q, k, v, out, lse, do, cu_q, cu_k, lens_q, lens_k, causal, dlse=None):
    from flashtune.core.device import cuda_device

    ref = get_template("attn_bwd")
    return ref.launcher(q, k, v, out, lse, do, ref.default_config(p, cuda_device()),
                        causal=causal, dlse=dlse, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                        max_seqlen_q=max(lens_q), max_seqlen_k=max(lens_k))


def _close(got, want, bound=1e-2):
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        rel = ((g.float() - w.float()).norm() / w.float().norm().clamp_min(1e-30)).item()
        assert rel < bound, f"{name}: {rel:.3e} from attn_bwd's"


def _run(config, q, k, v, out, lse, do, cu_q, cu_k, lens_q, lens_k, causal, dlse=None):
    return attn_bwd_gluon(q, k, v, out, lse, do, config, causal=causal, dlse=dlse,
                          cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max(lens_q),
                          max_seqlen_k=max(lens_k))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("case", GPU_CASES, ids=CASE_IDS)
def test_packed_gradients_match_the_reference_sequence_by_sequence(case, dtype) -> None:
    """The default config against the fp32 reference (assert_grads_close's rule) and
    against attn_bwd's varlen gradients; every key of every sequence written (dK, dV of
    keys no query sees: 0), the padding between sequences never."""
    from flashtune.core.device import cuda_device

    _, lens_q, lens_k, hq, hkv, d, causal = case
    q, k, v, do, cu_q, cu_k = _packed_inputs(lens_q, lens_k, hq, hkv, d, dtype)
    p, out, lse = _forward(q, k, v, cu_q, cu_k, lens_q, lens_k, causal)
    config = SPEC.default_config(p, cuda_device())
    assert space.check(config, p, cuda_device()) is None
    got = _run(config, q, k, v, out, lse, do, cu_q, cu_k, lens_q, lens_k, causal)
    assert all(g.is_contiguous() for g in got)
    assert_grads_close(got, q, k, v, do, causal=causal,
                       refs=_references(q, k, v, do, lens_q, lens_k, causal))
    _close(got, _tl_backward(p, q, k, v, out, lse, do, cu_q, cu_k, lens_q, lens_k, causal))


@pytest.mark.gpu
@pytest.mark.parametrize("d,causal", [(64, False), (64, True), (128, False), (128, True)],
                         ids=["d64", "d64-causal", "d128", "d128-causal"])
def test_packed_gradients_for_each_structural_variant(d, causal) -> None:
    """Every config the predicate accepts for the packed problem in the 2-D order (one
    consumer over 64 keys, two over 128, two and three stages) and the default's twin in
    the longest-first order (sections of (sequence, KV head) pairs), its dQ by TMA
    reduce-adds and its dK and dV by TMA stores, bf16, GQA 4:2."""
    from flashtune.core.device import cuda_device

    lens = SEQS
    q, k, v, do, cu_q, cu_k = _packed_inputs(lens, lens, 4, 2, d, torch.bfloat16, seed=1)
    p, out, lse = _forward(q, k, v, cu_q, cu_k, lens, lens, causal)
    refs = _references(q, k, v, do, lens, lens, causal)
    configs = [dict(c) for c in space.SPACE
               if c["LPT"] == 0 and c["TMA_STORE"] == 0
               and space.check(c, p, cuda_device()) is None]
    assert len(configs) >= 3
    configs += [_config(LPT=1), _config(DQ_TMA=1)]  # dQ by TMA reduce-adds into padded rows
    configs += [_config(TMA_STORE=1)]  # whole blocks of dK, dV by TMA from a sequence's start
    for config in configs:
        got = _run(config, q, k, v, out, lse, do, cu_q, cu_k, lens, lens, causal)
        assert_grads_close(got, q, k, v, do, causal=causal, refs=refs)


@pytest.mark.gpu
@pytest.mark.parametrize("d,cap", [(64, 0.0), (128, 0.0), (128, 30.0)],
                         ids=["d64-w200", "d128-w200", "d128-w200-cap30"])
def test_packed_windows_and_a_softcap_match_attn_bwd(d, cap) -> None:
    """A causal sliding window (each sequence's own positions, bottom-right aligned) and a
    softcap on packed sequences, some shorter than the window and some keys before every
    window (Nq < Nk): the default's and the longest-first config's gradients against
    attn_bwd's (which serves both), from attn_fwd's forward; with a softcap within 2% (the
    forward's tanh is exact, this kernel's the hardware's)."""
    lens_q, lens_k = [1000, 517, 150, 3], [1000, 900, 600, 3]
    q, k, v, do, cu_q, cu_k = _packed_inputs(lens_q, lens_k, 8, 2, d, torch.bfloat16, seed=4)
    if cap:
        q = q * 4
    mods = {"window": (200, 0), "softcap": cap or None}
    fwd = get_template("attn_fwd")
    from flashtune.core.device import cuda_device

    p = AttentionProblem.from_lengths(lens_q, lens_k, heads_q=8, heads_kv=2, head_dim=d,
                                      causal=True, dtype="bf16", window_left=200,
                                      softcap=cap)
    packing = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max(lens_q),
                   max_seqlen_k=max(lens_k))
    out, lse = fwd.launcher(q, k, v, fwd.default_config(p, cuda_device()), causal=True,
                            return_lse=True, **mods, **packing)
    ref = get_template("attn_bwd")
    want = ref.launcher(q, k, v, out, lse, do, ref.default_config(p, cuda_device()),
                        causal=True, **mods, **packing)
    for config in (SPEC.default_config(p, cuda_device()), _config(LPT=1, TMA_STORE=1)):
        got = attn_bwd_gluon(q, k, v, out, lse, do, config, causal=True, **mods, **packing)
        _close(got, want, bound=2e-2 if cap else 1e-2)
    # the keys of sequence 1 before its every query's window: dK = dV = 0
    unseen = 900 - 517 - 200
    assert not got[1][1000:1000 + unseen].any() and not got[2][1000:1000 + unseen].any()


@pytest.mark.gpu
def test_packed_lse_gradient_and_strided_inputs_match_attn_bwd() -> None:
    """dLSE ``(Hq, total_q)`` (a strided view) and q, k, v read in place from slices of a
    packed qkv (token stride 3 H D, MHA): the same gradients as attn_bwd's varlen
    backward with the same dLSE."""
    lens = [1, 17, 200, 129, 64, 333]
    h, d, causal = 4, 128, True
    g = torch.Generator(device="cuda").manual_seed(3)
    t = sum(lens)
    qkv = torch.randn(t, 3, h, d, device="cuda", dtype=torch.bfloat16, generator=g)
    q, k, v = qkv[:, 0], qkv[:, 1], qkv[:, 2]
    assert packed_layout(q) and not q.is_contiguous()
    do = torch.randn(t, h, d, device="cuda", dtype=torch.bfloat16, generator=g)
    cu = _cu(lens, "cuda")
    p, out, lse = _forward(q, k, v, cu, cu, lens, lens, causal)
    dlse = torch.randn(t, h, device="cuda", generator=g).t()
    got = _run(DEFAULT_CONFIG, q, k, v, out, lse, do, cu, cu, lens, lens, causal, dlse=dlse)
    want = _tl_backward(p, q, k, v, out, lse, do, cu, cu, lens, lens, causal, dlse=dlse)
    _close(got, want)
    plain = _run(DEFAULT_CONFIG, q, k, v, out, lse, do, cu, cu, lens, lens, causal)
    assert_grads_close(plain, q, k, v, do, causal=causal,
                       refs=_references(q, k, v, do, lens, lens, causal))


@pytest.mark.gpu
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_attention_varlen_trains_through_the_gluon_backward(compiled) -> None:
    """``flashtune.attention_varlen`` with gradients on sm_90 routes the packed batch to
    attn_fwd's forward and this backward (``scored.PACKED_TRAIN_DEFAULT``), eager and under
    ``torch.compile`` (the varlen custom ops), and its gradients match the fp32 reference
    sequence by sequence."""
    import flashtune
    from flashtune.runtime import scored

    lens = [1, 17, 200, 129, 64, 333]
    q, k, v, do, cu, _ = _packed_inputs(lens, lens, 8, 2, 128, torch.bfloat16, seed=4)
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    flashtune.reload_configs()

    def step(q, k, v):
        return flashtune.attention_varlen(q, k, v, cu, cu, max(lens), max(lens), causal=True)

    run = torch.compile(step, fullgraph=True) if compiled else step
    got = torch.autograd.grad(run(*leaves), leaves, do)
    routes = [r for r in scored._ROUTES.values() if r[2] is not None]
    assert routes and all((r[0].name, r[2].name) == ("attn_fwd_bwd_gluon", "attn_bwd_gluon")
                          for r in routes), routes
    assert_grads_close(got, q, k, v, do, causal=True,
                       refs=_references(q, k, v, do, lens, lens, True))
    flashtune.reload_configs()

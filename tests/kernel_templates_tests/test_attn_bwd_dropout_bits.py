"""attn_bwd's DROPOUT_BITS knob (issue 31): the dK/dV kernel stores the dropout keep mask it
builds as bits, the dQ kernel reads them instead of drawing Philox again. Checked here: the
gradients equal the knob-off ones bit for bit and the fp32 reference with the kernels' own
mask (GQA, causal Nq != Nk, a window, packed sequences); the words the dK/dV kernel writes
are the mask in the documented layout; the dQ kernel reads the words (fed another mask, it
follows that one); the space's refusals, the defaults, and the scratch's size.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from flashtune.core.problem import AttentionProblem
from flashtune.kernel_templates.attn_bwd import SPEC, attn_bwd
from flashtune.kernel_templates.attn_bwd.launcher import dropout_bits_shape, kernel_args
from flashtune.kernel_templates.attn_bwd.space import (
    KNOBS,
    MAX_DROPOUT_BITS_BYTES,
    dropout_bits_words,
)
from flashtune.kernel_templates.dropout import dropout_mask
from flashtune.kernel_templates.sm90 import H100
from tests.helpers import assert_grads_close
from tests.kernel_templates_tests.test_attn_bwd_dropout import grad_refs, packed_case
from tests.kernel_templates_tests.test_attn_dropout import P, make, seed_tensor

# the smallest tiles the bit layout allows (64-query, 32-key words)
BITS = {"BLOCK_M1": 64, "BLOCK_N1": 32, "BLOCK_M2": 64, "BLOCK_N2": 32, "num_warps": 2,
        "num_stages": 1}


def pack(mask: torch.Tensor) -> torch.Tensor:
    """The bit array of a bool mask ``(B, H, 64 * NQB, 32 * NKB)``, in torch: ``(B * H,
    NQB * NKB * 64)`` int32 words, the layout of ``attn_bwd/kernel.py``'s ``_bits_offsets``
    (word ``(qb, kb, j4, i21, j210)``, bit ``16 i5 + 8 i4 + 4 i0 + 2 i3 + j3``)."""
    b, h, nq, nk = mask.shape
    m = mask.reshape(b * h, nq // 64, 2, 2, 2, 4, 2, nk // 32, 2, 2, 8).long()
    # (bh, qb, i5, i4, i3, i21, i0, kb, j4, j3, j210) -> (bh, qb, kb, j4, i21, j210 | i5, i4,
    # i0, i3, j3)
    m = m.permute(0, 1, 7, 8, 5, 10, 2, 3, 6, 4, 9).reshape(b * h, -1, 32)
    words = (m << torch.arange(32, device=mask.device)).sum(-1)
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


CASES = [
    # (id, (B, Hq, Hkv, Nq, Nk, D), modifications, config knobs)
    ("gqa-causal-kvsplits", (1, 4, 2, 77, 133, 32), dict(causal=True),
     {"KV_SPLITS": 2, "SPLIT_LOOPS": 1}),
    ("full-nq-gt-nk", (2, 2, 1, 133, 45, 16), {}, {}),
    ("window-split", (1, 2, 2, 70, 99, 32), dict(window=(20, 5)), {"SPLIT_LOOPS": 1}),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bits_give_the_same_gradients_as_the_regenerated_mask(device, case):
    _, shape, mods, knobs = case
    b, hq, _, nq, nk, _ = shape
    q, k, v, do = make(shape, torch.float16, device, seed=4)
    seed = seed_tensor(device)
    mask = dropout_mask(seed, b, hq, nq, nk, P)
    out, lse, refs = grad_refs(q, k, v, do, mask, **mods)
    args = (q, k, v, out.to(q.dtype), lse.float(), do)
    plain = attn_bwd(*args, {**BITS, **knobs}, dropout_p=P, seed=seed, **mods)
    bits = attn_bwd(*args, {**BITS, **knobs, "DROPOUT_BITS": 1}, dropout_p=P, seed=seed, **mods)
    assert all(torch.equal(x, y) for x, y in zip(plain, bits))  # same mask, same arithmetic
    assert_grads_close(bits, q, k, v, do, causal=False, refs=refs)
    again = attn_bwd(*args, {**BITS, **knobs, "DROPOUT_BITS": 1}, dropout_p=P, seed=seed,
                     **mods)
    assert all(torch.equal(x, y) for x, y in zip(bits, again))  # run to run


def test_packed_sequences(device):
    q, k, v, do, cu_q, cu_k, seed, out, lse, refs = packed_case([(70, 40), (23, 90)], 7, device)
    varlen = dict(causal=True, dropout_p=P, seed=seed, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                  max_seqlen_q=70, max_seqlen_k=90)
    args = (q, k, v, out, lse, do)
    plain = attn_bwd(*args, BITS, **varlen)
    got = attn_bwd(*args, {**BITS, "DROPOUT_BITS": 1}, **varlen)
    assert all(torch.equal(x, y) for x, y in zip(plain, got))
    assert_grads_close(got, q, k, v, do, causal=False, refs=refs)


def _launches(q, k, v, do, seed, bits, config):
    b, hq, nq, _ = q.shape
    lse = torch.zeros(b, hq, nq, device=q.device)
    delta = torch.empty_like(lse)
    grads = [torch.empty_like(t) for t in (q, k, v)]
    launches = kernel_args(q, k, v, q, lse, do, delta, *grads, config, causal=False,
                           scale=0.25, upcast_dot=False, dropout_p=P, seed=seed, bits=bits)
    return launches, grads


def test_the_dkdv_kernel_writes_the_mask_in_the_documented_layout(device):
    """Every word (a non-causal problem: every tile visited) is the packed mask of the tiles'
    padded extent; the words start as a sentinel, so an unwritten one would show."""
    q, k, v, do = make((1, 2, 2, 77, 45, 16), torch.float16, device, seed=5)
    seed = seed_tensor(device)
    shape = dropout_bits_shape(BITS, 1, 2, 77, 45)
    bits = torch.full(shape, 0x5A5A5A5A, dtype=torch.int32, device=device)
    launches, _ = _launches(q, k, v, do, seed, bits, {**BITS, "DROPOUT_BITS": 1})
    for name in ("preprocess", "dkdv"):
        kernel, args, kwargs, grid = launches[name]
        kernel[grid](*args, **kwargs)
    words, nkb = dropout_bits_words(BITS, 77, 45)
    nqb = words // 64 // nkb
    want = pack(dropout_mask(seed, 1, 2, 64 * nqb, 32 * nkb, P))
    assert torch.equal(bits, want)


def test_the_dq_kernel_reads_the_bits_not_philox(device):
    """The dQ launch alone, over words packed from another seed's mask: its dQ is the
    reference's with that mask (and not with the call's own)."""
    shape = (1, 2, 2, 77, 45, 16)
    q, k, v, do = make(shape, torch.float16, device, seed=6)
    seed, other = seed_tensor(device), torch.tensor([12345], dtype=torch.int64, device=device)
    words, nkb = dropout_bits_words(BITS, 77, 45)
    nqb = words // 64 // nkb
    mask_other = dropout_mask(other, 1, 2, 64 * nqb, 32 * nkb, P)
    bits = pack(mask_other)
    out, lse, refs = grad_refs(q, k, v, do, mask_other[..., :77, :45])
    delta = torch.empty(1, 2, 77, device=device)
    dq = torch.empty_like(q)
    launches = kernel_args(q, k, v, out.to(q.dtype), lse.float().contiguous(), do, delta, dq,
                           torch.empty_like(k), torch.empty_like(v),
                           {**BITS, "DROPOUT_BITS": 1}, causal=False, scale=16 ** -0.5,
                           upcast_dot=q.dtype == torch.bfloat16, dropout_p=P, seed=seed,
                           bits=bits)
    for name in ("preprocess", "dq"):
        kernel, args, kwargs, grid = launches[name]
        kernel[grid](*args, **kwargs)
    exact, low = refs[0][0], refs[1][0]
    err = (dq.double() - exact).abs().max().item()
    assert err <= 2 * (low.double() - exact).abs().max().item() + 1e-3
    _, _, own = grad_refs(q, k, v, do, dropout_mask(seed, 1, 2, 77, 45, P))
    assert (dq.double() - own[0][0]).abs().max().item() > 10 * err


BERT = AttentionProblem(32, 12, 12, 512, 512, 64, False, "bf16", dropout=0.1)
BERT_BITS = {"BLOCK_M1": 64, "BLOCK_N1": 64, "BLOCK_M2": 64, "BLOCK_N2": 64, "num_warps": 4,
             "num_stages": 3, "SPLIT_LOOPS": 1, "USE_TMA": 1, "DROPOUT_BITS": 1}


def test_the_space_holds_the_knob_and_the_defaults_never_set_it():
    assert KNOBS["DROPOUT_BITS"] == (0, 1) and SPEC.space.defaults["DROPOUT_BITS"] == 0
    assert SPEC.space.check(BERT_BITS, BERT, H100) is None  # the tuner may pick it
    for d, n, causal in ((64, 512, False), (64, 2048, True), (128, 2048, False),
                         (256, 1024, True)):
        problem = AttentionProblem(4, 16, 16, n, n, d, causal, "bf16", dropout=0.1)
        assert SPEC.default_config(problem, H100).get("DROPOUT_BITS", 0) == 0


@pytest.mark.parametrize("change, problem_change, reason", [
    ({}, dict(dropout=0.0), "no dropout"),
    ({"ONE_LAUNCH": 1}, {}, "ONE_LAUNCH"),
    ({"BLOCK_M1": 32}, {}, "query tiles of 64"),
    ({"BLOCK_M2": 32}, {}, "query tiles of 64"),
    ({"BLOCK_N2": 16}, {}, "key tiles of 32"),
    ({}, dict(batch=4096), "scratch"),  # 1.5 GiB of bits
])
def test_the_predicate_refuses(change, problem_change, reason):
    problem = dataclasses.replace(BERT, **problem_change)
    refusal = SPEC.space.check({**BERT_BITS, **change}, problem, H100)
    assert refusal is not None and reason in refusal and "DROPOUT_BITS" in refusal


def test_the_scratch_size():
    # BERT-base: Nq x Nk / 8 bytes per query head exactly (tiles divide 512)
    rows, words = dropout_bits_shape(BERT_BITS, 32, 12, 512, 512)
    assert (rows, 4 * words) == (32 * 12, 512 * 512 // 8)
    # odd lengths: padded to the larger tile of each axis (128 queries, 64 keys here)
    cfg = {**BERT_BITS, "BLOCK_M2": 128}
    assert dropout_bits_shape(cfg, 2, 3, 77, 133) == (6, 128 * 192 // 32)
    assert 4 * 32 * 12 * words < MAX_DROPOUT_BITS_BYTES


def test_the_launcher_checks_the_scratch_and_one_launch(device):
    q, k, v, do = make((1, 2, 2, 64, 64, 16), torch.float16, device)
    seed = seed_tensor(device)
    cfg = {**BITS, "DROPOUT_BITS": 1}
    with pytest.raises(ValueError, match="int32 scratch of shape"):
        _launches(q, k, v, do, seed, None, cfg)
    with pytest.raises(ValueError, match="int32 scratch of shape"):
        _launches(q, k, v, do, seed, torch.empty(2, 7, dtype=torch.int32, device=device), cfg)
    with pytest.raises(ValueError, match="ONE_LAUNCH"):
        _launches(q, k, v, do, seed, None, {**cfg, "ONE_LAUNCH": 1})
    # off: no scratch, the kernels compiled without it
    def bits_of(launch):
        return launch[1][list(launch[0].arg_names).index("Bits")]

    launches, _ = _launches(q, k, v, do, seed, None, BITS)
    for name in ("dkdv", "dq"):
        assert launches[name][2]["DROPOUT_BITS"] is False and bits_of(launches[name]) is None
    shape = dropout_bits_shape(cfg, 1, 2, 64, 64)
    bits = torch.empty(shape, dtype=torch.int32, device=device)
    launches, _ = _launches(q, k, v, do, seed, bits, cfg)
    for name in ("dkdv", "dq"):
        assert launches[name][2]["DROPOUT_BITS"] is True and bits_of(launches[name]) is bits
    # ignored without dropout (the plain kernels)
    plain = kernel_args(q, k, v, q, torch.zeros(1, 2, 64, device=device), do,
                        torch.zeros(1, 2, 64, device=device), q, k, v, cfg, causal=False,
                        scale=0.25, upcast_dot=False)
    assert plain["dq"][2]["DROPOUT_BITS"] is False

"""Attention dropout (FlashAttention-2's ``dropout_p``, issue 31) in attn_fwd: the keep
mask is a function of (seed, b, h, i, j) alone (the documented Philox mapping, any tile),
kept at the quantised keep probability; the forward equals the float64 reference given the
materialised mask (the flash-attention tolerance rule of test_attn_fwd_mods); the LSE does
not see dropout; a seed gives the same bits every time; dropout_p 0 is the plain kernel.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from flashtune.core.problem import AttentionProblem
from flashtune.kernel_templates.attn_fwd import attn_fwd
from flashtune.kernel_templates.attn_fwd.launcher import kernel_args as fwd_kernel_args
from flashtune.kernel_templates.attn_fwd.reference import attn_fwd_reference
from flashtune.kernel_templates.attn_fwd.space import default_config
from flashtune.kernel_templates.dropout import (
    draw_seed,
    dropout_mask,
    dropout_threshold,
    keep_probability,
)
from flashtune.kernel_templates.sm90 import H100

FWD = {"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1}
FWD_32 = {"BLOCK_M": 32, "BLOCK_N": 32, "num_warps": 4, "num_stages": 1}
P = 0.2


def seed_tensor(device, value=0x1234_5678_9ABC):
    return torch.tensor([value], dtype=torch.int64, device=device)


def make(shape, dtype, device, seed=0):
    """Random ``q, k, v, do`` of ``shape = (b, hq, hkv, nq, nk, d)``."""
    b, hq, hkv, nq, nk, d = shape
    g = torch.Generator().manual_seed(seed)

    def rand(h, n):
        return torch.randn(b, h, n, d, generator=g).to(dtype).to(device)
    return rand(hq, nq), rand(hkv, nk), rand(hkv, nk), rand(hq, nq)


# -- the mask -----------------------------------------------------------------------------------

def _philox_4x32_7(seed: int, counter: list[int]) -> list[int]:
    """Philox-4x32 with 7 rounds, Triton's tl.philox (key = the seed's low and high words)."""
    m = 0xFFFF_FFFF
    k0, k1 = seed & m, (seed >> 32) & m
    c = [x & m for x in counter]
    for _ in range(7):
        p0, p2 = 0xD2511F53 * c[0], 0xCD9E8D57 * c[2]
        c = [((p2 >> 32) ^ c[1] ^ k0) & m, p2 & m, ((p0 >> 32) ^ c[3] ^ k1) & m, p0 & m]
        k0, k1 = (k0 + 0x9E3779B9) & m, (k1 + 0xBB67AE85) & m
    return c


def test_mask_is_the_documented_philox_mapping(device):
    """score_mods.dropout_keep's docstring, computed here in Python: byte 2 i3 + j3 of word
    2 j4 + j0 of the call at counter (b Hq + h, 8 (i // 16) + i % 8, 0, 4 (j // 32) +
    (j // 2) % 4), xb bit b of x, kept below the threshold."""
    seed, hq, nq, nk = 0x0123_4567_89AB_CDEF >> 2, 3, 21, 150
    mask = dropout_mask(seed_tensor(device, seed), 2, hq, nq, nk, P).cpu().numpy()
    thr = dropout_threshold(P)
    want = np.zeros_like(mask)
    for b, h in ((0, 0), (1, 2)):
        for i in range(nq):
            for j in range(nk):
                ic, jc = 8 * (i // 16) + i % 8, 4 * (j // 32) + (j // 2) % 4
                word = _philox_4x32_7(seed, [b * hq + h, ic, 0, jc])[2 * ((j // 16) % 2) + j % 2]
                byte = 2 * ((i // 8) % 2) + (j // 8) % 2
                want[b, h, i, j] = (word >> (8 * byte)) & 0xFF < thr
        np.testing.assert_array_equal(mask[b, h], want[b, h])


def test_mask_does_not_depend_on_the_tiles(device):
    """Materialised with several tile shapes (16 to 128 keys a tile), built as the forward
    and dQ kernels build it and transposed as the dK/dV kernel does, and as a slice of the
    first sequences and heads: the same mask."""
    seed = seed_tensor(device)
    masks = [dropout_mask(seed, 2, 3, 21, 150, P, block=blk)
             for blk in ((16, 16), (32, 32), (16, 64), (32, 128))]
    # the dK/dV kernel's transposed tiles, keys by queries
    masks += [dropout_mask(seed, 2, 3, 21, 150, P, block=blk, transposed=True)
              for blk in ((16, 16), (32, 64), (64, 16))]
    for m in masks[1:]:
        assert torch.equal(m, masks[0])
    assert masks[0].shape == (2, 3, 21, 150) and masks[0].dtype == torch.bool
    part = dropout_mask(seed, 2, 3, 21, 150, P, batches=1, heads=2, block=(32, 128))
    assert torch.equal(part, masks[0][:1, :2])
    other = dropout_mask(seed_tensor(device, 7), 2, 3, 21, 150, P, block=(32, 128))
    assert not torch.equal(other, masks[0])


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_kept_fraction_is_the_keep_probability(device, p):
    """Over 2^18 scores the kept fraction is within 5 sigma of ``threshold / 256``, and that
    is ``1 - p`` quantised to 1/256."""
    keep = keep_probability(p)
    assert abs(keep - (1 - p)) <= 1 / 512
    mask = dropout_mask(seed_tensor(device, 99), 2, 4, 128, 256, p, block=(64, 128))
    n = mask.numel()
    frac = mask.float().mean().item()
    assert abs(frac - keep) < 5 * math.sqrt(keep * (1 - keep) / n), (frac, keep)


def test_threshold_quantises_and_clamps():
    assert dropout_threshold(0.1) == 230 and keep_probability(0.1) == 230 / 256
    assert dropout_threshold(0.0) == 256
    assert dropout_threshold(0.999) == 1  # never a keep probability of 0
    assert dropout_threshold(1e-4) == 256  # below 1/512: nothing is dropped


# -- the forward --------------------------------------------------------------------------------

def fwd_reference(q, k, v, mask, **mods):
    exact = attn_fwd_reference(q, k, v, dtype=torch.float64, dropout_mask=mask, dropout_p=P,
                               **mods)
    low = attn_fwd_reference(q, k, v, dtype=q.dtype, dropout_mask=mask, dropout_p=P, **mods)
    return exact, low


def assert_out_close(out, exact, low, factor=2.0):
    """Flash-attention's rule: max error vs float64 at most ``factor`` x torch's own in the
    inputs' precision (plus a few ulps)."""
    assert not torch.isnan(out).any()
    err = (out.double() - exact).abs().max().item()
    pt_err = (low.double() - exact).abs().max().item()
    eps = torch.finfo(out.dtype).eps
    assert err <= factor * pt_err + 4 * eps * max(1.0, exact.abs().max().item()), (err, pt_err)


CASES = [
    # (id, (b, hq, hkv, nq, nk, d), modifications)
    ("full", (2, 2, 2, 37, 40, 32), {}),
    ("causal-gqa", (1, 4, 2, 23, 40, 32), dict(causal=True)),  # Nq < Nk, bottom-right
    ("window-mqa", (1, 4, 1, 40, 33, 16), dict(window=(7, 3))),
]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_forward_matches_reference_with_the_mask(device, case, dtype):
    _, shape, mods = case
    q, k, v, _ = make(shape, dtype, device)
    seed = seed_tensor(device)
    out, lse = attn_fwd(q, k, v, FWD, return_lse=True, dropout_p=P, seed=seed, **mods)
    b, hq, _, nq, nk, _ = shape
    mask = dropout_mask(seed, b, hq, nq, nk, P)
    (exact, ref_lse), (low, _) = fwd_reference(q, k, v, mask, **mods)
    assert_out_close(out, exact, low)
    # the normaliser is over every score: the LSE is the one without dropout
    _, plain_lse = attn_fwd(q, k, v, FWD, return_lse=True, **mods)
    finite = torch.isfinite(ref_lse)
    assert torch.equal(lse, plain_lse)
    assert (lse.double()[finite] - ref_lse[finite]).abs().max() < 1e-3


def test_forward_mean_is_the_attention_without_dropout(device):
    """With V the identity the output rows are P Z / keep itself: over many rows its row
    sums average 1 (the dropout is unbiased), and each one is 0 or 1 / keep times P."""
    b, h, n = 2, 8, 32
    g = torch.Generator().manual_seed(1)
    q = (torch.randn(b, h, n, n, generator=g) * 0.1).half().to(device)
    k = (torch.randn(b, h, n, n, generator=g) * 0.1).half().to(device)
    v = torch.eye(n).expand(b, h, n, n).half().contiguous().to(device)
    seed = seed_tensor(device, 5)
    out = attn_fwd(q, k, v, FWD_32, dropout_p=0.5, seed=seed).float()
    plain = attn_fwd(q, k, v, FWD_32).float()
    keep = keep_probability(0.5)
    mask = dropout_mask(seed, b, h, n, n, 0.5)
    torch.testing.assert_close(out, torch.where(mask, plain / keep, 0.0), atol=2e-3, rtol=2e-3)
    sums = out.sum(-1)  # rows: 512 draws of a sum of n Bernoulli-weighted probabilities
    sigma = math.sqrt((1 - keep) / keep / n) / math.sqrt(sums.numel())
    assert abs(sums.mean().item() - 1.0) < 5 * sigma


def test_same_seed_same_bits_and_tiles_change_only_rounding(device):
    q, k, v, _ = make((1, 2, 2, 40, 40, 32), torch.float16, device)
    seed = seed_tensor(device)
    a = attn_fwd(q, k, v, FWD, causal=True, dropout_p=P, seed=seed)
    assert torch.equal(a, attn_fwd(q, k, v, FWD, causal=True, dropout_p=P, seed=seed.clone()))
    c = attn_fwd(q, k, v, FWD_32, causal=True, dropout_p=P, seed=seed)
    torch.testing.assert_close(a, c, atol=2e-3, rtol=0)  # the same mask, other sums
    other = attn_fwd(q, k, v, FWD, causal=True, dropout_p=P, seed=seed_tensor(device, 3))
    assert not torch.equal(a, other)


def test_forward_draws_a_seed_from_torch_when_none_is_given(device):
    q, k, v, _ = make((1, 2, 2, 16, 16, 16), torch.float16, device)
    torch.manual_seed(11)
    a = attn_fwd(q, k, v, FWD, dropout_p=P)
    b = attn_fwd(q, k, v, FWD, dropout_p=P)
    torch.manual_seed(11)
    assert torch.equal(attn_fwd(q, k, v, FWD, dropout_p=P), a)
    assert not torch.equal(a, b)  # the generator moved on
    assert draw_seed(device).dtype == torch.int64


def test_zero_dropout_is_the_plain_launch(device):
    """dropout_p 0 passes what a call without dropout passes: HAS_DROPOUT off, no seed
    pointer (None, a constexpr), so the plain kernel (the same sm_90 code) runs."""
    q, k, v, _ = make((1, 2, 2, 16, 16, 16), torch.float16, device)
    out = torch.empty_like(q)
    common = dict(causal=True, scale=0.25, use_tma=False, upcast_dot=False)
    plain = fwd_kernel_args(q, k, v, out, None, FWD, **common)
    zero = fwd_kernel_args(q, k, v, out, None, FWD, dropout_p=0.0, seed=seed_tensor(device),
                           **common)
    from flashtune.kernel_templates.attn_fwd.kernel import attn_fwd_kernel

    at = attn_fwd_kernel.arg_names.index("Seed")  # Seed, DROPOUT_T
    assert plain[0][at:at + 2] == zero[0][at:at + 2] == (None, 0)
    assert plain[1] == zero[1] and plain[1]["HAS_DROPOUT"] is False
    on = fwd_kernel_args(q, k, v, out, None, FWD, dropout_p=P, seed=seed_tensor(device),
                         **common)
    assert on[1]["HAS_DROPOUT"] is True and on[0][at + 1] == dropout_threshold(P)
    with pytest.raises(ValueError, match="seed"):
        fwd_kernel_args(q, k, v, out, None, FWD, dropout_p=P, **common)


def test_varlen_forward_uses_each_sequences_own_positions(device):
    """Packed sequences: sequence b's scores use (b, h, i, j) within the sequence, so its
    mask is the dense mask's [b, :, :len_q, :len_k]."""
    seqs = [(23, 37), (1, 12), (40, 17)]
    hq, hkv, d = 4, 2, 32
    g = torch.Generator().manual_seed(4)
    tq, tk = sum(s[0] for s in seqs), sum(s[1] for s in seqs)
    q = torch.randn(tq, hq, d, generator=g).half().to(device)
    k = torch.randn(tk, hkv, d, generator=g).half().to(device)
    v = torch.randn(tk, hkv, d, generator=g).half().to(device)
    cu_q = torch.tensor([0, 23, 24, 64], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, 37, 49, 66], dtype=torch.int32, device=device)
    seed = seed_tensor(device)
    out = attn_fwd(q, k, v, FWD, causal=True, dropout_p=P, seed=seed, cu_seqlens_q=cu_q,
                   cu_seqlens_k=cu_k, max_seqlen_q=40, max_seqlen_k=37)
    mask = dropout_mask(seed, 3, hq, 40, 37, P)
    for b, (nq, nk) in enumerate(seqs):
        sq, sk = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
        qs, ks, vs = (t[s].transpose(0, 1)[None] for t, s in ((q, sq), (k, sk), (v, sk)))
        (exact, _), (low, _) = fwd_reference(qs, ks, vs, mask[b:b + 1, :, :nq, :nk],
                                             causal=True)
        assert_out_close(out[sq].transpose(0, 1)[None], exact, low)


def test_the_forward_builds_its_mask_in_registers_on_sm90():
    """The H100 default configs at D64 and D128 (BERT-base's shape, TMA on), compiled for
    sm_90 on the CPU with and without dropout: with the plain default's config the same
    shared memory (the mask needs no layout conversion through shared memory) and at most
    255 registers; the default with dropout spills nothing (at D64 it takes 64-key tiles
    at 8 warps, where the plain 128 x 128 tile at 4 warps spills with the mask: the
    figures are in the message); and dropout_p 0.999 (threshold 1) compiles."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    shape = {"template": "attn_fwd", "batch": 32, "heads": 12, "seqlen": 512}
    cases = [{**shape, "head_dim": d, "dropout": p} for d in (64, 128) for p in (0.0, 0.1)]
    plain_d64 = default_config(AttentionProblem(32, 12, 12, 512, 512, 64, False, "bf16"), H100)
    cases.append({**shape, "head_dim": 64, "dropout": 0.2, "config": plain_d64})
    # a threshold of 1 (dropout_p >= 0.998) is an integer Triton specialises as a constant
    cases.append({"template": "attn_fwd", "batch": 1, "heads": 2, "seqlen": 256,
                  "head_dim": 64, "dropout": 0.999})
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, "-m", "flashtune.kernel_templates.sm90",
                           json.dumps(cases)], capture_output=True, text=True, env=env,
                          timeout=900, cwd=root, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = {(g["head_dim"], g["dropout"]): g for g in
           (json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{"))}
    assert (64, 0.999) in got
    figures = {k: (g["registers"], g["spill_store_bytes"], g["shared"]) for k, g in got.items()}
    # same config, with and without the mask (dropout 0.2 at D64: the plain default's tile)
    for plain, drop in ((got[(64, 0.0)], got[(64, 0.2)]), (got[(128, 0.0)], got[(128, 0.1)])):
        assert drop["config"] == plain["config"], figures
        assert drop["shared"] == plain["shared"], figures
        assert drop["registers"] <= 255 and drop["cubin"] != plain["cubin"], figures
    assert got[(64, 0.1)]["config"]["BLOCK_N"] == 64, figures
    assert got[(64, 0.1)]["spill_store_bytes"] == 0, figures
    assert got[(128, 0.1)]["spill_store_bytes"] == 0, figures

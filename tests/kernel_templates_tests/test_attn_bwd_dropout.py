"""Attention dropout (FlashAttention-2's ``dropout_p``, issue 31) in attn_bwd: both kernels
regenerate the forward's mask, so dq, dk, dv equal autograd through the float64 reference
given the materialised mask (test_attn_bwd_mods' tolerance rule, ``assert_grads_close``),
with every backward knob (SPLIT_LOOPS, KV_SPLITS, ONE_LAUNCH) and packed sequences.
"""

from __future__ import annotations

import pytest
import torch

from flashtune.kernel_templates.attn_bwd import attn_bwd
from flashtune.kernel_templates.attn_bwd.launcher import kernel_args as bwd_kernel_args
from flashtune.kernel_templates.attn_fwd import attn_fwd
from flashtune.kernel_templates.attn_fwd.reference import attn_fwd_reference
from flashtune.kernel_templates.dropout import dropout_mask, dropout_threshold
from tests.helpers import assert_grads_close
from tests.kernel_templates_tests.test_attn_dropout import FWD, P, make, seed_tensor

BWD = {"BLOCK_M1": 16, "BLOCK_N1": 32, "BLOCK_M2": 32, "BLOCK_N2": 16, "num_warps": 2,
       "num_stages": 1}


def grad_refs(q, k, v, do, mask, **mods):
    """``(out, lse, (exact, low))``: the float64 forward with the mask, and the gradients of
    ``sum(out * do)`` through it in float64 and in the inputs' precision."""
    def run(dtype):
        leaves = [t.detach().to(dtype).requires_grad_(True) for t in (q, k, v)]
        out, lse = attn_fwd_reference(*leaves, dtype=dtype, dropout_mask=mask, dropout_p=P,
                                      **mods)
        return out.detach(), lse, torch.autograd.grad((out * do.to(dtype)).sum(), leaves)
    out, lse, exact = run(torch.float64)
    return out, lse, (exact, run(q.dtype)[2])


BWD_CASES = [
    # (id, shape, modifications, config knobs)
    ("full-split", (1, 2, 2, 37, 40, 32), {}, {"SPLIT_LOOPS": 1}),
    ("causal-gqa-kvsplits", (1, 4, 2, 23, 40, 32), dict(causal=True),
     {"KV_SPLITS": 2, "SPLIT_LOOPS": 1}),
    ("window-one-launch", (2, 2, 1, 40, 33, 16), dict(window=(7, 3)),
     {"ONE_LAUNCH": 1, "REVERSE_DQ": 1}),
]


@pytest.mark.parametrize("case", BWD_CASES, ids=[c[0] for c in BWD_CASES])
def test_backward_matches_autograd_through_the_masked_reference(device, case):
    _, shape, mods, knobs = case
    q, k, v, do = make(shape, torch.float16, device, seed=2)
    seed = seed_tensor(device)
    b, hq, _, nq, nk, _ = shape
    mask = dropout_mask(seed, b, hq, nq, nk, P)
    out, lse, refs = grad_refs(q, k, v, do, mask, **mods)
    got = attn_bwd(q, k, v, out.to(q.dtype), lse.float(), do, {**BWD, **knobs}, dropout_p=P,
                   seed=seed, **mods)
    assert_grads_close(got, q, k, v, do, causal=False, refs=refs)


def test_backward_of_the_forward_bf16_same_bits(device):
    """The backward of attn_fwd's own output (its mask regenerated in both backward
    kernels): close to the reference; run again: the same bits (no atomics)."""
    q, k, v, do = make((1, 2, 2, 33, 40, 32), torch.bfloat16, device, seed=3)
    seed = seed_tensor(device)
    out, lse = attn_fwd(q, k, v, FWD, causal=True, return_lse=True, dropout_p=P, seed=seed)
    got = attn_bwd(q, k, v, out, lse, do, BWD, causal=True, dropout_p=P, seed=seed)
    mask = dropout_mask(seed, 1, 2, 33, 40, P)
    _, _, refs = grad_refs(q, k, v, do, mask, causal=True)
    for g, r in zip(got, refs[0]):
        assert ((g.double() - r).norm() / r.norm()).item() < 2e-2
    again = attn_bwd(q, k, v, out, lse, do, BWD, causal=True, dropout_p=P, seed=seed)
    assert all(torch.equal(a, b) for a, b in zip(got, again))


def packed_case(seqs, seed, device):
    """A packed batch of ``seqs`` ((Nq, Nk) per sequence, GQA 2:1, D16) with dropout: the
    tensors, cumulative lengths, seed, and the per-sequence fp32 references (out, LSE and
    gradients through the masked reference) concatenated in packed order."""
    hq, hkv, d = 2, 1, 16
    g = torch.Generator().manual_seed(seed)
    tq, tk = sum(s[0] for s in seqs), sum(s[1] for s in seqs)
    q, do = (torch.randn(tq, hq, d, generator=g).half().to(device) for _ in range(2))
    k, v = (torch.randn(tk, hkv, d, generator=g).half().to(device) for _ in range(2))
    starts_q = [sum(s[0] for s in seqs[:i]) for i in range(len(seqs) + 1)]
    starts_k = [sum(s[1] for s in seqs[:i]) for i in range(len(seqs) + 1)]
    cu_q = torch.tensor(starts_q, dtype=torch.int32, device=device)
    cu_k = torch.tensor(starts_k, dtype=torch.int32, device=device)
    drop_seed = seed_tensor(device)
    mask = dropout_mask(drop_seed, len(seqs), hq, max(s[0] for s in seqs),
                        max(s[1] for s in seqs), P)
    outs, lses, grads = [], [], [[[], [], []], [[], [], []]]
    for b, (nq, nk) in enumerate(seqs):
        sq, sk = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
        seq = [t[s].transpose(0, 1)[None] for t, s in ((q, sq), (k, sk), (v, sk), (do, sq))]
        out, lse, refs = grad_refs(*seq, mask[b:b + 1, :, :nq, :nk], causal=True)
        outs.append(out[0].transpose(0, 1))
        lses.append(lse[0])
        for which in (0, 1):
            for i in range(3):
                grads[which][i].append(refs[which][i][0].transpose(0, 1))
    refs = tuple(tuple(torch.cat(x) for x in gs) for gs in grads)
    return (q, k, v, do, cu_q, cu_k, drop_seed, torch.cat(outs).half(),
            torch.cat(lses, dim=1).float(), refs)


def test_varlen_backward(device):
    q, k, v, do, cu_q, cu_k, seed, out, lse, refs = packed_case([(17, 30), (30, 9)], 6, device)
    got = attn_bwd(q, k, v, out, lse, do,
                   {**BWD, "KV_SPLITS": 1}, causal=True, dropout_p=P, seed=seed,
                   cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=30, max_seqlen_k=30)
    assert_grads_close(got, q, k, v, do, causal=False, refs=refs)


def test_backward_launch_arguments(device):
    """HAS_DROPOUT and the seed reach every main kernel (the fused one too); off, the seed's
    place holds the LSE (a pointer the plain kernels never read) and the flag is off."""
    q, k, v, do = make((1, 2, 2, 16, 16, 16), torch.float16, device)
    lse = torch.zeros(1, 2, 16, device=device)
    seed = seed_tensor(device)
    common = dict(causal=False, scale=0.25, upcast_dot=False)
    for knobs in ({}, {"ONE_LAUNCH": 1}):
        cfg = {**BWD, **knobs}
        on = bwd_kernel_args(q, k, v, q, lse, do, lse, q, k, v, cfg, dropout_p=P, seed=seed,
                             **common)
        off = bwd_kernel_args(q, k, v, q, lse, do, lse, q, k, v, cfg, **common)
        for name in on:
            if name == "preprocess":
                continue
            assert on[name][2]["HAS_DROPOUT"] is True and off[name][2]["HAS_DROPOUT"] is False
            at = list(on[name][0].arg_names).index("Seed")  # then DROPOUT_T
            assert on[name][1][at] is seed and on[name][1][at + 1] == dropout_threshold(P)
            assert off[name][1][at] is lse and off[name][1][at + 1] == 0
    with pytest.raises(ValueError, match="seed"):
        bwd_kernel_args(q, k, v, q, lse, do, lse, q, k, v, BWD, dropout_p=P, **common)


def test_the_backward_builds_its_masks_without_spills_on_sm90():
    """BERT-base's backward (D64, dropout 0.1), the H100 default config, compiled for sm_90
    on the CPU, with dropout and without (the same config): neither main kernel spills with
    the mask, and the dK/dV kernel's transposed mask costs at most 4 KiB of shared memory
    (Philox words moved between threads; the fp32 mask tile it used to convert took 16)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    from flashtune.core.problem import AttentionProblem
    from flashtune.kernel_templates import get_template
    from flashtune.kernel_templates.sm90 import H100

    root = Path(__file__).resolve().parents[2]
    bert = AttentionProblem(32, 12, 12, 512, 512, 64, False, "bf16", dropout=0.1)
    cfg = get_template("attn_bwd").default_config(bert, H100)
    case = {"template": "attn_bwd", "batch": 32, "heads": 12, "seqlen": 512, "head_dim": 64,
            "config": cfg}
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, "-m", "flashtune.kernel_templates.sm90",
                           json.dumps([{**case, "dropout": 0.1}, {**case, "dropout": 0.0}])],
                          capture_output=True, text=True, env=env, timeout=900, cwd=root,
                          check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = {(g["kernel"], g["dropout"]): g for g in
           (json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{"))}
    figures = {k: (g["registers"], g["spill_store_bytes"], g["shared"]) for k, g in got.items()}
    for kernel in ("attn_bwd_dkdv", "attn_bwd_dq"):
        drop, plain = got[(kernel, 0.1)], got[(kernel, 0.0)]
        assert drop["spill_store_bytes"] == 0 and drop["registers"] <= 255, figures
        assert drop["cubin"] != plain["cubin"], figures
    assert got[("attn_bwd_dkdv", 0.1)]["shared"] <= got[("attn_bwd_dkdv", 0.0)]["shared"] \
        + 4096, figures

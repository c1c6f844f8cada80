"""GPU-only checks of attention dropout (issue 31, item 2) on compiled kernels: the forward
and the gradients at D64/D128 against the float32 reference given the materialised mask
(default H100 configs, TMA on, and a spread of tiles that takes every path of the mask
helper: 16 to 128 keys a tile, KV_SPLITS, ONE_LAUNCH, SPLIT_LOOPS), the kept fraction, the
tuner's cases, and CUDA-graph replays drawing fresh masks (torch's generator advancing its
Philox offset inside the graph)."""

from __future__ import annotations

import math

import pytest
import torch

import flashtune
from flashtune.core.device import cuda_device
from flashtune.core.problem import AttentionProblem
from flashtune.kernel_templates import get_template
from flashtune.kernel_templates.attn_fwd.reference import attn_fwd_reference
from flashtune.kernel_templates.dropout import draw_seed, dropout_mask, keep_probability
from flashtune.kernel_templates.registry import implementations

pytestmark = pytest.mark.gpu
FWD, BWD = get_template("attn_fwd"), get_template("attn_bwd")
P = 0.1


def _inputs(b, hq, hkv, nq, nk, d, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)

    def rand(h, n):
        return torch.randn(b, h, n, d, device="cuda", generator=g).to(dtype)
    return rand(hq, nq), rand(hkv, nk), rand(hkv, nk), rand(hq, nq)


def _reference(q, k, v, do, mask, causal):
    """fp32 output and gradients of batch 0 and the first K/V head's query heads."""
    group = q.shape[1] // k.shape[1]
    leaves = [x[:1, :h].float().requires_grad_(True) for x, h in ((q, group), (k, 1), (v, 1))]
    out, _ = attn_fwd_reference(*leaves, causal=causal, dtype=torch.float32,
                                dropout_mask=mask[:1, :group], dropout_p=P)
    return out.detach(), torch.autograd.grad(out, leaves, do[:1, :group].float())


def _rel(got, ref):
    return ((got.float() - ref).norm() / ref.norm()).item()


SHAPES = [
    # (b, hq, hkv, nq, nk, d, causal)
    (4, 12, 12, 512, 512, 64, False),   # BERT-base's attention, a smaller batch
    (2, 16, 4, 1000, 1000, 128, True),  # GQA 4:1, ragged
    (1, 8, 8, 513, 777, 64, True),      # Nq < Nk
]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("shape", SHAPES,
                         ids=lambda s: "b{}h{}:{}q{}k{}d{}{}".format(*s[:6], "c" if s[6] else ""))
def test_default_configs_match_the_reference_with_the_mask(shape, dtype):
    b, hq, hkv, nq, nk, d, causal = shape
    q, k, v, do = _inputs(b, hq, hkv, nq, nk, d, dtype)
    p = AttentionProblem.from_tensors(q, k, causal=causal, dropout=P)
    dev = cuda_device()
    seed = draw_seed("cuda")
    out, lse = FWD.launcher(q, k, v, FWD.default_config(p, dev), causal=causal,
                            return_lse=True, dropout_p=P, seed=seed)
    grads = BWD.launcher(q, k, v, out, lse, do, BWD.default_config(p, dev), causal=causal,
                         dropout_p=P, seed=seed)
    mask = dropout_mask(seed, b, hq, nq, nk, P, batches=1, heads=hq // hkv)
    ref_out, ref_grads = _reference(q, k, v, do, mask, causal)
    tol = 2e-2 if dtype == torch.bfloat16 else 5e-3
    group = hq // hkv
    assert _rel(out[:1, :group], ref_out) < tol
    for g, r, h in zip(grads, ref_grads, (group, 1, 1)):
        assert _rel(g[:1, :h], r) < tol


FWD_CONFIGS = [
    {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 3, "USE_TMA": 1},
    {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3},
    {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4, "num_stages": 2},
    {"BLOCK_M": 64, "BLOCK_N": 16, "num_warps": 4, "num_stages": 2},
]
BWD_CONFIGS = [
    {"BLOCK_M1": 64, "BLOCK_N1": 128, "BLOCK_M2": 128, "BLOCK_N2": 64, "num_warps": 8,
     "num_stages": 3, "USE_TMA": 1, "ONE_LAUNCH": 1},
    {"BLOCK_M1": 32, "BLOCK_N1": 64, "BLOCK_M2": 64, "BLOCK_N2": 32, "num_warps": 4,
     "num_stages": 2, "SPLIT_LOOPS": 1, "KV_SPLITS": 2},
    {"BLOCK_M1": 16, "BLOCK_N1": 32, "BLOCK_M2": 32, "BLOCK_N2": 16, "num_warps": 4,
     "num_stages": 1},
]


@pytest.mark.parametrize("fcfg, bcfg", list(zip(FWD_CONFIGS, BWD_CONFIGS + BWD_CONFIGS[:1])),
                         ids=["tma", "bn64-kvsplits", "bn32", "bn16"])
def test_every_tile_path_draws_the_same_mask(fcfg, bcfg):
    q, k, v, do = _inputs(2, 8, 4, 300, 333, 64, torch.bfloat16, seed=1)
    seed = draw_seed("cuda")
    out, lse = FWD.launcher(q, k, v, fcfg, causal=True, return_lse=True, dropout_p=P,
                            seed=seed)
    grads = BWD.launcher(q, k, v, out, lse, do, bcfg, causal=True, dropout_p=P, seed=seed)
    mask = dropout_mask(seed, 2, 8, 300, 333, P, batches=1, heads=2)
    ref_out, ref_grads = _reference(q, k, v, do, mask, True)
    assert _rel(out[:1, :2], ref_out) < 2e-2
    for g, r, h in zip(grads, ref_grads, (2, 1, 1)):
        assert _rel(g[:1, :h], r) < 2e-2


def test_kept_fraction_and_unbiased_mean():
    """q = 0: every probability is 1 / Nk; v = 1: a row's output is kept / (Nk keep), so
    the mean output is 1 and the kept fraction keep = 230 / 256."""
    q = torch.zeros(8, 16, 1024, 64, device="cuda", dtype=torch.bfloat16)
    out = flashtune.attention(q, q, torch.ones_like(q), dropout_p=P).float()
    n = out[..., 0].numel() * 1024  # draws
    keep = keep_probability(P)
    assert abs(out.mean().item() - 1.0) < 5 * math.sqrt((1 - keep) / keep / n)


@pytest.mark.parametrize("op", ["fwd", "bwd", "train"])
def test_the_tuning_cases(op):
    problem = AttentionProblem(2, 12, 12, 512, 512, 64, False, "bf16", dropout=P)
    spec = {"fwd": FWD, "bwd": BWD,
            "train": next(s for s in implementations("train") if s.name == "attn_fwd")}[op]
    dev = cuda_device()
    case = spec.make_case(problem, dev, torch_device="cuda",
                          generator=torch.Generator(device="cuda").manual_seed(0),
                          launcher=spec.launcher)
    assert case.error(case.launch(spec.default_config(problem, dev))) < 2e-2


def test_cuda_graph_replays_draw_fresh_masks():
    """A captured dropout call: each replay draws a new seed (torch's CUDA generator
    advances its Philox offset inside the graph), so the outputs differ between replays,
    and each replay's output is the attention with the mask of the seed it drew."""
    q, k, v, _ = _inputs(2, 4, 4, 256, 256, 64, torch.bfloat16, seed=2)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm up (compile, tune lookups) outside the capture
        flashtune.attention(q, k, v, causal=True, dropout_p=P)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    seeds = []
    real = draw_seed

    def spy(device):
        seeds.append(real(device))
        return seeds[-1]

    import flashtune.runtime.scored as scored_mod
    scored_mod.draw_seed = spy
    try:
        with torch.cuda.graph(graph):
            out = flashtune.attention(q, k, v, causal=True, dropout_p=P)
    finally:
        scored_mod.draw_seed = real
    (seed,) = seeds  # the graph's seed buffer, refilled by each replay
    results = []
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        results.append((out.clone(), seed.clone()))
    assert len({int(sd) for _, sd in results}) == 3
    assert not torch.equal(results[0][0], results[1][0])
    for got, sd in results:
        mask = dropout_mask(sd, 2, 4, 256, 256, P, batches=1)
        ref, _ = attn_fwd_reference(q[:1], k[:1], v[:1], causal=True, dtype=torch.float32,
                                    dropout_mask=mask, dropout_p=P)
        assert _rel(got[:1], ref) < 2e-2

"""GPU-only checks of attention_with_kvcache's cache options (FlashAttention-2's append,
rotary, cache_batch_idx, cache_leftpad): compiled kernels at decode shapes (GQA 32:8, D 128,
caches to 8k, fp16 and bf16), the launch plan the hot path replays, CUDA-graph capture and
replay of a decoding step, the value checks on request, and the unchecked path inside NaN
guards (also the run to give ``compute-sanitizer --tool memcheck``).

    FLASHTUNE_TEST_DEVICE=cuda pytest tests/runtime_tests/test_kvcache_append_gpu.py
"""

from __future__ import annotations

import pytest
import torch

from flashtune.core.errors import InputError
from flashtune.core.problem import AttentionProblem
from flashtune.kernel_templates.attn_decode import attn_decode_kvcache
from flashtune.runtime import kvcache
from flashtune.runtime.kvcache import attention_with_kvcache
from tests.decode_helpers import append_case, assert_kvcache_close
from tests.runtime_tests.test_kvcache_append import UNCHECKED, _guard_case, _guards_intact

pytestmark = pytest.mark.gpu
DTYPES = [torch.float16, torch.bfloat16]
# ragged: empty, one key, odd, a page boundary, nearly full (capacity 8192)
LENS = [0, 1, 4097, 4096, 8192 - 16]


def _call(args, **kw):
    return attention_with_kvcache(args["q"], args["k_cache"], args["v_cache"],
                                  args["cache_seqlens"],
                                  **{n: t for n, t in args.items()
                                     if n not in ("q", "k_cache", "v_cache", "cache_seqlens")},
                                  **kw)


def _before(args):
    return {"k_cache": args["k_cache"].clone(), "v_cache": args["v_cache"].clone()}


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("page_size", [None, 16, 64, 256], ids=["contig", "p16", "p64", "p256"])
@pytest.mark.parametrize("nq,n_new,rotary_dim,interleaved,causal", [
    (1, 1, 128, False, True),   # a decode step, GPT-NeoX rotary on every dim (Llama)
    (4, 4, 64, True, True),     # speculative verification, GPT-J on half the dims
    (4, 2, 64, False, False),   # non-causal: q rotated at cache_seqlens only
], ids=["q1-neox128", "q4-gptj64", "q4-new2-noncausal"])
def test_append_and_rotary_at_decode_shapes(nq, n_new, rotary_dim, interleaved, causal,
                                            page_size, dtype):
    args = append_case(LENS, 32, 8, nq, n_new, 128, dtype, "cuda", page_size=page_size,
                       capacity=8192, rotary_dim=rotary_dim, seed=nq + n_new)
    before = _before(args)
    out, lse = _call(args, causal=causal, rotary_interleaved=interleaved, return_lse=True,
                     check_tables=True)
    assert_kvcache_close(out, args, before, lse=lse, causal=causal,
                         rotary_interleaved=interleaved)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
def test_batch_idx_leftpad_window_alibi(dtype):
    args = append_case([100, 0, 3000, 4000], 32, 8, 2, 2, 128, dtype, "cuda", capacity=4096,
                       rotary_dim=128, cos_dtype=torch.float32, batch_cache=6,
                       leftpad=[50, 0, 1, 3999], seed=3)
    slopes = torch.rand(4, 32, device="cuda") * 0.3
    before = _before(args)
    kw = dict(causal=True, window=(1000, -1), softcap=30.0, alibi_slopes=slopes)
    out = _call(args, check_tables=True, **kw)
    assert_kvcache_close(out, args, before, **kw)


@pytest.mark.parametrize("page_size", [None, 64], ids=["contig", "p64"])
def test_planned_calls_match_the_launcher_bit_for_bit(page_size):
    """The hot path (a plan per call signature) runs the launcher's kernels: same output,
    same caches; a plan follows new tensors of the same layout."""
    args = append_case([3000, 1, 4000, 77], 32, 8, 1, 1, 128, torch.bfloat16, "cuda",
                       page_size=page_size, capacity=4096, rotary_dim=128, seed=5)
    before = _before(args)
    cfg = kvcache.DISPATCH.choose(
        AttentionProblem(4, 32, 8, 1, 4096, 128, True, "bf16"),
        kvcache._device("cuda", args["q"].get_device())).config
    ref_args = {**args, **{n: t.clone() for n, t in before.items()}}
    extra = {n: t for n, t in ref_args.items()
             if n not in ("q", "k_cache", "v_cache", "cache_seqlens")}
    want = attn_decode_kvcache(ref_args["q"], ref_args["k_cache"], ref_args["v_cache"],
                               ref_args["cache_seqlens"], cfg, causal=True, **extra)
    kvcache.reset()
    for _ in range(3):  # the first call builds the plan, the others replay it
        got = _call(args, causal=True)
        assert torch.equal(got, want)
        assert torch.equal(args["k_cache"], ref_args["k_cache"])
        assert torch.equal(args["v_cache"], ref_args["v_cache"])
    assert kvcache._PLANS, "no plan was built"
    # new values, same layout: the plan's kernels on them
    args2 = {**args, "q": torch.randn_like(args["q"]), "k": torch.randn_like(args["k"]),
             "cache_seqlens": torch.tensor([2999, 0, 4095, 5], dtype=torch.int32,
                                           device="cuda"),
             "k_cache": before["k_cache"].clone(), "v_cache": before["v_cache"].clone()}
    out = _call(args2, causal=True)
    assert_kvcache_close(out, args2, before, causal=True)


@pytest.mark.parametrize("check_tables", [None, True], ids=["plan", "checks-skipped"])
def test_a_decoding_step_under_cuda_graph_capture_and_replay(check_tables):
    """Capture one step (append + rotary + attention); replay it with cache_seqlens and the
    new token's q/k/v updated in place, as a decoding loop does. The default call replays
    its plan; check_tables=True takes the launcher, its value checks skipped during capture
    (a copy to the host is illegal there)."""
    args = append_case([1000, 2048 - 8], 32, 8, 1, 1, 128, torch.bfloat16, "cuda",
                       page_size=64, capacity=2048, rotary_dim=128, seed=7)
    _call(args, causal=True)  # the plan is built (and the kernels compiled) outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _call(args, causal=True, check_tables=check_tables)
    for _ in range(3):
        args["cache_seqlens"].add_(1)
        for name in ("q", "k", "v"):
            args[name].copy_(torch.randn_like(args[name]))
        before = _before(args)
        graph.replay()
        torch.cuda.synchronize()
        assert_kvcache_close(out, args, before, causal=True)


def test_value_checks_on_request_name_the_argument():
    args = append_case([5, 40], 32, 8, 1, 2, 128, torch.float16, "cuda", capacity=48,
                       page_size=16, seed=9)
    args["cache_seqlens"] = torch.tensor([47, 5], dtype=torch.int32, device="cuda")
    with pytest.raises(InputError, match="block_table's capacity"):
        _call(args, check_tables=True)


@pytest.mark.parametrize("name,paged,mutate", UNCHECKED, ids=[u[0] for u in UNCHECKED])
def test_unchecked_bad_values_never_leave_the_tensors(name, paged, mutate):
    """No value checks (the default on CUDA): bad values give finite rows and no write
    outside the caches, whose NaN neighbours would show in the output if read."""
    args, bufs = _guard_case(page_size=16 if paged else None)  # on CUDA in a GPU run
    mutate(args)
    out, lse = _call(args, causal=True, return_lse=True, check_tables=False)
    torch.cuda.synchronize()
    assert torch.isfinite(out).all(), "a read outside the cache (NaN) reached the output"
    assert not torch.isnan(lse).any()
    for n in ("k_cache", "v_cache"):
        _guards_intact(args[n], bufs[n])

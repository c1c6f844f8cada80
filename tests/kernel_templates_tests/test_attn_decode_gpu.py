"""GPU-only decode checks: long ragged and paged caches, compiled kernels, fp16 and bf16."""

from __future__ import annotations

import pytest
import torch

from flashtune.core.problem import AttentionProblem
from flashtune.kernel_templates import get_template
from flashtune.kernel_templates.attn_decode import attn_decode_kvcache
from flashtune.kernel_templates.attn_decode.reference import attn_decode_reference
from flashtune.runtime.kvcache import attention_with_kvcache
from tests.decode_helpers import assert_decode_close, make_cache

pytestmark = pytest.mark.gpu
SPEC = get_template("attn_decode")
DTYPES = [torch.float16, torch.bfloat16]
# ragged: a long one, the capacity, a single key, an odd length, a page-boundary length
LENS = [4096, 32768, 1, 12345, 8192]


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("page_size", [None, 16, 64, 256], ids=["contig", "p16", "p64", "p256"])
@pytest.mark.parametrize("nq", [1, 4])
def test_long_caches_match_reference(nq, page_size, dtype):
    """GQA 32:8, D 128, Nk up to 32k, shuffled pages; the default config (with splits)."""
    q, k, v, lens, table = make_cache(LENS, 32, 8, nq, 128, dtype, "cuda",
                                      page_size=page_size, capacity=32768, seed=nq)
    out, lse = attention_with_kvcache(q, k, v, lens, block_table=table, return_lse=True,
                                      check_tables=True)
    assert_decode_close(out, q, k, v, cache_seqlens=lens, block_table=table, causal=True,
                        lse=lse)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
def test_a_spread_of_valid_configs_is_correct(dtype):
    from flashtune.core.device import cuda_device

    q, k, v, lens, table = make_cache([8000, 777, 6144], 32, 8, 2, 128, dtype, "cuda",
                                      page_size=64, capacity=8192, seed=7)
    ref, _ = attn_decode_reference(q, k, v, cache_seqlens=lens, block_table=table,
                                   causal=True, dtype=torch.float32)
    problem = AttentionProblem(3, 32, 8, 2, 8192, 128, True,
                               "fp16" if dtype == torch.float16 else "bf16")
    valid = SPEC.space.valid_configs(problem, cuda_device())
    # an even spread of 10 of the valid configs (compiling all of them takes minutes)
    configs = valid[:: max(1, len(valid) // 10)][:10]
    assert len(configs) >= 5
    for cfg in configs:
        out = attn_decode_kvcache(q, k, v, lens, cfg, block_table=table, causal=True)
        rel = ((out.float() - ref).norm() / ref.norm()).item()
        assert rel < 1e-2, (cfg, rel)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
def test_dense_entry_against_sdpa(dtype):
    """The dense entry on (B, N, H, D) storage: error vs fp32 at most 2x SDPA's (+eps)."""
    from flashtune.kernel_templates.attn_decode import attn_decode

    b, hq, hkv, nk, d = 4, 32, 8, 16384, 128
    q = torch.randn(b, 1, hq, d, device="cuda", dtype=dtype).transpose(1, 2)
    k = torch.randn(b, nk, hkv, d, device="cuda", dtype=dtype).transpose(1, 2)
    v = torch.randn(b, nk, hkv, d, device="cuda", dtype=dtype).transpose(1, 2)
    problem = AttentionProblem(b, hq, hkv, 1, nk, d, False, "bf16")
    from flashtune.core.device import cuda_device

    out = attn_decode(q, k, v, SPEC.default_config(problem, cuda_device()))
    ref, _ = attn_decode_reference(q, k, v, dtype=torch.float32)
    sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    err = (out.float() - ref).abs().max().item()
    sdpa_err = (sdpa.float() - ref).abs().max().item()
    assert err <= 2 * sdpa_err + torch.finfo(dtype).eps, (err, sdpa_err)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("page_size", [None, 64], ids=["contig", "p64"])
@pytest.mark.parametrize("d,heads", [(96, (32, 32)), (80, (32, 8)), (192, (16, 4))],
                         ids=["d96-mha", "d80-gqa", "d192-gqa"])
def test_head_dim_in_two_tiles_on_long_caches(d, heads, page_size, dtype):
    """SPLIT_D (96 = 64 + 32, 80 = 64 + 16, 192 = 128 + 64), compiled, ragged caches up to
    12k keys, with and without splits, beside the same config on one padded tile."""
    from flashtune.core.device import cuda_device

    q, k, v, lens, table = make_cache([4096, 12345, 1, 8191], *heads, 1, d, dtype, "cuda",
                                      page_size=page_size, capacity=12345 + 7, seed=d)
    problem = AttentionProblem(4, *heads, 1, k.shape[2] if table is None
                               else table.shape[1] * k.shape[2], d, True,
                               "fp16" if dtype == torch.float16 else "bf16")
    for base in ({"BLOCK_N": 64, "NUM_SPLITS": 8, "num_warps": 4, "num_stages": 3},
                 {"BLOCK_N": 32, "NUM_SPLITS": 1, "num_warps": 1, "num_stages": 4}):
        config = dict(base, SPLIT_D=1)
        assert SPEC.space.check(config, problem, cuda_device()) is None
        out, lse = attn_decode_kvcache(q, k, v, lens, config, block_table=table, causal=True,
                                       return_lse=True)
        assert_decode_close(out, q, k, v, cache_seqlens=lens, block_table=table, causal=True,
                            lse=lse)
        one = attn_decode_kvcache(q, k, v, lens, base, block_table=table, causal=True)
        assert (out.float() - one.float()).abs().max().item() < 2e-2


# -- launch plans and flashtune.attention's decode route (the hot path) ------------------------


@pytest.mark.parametrize("page_size", [None, 16, 64], ids=["contig", "p16", "p64"])
@pytest.mark.parametrize("return_lse", [False, True])
def test_planned_kvcache_calls_match_the_launcher_bit_for_bit(page_size, return_lse):
    from flashtune.runtime import kvcache

    q, k, v, lens, table = make_cache([3000, 1, 4096, 77], 32, 8, 1, 128, torch.bfloat16,
                                      "cuda", page_size=page_size, capacity=4096, seed=3)
    cfg = kvcache.DISPATCH.choose(
        AttentionProblem(4, 32, 8, 1, 4096, 128, True, "bf16"),
        kvcache._device("cuda", q.get_device())).config
    want = attn_decode_kvcache(q, k, v, lens, cfg, block_table=table, causal=True,
                               return_lse=return_lse)
    kvcache.reset()
    for _ in range(3):  # the first call builds the plan, the others replay it
        got = attention_with_kvcache(q, k, v, lens, block_table=table, return_lse=return_lse)
        for a, b in zip(got if return_lse else (got,), want if return_lse else (want,)):
            assert torch.equal(a, b)
    assert kvcache._PLANS, "no plan was built"
    # a plan follows new tensors of the same layout (and new lengths, within the pages the
    # table holds for each sequence)
    lens2 = torch.tensor([2999, 1, 4000, 5], dtype=torch.int32, device="cuda")
    q2 = torch.randn_like(q)
    got = attention_with_kvcache(q2, k, v, lens2, block_table=table)
    assert_decode_close(got, q2, k, v, cache_seqlens=lens2, block_table=table, causal=True)


def test_kvcache_cuda_graph_capture_and_replay():
    q, k, v, lens, table = make_cache([1000, 2048], 32, 8, 1, 128, torch.bfloat16, "cuda",
                                      page_size=64, capacity=2048, seed=4)
    attention_with_kvcache(q, k, v, lens, block_table=table)  # plan built outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = attention_with_kvcache(q, k, v, lens, block_table=table)
    # new lengths within the pages each sequence's table holds (1000 -> 16 pages of 64)
    lens.copy_(torch.tensor([1024, 17], dtype=torch.int32))
    q.copy_(torch.randn_like(q))
    graph.replay()
    torch.cuda.synchronize()
    assert_decode_close(out, q, k, v, cache_seqlens=lens, block_table=table, causal=True)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("nq,causal", [(1, False), (4, True), (16, True)])
def test_attention_routes_short_queries_to_decode(nq, causal, dtype):
    import flashtune
    from tests.helpers import assert_close_to_reference

    b, hq, hkv, nk, d = 2, 32, 8, 5000, 128
    q = torch.randn(b, nq, hq, d, device="cuda", dtype=dtype).transpose(1, 2)
    k = torch.randn(b, nk, hkv, d, device="cuda", dtype=dtype).transpose(1, 2)
    v = torch.randn(b, nk, hkv, d, device="cuda", dtype=dtype).transpose(1, 2)
    # untuned, on every GPU (cuDNN plans every new shape: a decoding step is one)
    assert flashtune.lookup_config(q, k, v, causal=causal).template == "attn_decode"
    outs = [flashtune.attention(q, k, v, causal=causal, return_lse=True) for _ in range(3)]
    for out, lse in outs:
        assert_close_to_reference(out, q, k, v, causal=causal, lse=lse)
    assert torch.equal(outs[0][0], outs[2][0])

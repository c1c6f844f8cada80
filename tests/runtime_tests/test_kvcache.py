"""attention_with_kvcache: the public KV-cache op, its config choice and every bad input."""

from __future__ import annotations

import pytest
import torch

from flashtune.core.errors import ConfigError, DeviceError, InputError, InputTypeError
from flashtune.runtime import kvcache
from flashtune.runtime.kvcache import attention_with_kvcache
from tests.conftest import DEVICE
from tests.decode_helpers import assert_decode_close, make_cache

CFG = {"BLOCK_N": 16, "NUM_SPLITS": 3, "num_warps": 4, "num_stages": 2}


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_default_config_matches_reference(paged):
    q, k, v, lens, table = make_cache([1, 61, 32], 8, 1, 1, 64, torch.float16, DEVICE,
                                      page_size=16 if paged else None, capacity=64)
    out, lse = attention_with_kvcache(q, k, v, lens, block_table=table, return_lse=True)
    assert_decode_close(out, q, k, v, cache_seqlens=lens, block_table=table, causal=True,
                        lse=lse)
    assert torch.equal(out, attention_with_kvcache(q, k, v, lens, block_table=table))


@pytest.mark.parametrize("head_dim", [40, 59])
def test_every_head_dim_up_to_256(head_dim):
    """Head dims that are not powers of two, aligned (40) or not (59), through the public
    call (the decode kernel's masked columns)."""
    q, k, v, lens, table = make_cache([5, 29], 4, 2, 2, head_dim, torch.float16, DEVICE,
                                      page_size=16, capacity=32, seed=3)
    out, lse = attention_with_kvcache(q, k, v, lens, block_table=table, return_lse=True)
    assert_decode_close(out, q, k, v, cache_seqlens=lens, block_table=table, causal=True,
                        lse=lse)


def test_explicit_config_causal_multi_query_gqa():
    q, k, v, lens, table = make_cache([7, 48, 33], 4, 2, 4, 64, torch.float16, DEVICE,
                                      page_size=16, capacity=48, seed=1)
    for causal in (False, True):
        out = attention_with_kvcache(q, k, v, lens, block_table=table, causal=causal,
                                     config=CFG)
        assert_decode_close(out, q, k, v, cache_seqlens=lens, block_table=table,
                            causal=causal)


def test_calls_without_config_ask_the_decode_dispatcher(monkeypatch):
    seen = []
    real = kvcache.DISPATCH.choose

    def spy(problem, device):
        seen.append(problem)
        return real(problem, device)

    monkeypatch.setattr(kvcache.DISPATCH, "choose", spy)
    q, k, v, lens, table = make_cache([5, 40], 4, 2, 1, 64, torch.float16, DEVICE,
                                      page_size=8, capacity=48, seed=2)
    attention_with_kvcache(q, k, v, lens, block_table=table)
    assert len(seen) == 1
    p = seen[0]
    # the problem key: seqlen_k is the cache's capacity (max_pages x page_size)
    assert (p.batch, p.heads_q, p.heads_kv, p.seqlen_q, p.seqlen_k, p.head_dim, p.causal,
            p.dtype) == (2, 4, 2, 1, 48, 64, True, "fp16")


def test_bad_configs_raise_config_error():
    q, k, v, lens, _ = make_cache([5, 40], 4, 2, 1, 64, torch.float16, DEVICE, seed=3)
    with pytest.raises(ConfigError, match="NUM_SPLITS.*allowed values"):
        attention_with_kvcache(q, k, v, lens, config={**CFG, "NUM_SPLITS": 5})
    with pytest.raises(ConfigError, match="missing keys \\['num_stages'\\]"):
        attention_with_kvcache(q, k, v, lens, config={"BLOCK_N": 16, "NUM_SPLITS": 1,
                                                      "num_warps": 4})
    with pytest.raises(ConfigError, match="idle"):  # 40 keys are 3 blocks of 16, not 8
        attention_with_kvcache(q, k, v, lens, config={**CFG, "NUM_SPLITS": 8})


def _inputs(paged=True):
    return make_cache([5, 40], 4, 2, 1, 64, torch.float16, DEVICE,
                      page_size=16 if paged else None, capacity=48, seed=4)


BAD = [
    # (description, paged, mutate(q, k, v, lens, table) -> args, kwargs, exception, message)
    ("q not a tensor", True, lambda q, k, v, s, t: (([1.0], k, v, s), {"block_table": t}),
     InputTypeError, "q must be a torch.Tensor"),
    ("q wrong rank", True, lambda q, k, v, s, t: ((q[0], k, v, s), {"block_table": t}),
     InputError, "q must have 4 dimensions"),
    ("fp32", True, lambda q, k, v, s, t: ((q.float(), k.float(), v.float(), s),
                                          {"block_table": t}),
     InputTypeError, "q must be float16 or bfloat16"),
    ("mixed dtypes", True, lambda q, k, v, s, t: ((q, k.bfloat16(), v.bfloat16(), s),
                                                  {"block_table": t}),
     InputTypeError, "share one dtype"),
    ("k v shapes differ", True, lambda q, k, v, s, t: ((q, k, v[:3], s), {"block_table": t}),
     InputError, "k_cache and v_cache must have the same shape"),
    ("head_dim mismatch", True, lambda q, k, v, s, t: ((q[..., :32].contiguous(),
                                                        k, v, s), {"block_table": t}),
     InputError, "head_dim mismatch"),
    ("unsupported head_dim", True,
     lambda q, k, v, s, t: ((q.repeat(1, 1, 1, 5)[..., :260].contiguous(),
                             k.repeat(1, 1, 1, 5)[..., :260].contiguous(),
                             v.repeat(1, 1, 1, 5)[..., :260].contiguous(), s),
                            {"block_table": t}),
     InputError, "head_dim 260 is not supported; supported: 1 to 256"),
    ("heads not a multiple", True, lambda q, k, v, s, t: ((q[:, :3], k, v, s),
                                                          {"block_table": t}),
     InputError, "multiple of the cache's heads"),
    ("last dim strided", True, lambda q, k, v, s, t: ((q, k.transpose(2, 3), v, s),
                                                      {"block_table": t}),
     InputError, "k_cache must be contiguous in its last dimension"),
    ("contiguous batch mismatch", False, lambda q, k, v, s, t: ((q, k[:1], v[:1], s), {}),
     InputError, "batch mismatch: q has batch 2, k_cache/v_cache have 1"),
    ("seqlens int64", True, lambda q, k, v, s, t: ((q, k, v, s.long()), {"block_table": t}),
     InputTypeError, "cache_seqlens must have dtype torch.int32"),
    ("seqlens a list", True, lambda q, k, v, s, t: ((q, k, v, [5, 40]), {"block_table": t}),
     InputTypeError, "cache_seqlens must be an int32 torch.Tensor"),
    ("seqlens wrong shape", True, lambda q, k, v, s, t: ((q, k, v, s[:1]), {"block_table": t}),
     InputError, "cache_seqlens must have shape \\(batch,\\) = \\(2,\\), got \\(1,\\)"),
    # the kernel reads cache_seqlens[b] at offset b (no stride): views are refused
    ("seqlens expanded", True,
     lambda q, k, v, s, t: ((q, k, v, s[1:].expand(2)), {"block_table": t}),
     InputError, ("cache_seqlens must be contiguous \\(stride 1\\), got stride 0.*"
                  "call .contiguous\\(\\)")),
    ("seqlens every other", False,
     lambda q, k, v, s, t: ((q, k, v, s.repeat_interleave(2)[::2]), {}),
     InputError, "cache_seqlens must be contiguous \\(stride 1\\), got stride 2"),
    ("seqlens a column", False,
     lambda q, k, v, s, t: ((q, k, v, torch.stack([s, s], 1)[:, 0]), {}),
     InputError, "cache_seqlens must be contiguous \\(stride 1\\), got stride 2"),
    ("table int64", True, lambda q, k, v, s, t: ((q, k, v, s), {"block_table": t.long()}),
     InputTypeError, "block_table must have dtype torch.int32"),
    ("table 1-D", True, lambda q, k, v, s, t: ((q, k, v, s), {"block_table": t[0]}),
     InputError, "block_table must have shape \\(batch, max_pages\\)"),
    ("table batch mismatch", True, lambda q, k, v, s, t: ((q, k, v, s),
                                                          {"block_table": t[:1]}),
     InputError, "block_table must have shape .* = \\(2, any\\), got \\(1, 3\\)"),
    ("seqlens on another device", True,
     lambda q, k, v, s, t: ((q, k, v, torch.empty(2, dtype=torch.int32, device="meta")),
                            {"block_table": t}),
     InputError, "cache_seqlens is on meta but q is on"),
    ("bad scale", True, lambda q, k, v, s, t: ((q, k, v, s), {"block_table": t,
                                                              "scale": float("nan")}),
     InputError, "scale must be a finite float"),
]


@pytest.mark.parametrize("desc,paged,mutate,exc,msg", BAD, ids=[b[0] for b in BAD])
def test_bad_inputs_raise_clear_errors(desc, paged, mutate, exc, msg):
    q, k, v, lens, table = _inputs(paged)
    args, kwargs = mutate(q, k, v, lens, table)
    with pytest.raises(exc, match=msg):
        attention_with_kvcache(*args, **kwargs)


def test_seqlens_views_are_refused_by_the_metadata_check():
    q, k, v, lens, table = _inputs()
    for view in (lens[1:].expand(2), lens.repeat_interleave(2)[::2],
                 torch.stack([lens, lens], 1)[:, 0]):
        with pytest.raises(InputError, match="cache_seqlens must be contiguous"):
            kvcache.check_kvcache_inputs(q, k, v, view, table, None)
    # one sequence: its length is read at offset 0, whatever the stride
    kvcache.check_kvcache_inputs(q[:1], k, v, lens[:1].expand(1), table[:1], None)
    kvcache.check_kvcache_inputs(q[:1], k, v, torch.stack([lens, lens], 1)[:1, 0],
                                 table[:1], None)


def test_the_plan_key_tells_seqlens_strides_apart():
    """A plan (CUDA) replays with no checks: a call with strided lengths must not find the
    plan of contiguous ones."""
    q, k, v, lens, table = _inputs()
    column = torch.stack([lens, lens], 1)[:, 0]
    assert kvcache._plan_key(q, k, v, lens, table, True, None, False) != \
        kvcache._plan_key(q, k, v, column, table, True, None, False)


def test_a_strided_block_table_is_read_through_its_strides():
    """The kernel takes block_table's strides: a transposed view runs without a copy."""
    q, k, v, lens, table = _inputs()
    strided = table.t().contiguous().t()  # (batch, max_pages) with strides (1, batch)
    assert strided.stride() != table.stride()
    out = attention_with_kvcache(q, k, v, lens, block_table=strided)
    assert torch.equal(out, attention_with_kvcache(q, k, v, lens, block_table=table))
    assert_decode_close(out, q, k, v, cache_seqlens=lens, block_table=table, causal=True)


def _table_case(which):
    q, k, v, lens, table = _inputs(paged=which != "contiguous-too-long")
    if which == "negative-length":
        lens = torch.tensor([5, -1], dtype=torch.int32, device=DEVICE)
    elif which == "contiguous-too-long":
        lens = torch.tensor([5, 49], dtype=torch.int32, device=DEVICE)
    elif which == "paged-too-long":
        lens = torch.tensor([49, 40], dtype=torch.int32, device=DEVICE)
    elif which == "page-id-too-big":
        table = table.clone()
        table[1, 2] = k.shape[0]
    elif which == "page-id-negative":
        table = table.clone()
        table[0, 0] = -3
    return q, k, v, lens, table


TABLE_ERRORS = dict([
    ("negative-length", "cache_seqlens\\[1\\] = -1 is negative"),
    ("contiguous-too-long", "cache_seqlens\\[1\\] = 49 exceeds k_cache's max_seqlen \\(48\\)"),
    ("paged-too-long", "cache_seqlens\\[0\\] = 49 exceeds block_table's capacity "
                       "\\(3 pages x page_size 16\\)"),
    ("page-id-too-big", "block_table\\[1, 2\\] = 6 is not a page of the cache: page ids must "
                        "be in \\[0, 6\\) \\(k_cache has 6 pages\\)"),
    ("page-id-negative", "block_table\\[0, 0\\] = -3 is not a page"),
])


@pytest.mark.parametrize("which", list(TABLE_ERRORS))
def test_bad_tables_raise_clear_errors(which):
    """On CPU the values are always checked; check_tables=True asks for it on CUDA."""
    q, k, v, lens, table = _table_case(which)
    with pytest.raises(InputError, match=TABLE_ERRORS[which]):
        attention_with_kvcache(q, k, v, lens, block_table=table, check_tables=True)


def test_unused_table_entries_are_not_checked():
    q, k, v, lens, table = _inputs()
    table = table.clone()
    table[0, 1:] = 10 ** 6  # sequence 0 (length 5) uses only its first page
    out = attention_with_kvcache(q, k, v, lens, block_table=table, check_tables=True)
    assert_decode_close(out, q, k, v, cache_seqlens=lens, block_table=table, causal=True)


def test_cpu_tensors_without_the_interpreter(monkeypatch):
    if DEVICE != "cpu":
        pytest.skip("CPU-only check")
    monkeypatch.setattr(kvcache, "interpreting", lambda: False)
    q, k, v, lens, table = _inputs()
    with pytest.raises(DeviceError, match="TRITON_INTERPRET=1"):
        attention_with_kvcache(q, k, v, lens, block_table=table)


def test_inference_only_as_documented():
    q, k, v, lens, table = _inputs()
    out = attention_with_kvcache(q.requires_grad_(), k.requires_grad_(), v, lens,
                                 block_table=table)
    assert out.grad_fn is None and not out.requires_grad
    assert "Inference only" in attention_with_kvcache.__doc__

"""A generation step over a fixed-size cache with its lengths from a padding mask on the
device (runtime.static_cache): the lengths, the numerics against an fp32 reference per
sequence, and the step under torch.compile (one opaque op, no graph break)."""

from __future__ import annotations

import pytest
import torch

from flashtune.kernel_templates.attn_fwd.reference import attn_fwd_reference
from flashtune.runtime.static_cache import attention_static_cache, mask_lengths, one_run
from tests.conftest import DEVICE


def _runs(starts: list[int], ends: list[int], n: int) -> torch.Tensor:
    pos = torch.arange(n)
    return torch.stack([(pos >= s) & (pos < e) for s, e in zip(starts, ends)]).to(DEVICE)


def test_mask_lengths_and_runs():
    mask = _runs([0, 3, 0, 5], [7, 9, 0, 6], 10)
    ends, starts = mask_lengths(mask)
    assert ends.dtype == starts.dtype == torch.int32
    assert ends.tolist() == [7, 9, 0, 6] and starts.tolist() == [0, 3, 0, 5]
    assert one_run(mask)
    holed = mask.clone()
    holed[1, 5] = False
    assert not one_run(holed)
    assert mask_lengths(mask.long())[0].tolist() == [7, 9, 0, 6]  # 0/1 masks as generate's


@pytest.mark.parametrize("lq, causal, window, softcap",
                         [(1, False, None, None), (3, True, None, None),
                          (2, True, (4, 0), None), (1, False, None, 6.0)])
def test_a_step_matches_each_sequence_alone(lq, causal, window, softcap):
    """Sequence b attends to keys [start_b, end_b) of the cache, its lq queries at the last
    lq positions of that run (causal bottom-right there); the rest of the cache (left
    padding, empty slots, garbage in them) is never seen."""
    g = torch.Generator().manual_seed(0)
    b, hq, hkv, n, d = 3, 4, 2, 37, 40
    dtype = torch.float16
    q = torch.randn(b, hq, lq, d, generator=g).to(DEVICE, dtype)
    k = torch.randn(b, hkv, n, d, generator=g).to(DEVICE, dtype)
    v = torch.randn(b, hkv, n, d, generator=g).to(DEVICE, dtype)
    starts, ends = [0, 5, 2], [21, 37, 9]
    mask = _runs(starts, ends, n)
    got = attention_static_cache(q, k, v, mask, causal=causal, window=window, softcap=softcap)
    assert got.shape == q.shape
    for i, (s, e) in enumerate(zip(starts, ends)):
        want, _ = attn_fwd_reference(q[i:i + 1], k[i:i + 1, :, s:e], v[i:i + 1, :, s:e],
                                     causal=causal, window=window or (-1, -1),
                                     softcap=softcap, dtype=torch.float32)
        torch.testing.assert_close(got[i:i + 1].float(), want, atol=2e-3, rtol=2e-3)


def test_a_step_under_torch_compile_is_one_op():
    """fullgraph: the step is the custom op flashtune::attention_static_cache, the same
    numbers as eager."""
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 4, 1, 32, generator=g).to(DEVICE, torch.float16)
    k = torch.randn(2, 2, 24, 32, generator=g).to(DEVICE, torch.float16)
    v = torch.randn(2, 2, 24, 32, generator=g).to(DEVICE, torch.float16)
    mask = _runs([0, 4], [11, 24], 24)

    def step(q, k, v, mask):
        return attention_static_cache(q, k, v, mask, causal=True) * 2

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(q, k, v, mask), step(q, k, v, mask), atol=0, rtol=0)


@pytest.mark.gpu
def test_a_step_replays_in_a_cuda_graph():
    """Captured once, the step follows the mask's values on every replay (the lengths are
    computed on the device): each replay equals the eager step over the new lengths."""
    if DEVICE != "cuda":
        pytest.skip("needs a CUDA GPU")
    g = torch.Generator(device="cuda").manual_seed(2)
    b, hq, hkv, n, d = 4, 8, 2, 300, 128
    q = torch.randn(b, hq, 1, d, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(b, hkv, n, d, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(b, hkv, n, d, device="cuda", dtype=torch.bfloat16, generator=g)
    mask = _runs([0, 7, 0, 30], [100, 120, 1, 299], n)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: compile and plan outside the capture
        for _ in range(2):
            attention_static_cache(q, k, v, mask, causal=True)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = attention_static_cache(q, k, v, mask, causal=True)
    for starts, ends in (([0, 7, 0, 30], [100, 120, 1, 299]), ([3, 0, 0, 0], [250, 9, 300, 64])):
        mask.copy_(_runs(starts, ends, n))
        graph.replay()
        torch.testing.assert_close(out, attention_static_cache(q, k, v, mask, causal=True),
                                   atol=0, rtol=0)
        for i, (s, e) in enumerate(zip(starts, ends)):
            want, _ = attn_fwd_reference(q[i:i + 1], k[i:i + 1, :, s:e], v[i:i + 1, :, s:e],
                                         dtype=torch.float32)
            torch.testing.assert_close(out[i:i + 1].float(), want, atol=2e-2, rtol=2e-2)

"""GPU-only runtime checks: torch.compile (inductor) without graph breaks, CUDA-graph capture,
and no recompiles after warmup."""

from __future__ import annotations

import pytest
import torch

import flashtune
from flashtune.core.problem import AttentionProblem
from flashtune.kernel_templates import get_template
from flashtune.kernel_templates.attn_fwd.reference import attn_fwd_reference
from flashtune.runtime import routing

pytestmark = pytest.mark.gpu
SPEC = get_template("attn_fwd")


def _qkv(b=2, hq=8, hkv=2, n=333, d=128, dtype=torch.bfloat16):
    mk = lambda h: torch.randn(b, h, n, d, device="cuda", dtype=dtype)  # noqa: E731
    return mk(hq), mk(hkv), mk(hkv)


@pytest.fixture(autouse=True)
def attn_fwd_route(monkeypatch):
    """These tests are about attn_fwd's and attn_decode's launch plans: untuned calls route
    to them, not to the op choices the shipped tables lend the shape (an H200's forward
    table sends many to the Gluon forward or cuDNN)."""
    for router in routing._ROUTERS.values():
        monkeypatch.setattr(router, "choose", lambda *a, **kw: None)
    flashtune.reload_configs()
    yield
    flashtune.reload_configs()


def test_an_untuned_call_runs_flashtunes_kernels_and_cudnn_captures_when_asked(tmp_path,
                                                                              monkeypatch):
    """A call nothing is tuned for runs attn_fwd (a decoding step attn_decode), on sm_90
    too: cuDNN plans every new shape. cuDNN's forward asked for by name matches the
    reference, returns the LSE and replays from a CUDA graph."""
    monkeypatch.setenv("FLASHTUNE_DB", f"sqlite:///{tmp_path / 'none.db'}")
    flashtune.reload_configs()
    q, k, v = _qkv(hkv=8)
    assert flashtune.lookup_config(q, k, v, causal=True).template == "attn_fwd"
    q1 = q[:, :, -1:].contiguous()
    assert flashtune.lookup_config(q1, k, v, causal=True).template == "attn_decode"
    out, lse = flashtune.attention(q, k, v, causal=True, return_lse=True, impl="sdpa_cudnn")
    ref, ref_lse = attn_fwd_reference(q, k, v, causal=True, dtype=torch.float32)
    assert ((out.float() - ref).norm() / ref.norm()).item() < 1e-2
    assert torch.allclose(lse, ref_lse, atol=1e-2)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = flashtune.attention(q, k, v, causal=True, impl="sdpa_cudnn")
    q.copy_(torch.randn_like(q))
    graph.replay()
    torch.cuda.synchronize()
    ref, _ = attn_fwd_reference(q, k, v, causal=True, dtype=torch.float32)
    assert ((captured.float() - ref).norm() / ref.norm()).item() < 1e-2


def _compiled_kernels() -> int:
    return sum(len(cache[0]) for cache in SPEC.kernel.device_caches.values())


def test_torch_compile_inductor_fullgraph():
    q, k, v = _qkv()
    proj = torch.nn.Linear(128, 128, device="cuda", dtype=torch.bfloat16)

    def block(x, k, v):
        out, lse = flashtune.attention(proj(x), k, v, causal=True, return_lse=True)
        return proj(out) * lse.exp().unsqueeze(-1).clamp(max=1)

    compiled = torch.compile(block, fullgraph=True)
    with torch.no_grad():  # inference: the op's autograd formula comes with attn_bwd
        torch.testing.assert_close(compiled(q, k, v), block(q, k, v), atol=2e-2, rtol=2e-2)
        assert torch._dynamo.explain(block)(q, k, v).graph_break_count == 0


def test_cuda_graph_capture_and_replay():
    q, k, v = _qkv()
    flashtune.attention(q, k, v, causal=True)  # resolve and compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = flashtune.attention(q, k, v, causal=True)
    for _ in range(2):
        q.copy_(torch.randn_like(q))
        graph.replay()
        torch.cuda.synchronize()
        ref, _ = attn_fwd_reference(q, k, v, causal=True, dtype=torch.float32)
        rel = ((out.float() - ref).norm() / ref.norm()).item()
        assert rel < 1e-2, rel


def test_no_recompiles_after_warmup():
    shapes = [AttentionProblem(1, 4, 4, n, n, 64, c, "bf16") for n in (384, 1000)
              for c in (False, True)]
    flashtune.warmup(shapes)
    flashtune.warmup(shapes, return_lse=True)
    before = _compiled_kernels()
    for p in shapes:
        q = torch.randn(p.batch, p.heads_q, p.seqlen_q, p.head_dim, device="cuda",
                        dtype=torch.bfloat16)
        flashtune.attention(q, q, q, causal=p.causal)
        flashtune.attention(q, q, q, causal=p.causal, return_lse=True)
    torch.cuda.synchronize()
    assert _compiled_kernels() == before


# -- launch plans: the hot path --------------------------------------------------------------


def _views():
    """(name, q, k, v): layouts whose plans must differ (strides, alignment, GQA)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    mk = lambda *s: torch.randn(*s, device="cuda", dtype=torch.bfloat16, generator=g)  # noqa: E731
    bnhd = mk(2, 77, 6, 64)
    shifted = mk(2 * 4 * 77 * 64 + 3)[3:].view(2, 4, 77, 64)  # 6-byte offset: no TMA
    return [
        ("contiguous", mk(2, 4, 77, 64), mk(2, 2, 133, 64), mk(2, 2, 133, 64)),
        ("bnhd-view", *(bnhd[..., i * 2:(i + 1) * 2, :].transpose(1, 2) for i in range(3))),
        ("misaligned", shifted, mk(2, 4, 77, 64), mk(2, 4, 77, 64)),
        ("mqa-d128", mk(1, 8, 200, 128), mk(1, 1, 64, 128), mk(1, 1, 64, 128)),
    ]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("return_lse", [False, True])
def test_planned_calls_match_the_launcher_bit_for_bit(causal, return_lse):
    routing._PLANS.clear()
    for name, q, k, v in _views():
        cfg = flashtune.lookup_config(q, k, v, causal=causal).config
        want = SPEC.launcher(q, k, v, cfg, causal=causal, return_lse=return_lse)
        n_before = len(routing._PLANS)
        for _ in range(3):  # first call builds the plan, the others replay it
            got = flashtune.attention(q, k, v, causal=causal, return_lse=return_lse)
            for a, b in zip(got if return_lse else (got,), want if return_lse else (want,)):
                assert torch.equal(a, b), name
        assert len(routing._PLANS) == n_before + 1, name
        ref, _ = attn_fwd_reference(q, k, v, causal=causal, dtype=torch.float32)
        out = got[0] if return_lse else got
        assert ((out.float() - ref).norm() / ref.norm()).item() < 1e-2, name


def test_a_plan_follows_new_tensors_of_the_same_layout():
    """New tensors, and new contents at the addresses of earlier calls (where a plan reuses
    the tensor maps it encoded: direct.RawLaunch), both read what they hold now."""
    q, k, v = _qkv(n=129, d=64)
    flashtune.attention(q, k, v, causal=True)
    for step in range(4):
        if step % 2:
            for t in (q, k, v):
                t.copy_(torch.randn_like(t))
            q2, k2, v2 = q, k, v
        else:
            q2, k2, v2 = (torch.randn_like(t) for t in (q, k, v))
        got = flashtune.attention(q2, k2, v2, causal=True)
        ref, _ = attn_fwd_reference(q2, k2, v2, causal=True, dtype=torch.float32)
        assert ((got.float() - ref).norm() / ref.norm()).item() < 1e-2


def test_launch_hooks_bypass_plans():
    from triton import knobs

    q, k, v = _qkv(n=65, d=64)
    flashtune.attention(q, k, v)
    seen = []
    hook = lambda meta: seen.append(meta.get()["name"])  # noqa: E731
    knobs.runtime.launch_enter_hook.add(hook)
    try:
        out = flashtune.attention(q, k, v)
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    assert seen == ["attn_fwd_kernel"]
    torch.testing.assert_close(out, flashtune.attention(q, k, v), rtol=0, atol=0)


def test_torch_compile_training_step_matches_eager():
    q, k, v = _qkv(n=257)
    proj = torch.nn.Linear(128, 128, device="cuda", dtype=torch.bfloat16)

    def loss_fn(x, k, v):
        out, lse = flashtune.attention(proj(x), k, v, causal=True, return_lse=True)
        return (proj(out).float() ** 2).mean() + lse.mean()

    grads = []
    for fn in (loss_fn, torch.compile(loss_fn, fullgraph=True)):
        xs, ks, vs = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
        proj.zero_grad()
        fn(xs, ks, vs).backward()
        grads.append([t.grad.float() for t in (xs, ks, vs)] + [proj.weight.grad.float()])
    for eager, compiled in zip(*grads):
        assert ((eager - compiled).norm() / eager.norm()).item() < 2e-2


def test_a_decode_plans_kept_partials_serve_back_to_back_calls_and_no_graph():
    """attn_decode's plan keeps its split-KV partials (direct.Scratch) for calls on the
    build's stream: back-to-back calls with new queries, without a sync between them, each
    read their own; a call on another stream and a CUDA-graph capture allocate their own
    (the captured graph replays to the launcher's answer after the eager calls moved on).
    The plan runs the cache variant with full lengths, the template launcher's kernel."""
    from flashtune.kernel_templates.attn_decode.full import attn_decode_full
    from flashtune.kernel_templates.attn_decode.plan import AttnDecodeDensePlan
    from flashtune.kernel_templates.direct import current_stream

    g = torch.Generator(device="cuda").manual_seed(3)
    k, v = (torch.randn(2, 2, 700, 128, device="cuda", dtype=torch.bfloat16, generator=g)
            for _ in range(2))
    qs = [torch.randn(2, 8, 1, 128, device="cuda", dtype=torch.bfloat16, generator=g)
          for _ in range(4)]
    cfg = {"BLOCK_N": 64, "NUM_SPLITS": 4, "num_warps": 4, "num_stages": 2}
    plan = AttnDecodeDensePlan(qs[0], k, v, cfg, causal=False, scale=None, return_lse=False)
    assert plan._scratch is not None and plan._scratch.buffers is not None
    assert plan._lens is not None and plan._lens.tolist() == [700, 700]
    want = [attn_decode_full(q, k, v, cfg) for q in qs]
    got = [plan(q, k, v, current_stream(0)) for q in qs]  # no sync between them
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        assert plan._scratch.get(current_stream(0)) is None
        on_side = plan(qs[1], k, v, current_stream(0))
    torch.cuda.current_stream().wait_stream(side)
    assert torch.equal(on_side, want[1])
    static_q = qs[2].clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = plan(static_q, k, v, current_stream(0))
    eager = plan(qs[3], k, v, current_stream(0))  # the kept partials, after the capture
    static_q.copy_(qs[0])
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, want[0]) and torch.equal(eager, want[3])


def test_a_decode_plan_built_under_capture_keeps_no_lengths_from_the_graphs_pool():
    """A dense decode plan first built inside a CUDA-graph capture: its full lengths are
    made in the graph (not kept by the plan nor the memo, whose memory the graph's pool
    owns); the graph replays, and eager calls after it fetch lengths of their own."""
    from flashtune.kernel_templates.attn_decode import full
    from flashtune.kernel_templates.attn_decode.plan import AttnDecodeDensePlan
    from flashtune.kernel_templates.direct import current_stream

    g = torch.Generator(device="cuda").manual_seed(5)
    k, v = (torch.randn(3, 2, 517, 128, device="cuda", dtype=torch.bfloat16, generator=g)
            for _ in range(2))
    q = torch.randn(3, 8, 1, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    cfg = {"BLOCK_N": 32, "NUM_SPLITS": 3, "num_warps": 2, "num_stages": 2}
    torch.cuda.synchronize()
    want = full.attn_decode_full(q, k, v, cfg, causal=True)  # compiles the kernels
    full._FULL.clear()
    static_q = q.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        plan = AttnDecodeDensePlan(static_q, k, v, cfg, causal=True, scale=None,
                                   return_lse=False)
        captured = plan(static_q, k, v, current_stream(0))
    assert plan._lens is None and not full._FULL
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, want)
    del graph
    assert torch.equal(plan(q, k, v, current_stream(0)), want)
    assert [t.tolist() for t in full._FULL.values()] == [[517, 517, 517]]

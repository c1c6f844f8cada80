"""Shared test helpers: the flash-attention tolerance rule; a benchmark script as a module."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import torch

from flashtune.kernel_templates.attn_fwd.reference import attn_fwd_reference


def lowp_reference(q, k, v, *, causal, scale=None):
    """PyTorch's own attention in the inputs' precision: scores and P@V in fp16/bf16.

    On CPU torch's fp16 matmul accumulates in fp32 like the GPU, so this is the
    'same low precision' baseline of the flash-attention tolerance rule.
    """
    out, _ = attn_fwd_reference(q, k, v, causal=causal, scale=scale, dtype=q.dtype)
    return out


def assert_close_to_reference(out, q, k, v, *, causal, scale=None, lse=None, factor=2.0):
    """flash-attention's rule: max error vs fp64 <= factor x torch's low-precision error.

    Plus an absolute floor of a few ulps of the output dtype, and a hard relative bound, so
    neither a lucky-exact torch run nor a wrong kernel slips through.
    """
    ref, ref_lse = attn_fwd_reference(q, k, v, causal=causal, scale=scale, dtype=torch.float64)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert not torch.isnan(out).any(), "NaN in output"
    err = (out.double() - ref).abs().max().item()
    pt_err = (lowp_reference(q, k, v, causal=causal, scale=scale).double() - ref).abs().max().item()
    eps = torch.finfo(q.dtype).eps
    assert err <= factor * pt_err + 4 * eps * max(1.0, ref.abs().max().item()), (
        f"kernel max error {err:.3e} > {factor} x torch low-precision error {pt_err:.3e}")
    rel = ((out.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()
    assert rel < 2e-2, f"relative error {rel:.3e}"
    if lse is not None:
        assert lse.dtype == torch.float32 and lse.shape == q.shape[:3]
        inf_ref = torch.isinf(ref_lse)
        assert torch.equal(torch.isinf(lse), inf_ref), "LSE -inf pattern differs"
        assert (lse[inf_ref] < 0).all()
        finite = ~inf_ref
        if finite.any():
            lse_err = (lse.double()[finite] - ref_lse[finite]).abs().max().item()
            assert lse_err < 1e-3 * max(1.0, ref_lse[finite].abs().max().item()), lse_err
    return err


def grad_references(q, k, v, dout, *, causal, scale=None):
    """``(exact, low)``: the float64 gradients and torch's own autograd in the inputs'
    precision, what :func:`assert_grads_close` compares with (to compute once for inputs
    that several launches are checked on)."""
    from flashtune.kernel_templates.attn_bwd.reference import attn_bwd_reference

    exact = attn_bwd_reference(q, k, v, dout, causal=causal, scale=scale, dtype=torch.float64)
    low = attn_bwd_reference(q, k, v, dout, causal=causal, scale=scale, dtype=q.dtype)
    return exact, low


def assert_grads_close(grads, q, k, v, dout, *, causal, scale=None, max_factor=3.0,
                       fro_factor=2.0, refs=None):
    """The same rule for attn_bwd's ``(dq, dk, dv)``: each one's max error vs fp64 at most
    ``max_factor`` x, and its relative Frobenius error at most ``fro_factor`` x, the error
    of torch's own autograd through plain attention in the inputs' precision (plus a few
    ulps), and under a hard relative bound. ``refs``: :func:`grad_references` of these
    inputs, computed here when None. Returns the relative errors."""
    exact, low = refs if refs is not None else grad_references(q, k, v, dout, causal=causal,
                                                               scale=scale)
    eps = torch.finfo(q.dtype).eps
    rels = []
    for name, got, ref, base, like in zip(("dq", "dk", "dv"), grads, exact, low, (q, k, v)):
        assert got.shape == like.shape and got.dtype == like.dtype, name
        assert torch.isfinite(got).all(), f"{name}: NaN or inf"
        scale_ = max(1.0, ref.abs().max().item())
        err = (got.double() - ref).abs().max().item()
        pt_err = (base.double() - ref).abs().max().item()
        assert err <= max_factor * pt_err + 4 * eps * scale_, (
            f"{name}: max error {err:.3e} > {max_factor} x torch low-precision {pt_err:.3e}")
        norm = ref.norm().clamp_min(1e-30)
        rel = ((got.double() - ref).norm() / norm).item()
        pt_rel = ((base.double() - ref).norm() / norm).item()
        assert rel <= fro_factor * pt_rel + eps, (
            f"{name}: relative error {rel:.3e} > {fro_factor} x torch's {pt_rel:.3e}")
        assert rel < 2e-2, f"{name}: relative error {rel:.3e}"
        rels.append(rel)
    return rels


BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def assert_trains_through_attention(impl, d, hq, hkv, n, causal, bshd, *, seed):
    """Training implementation ``impl`` as a user runs it (``flashtune.attention(...,
    impl=)`` with gradients, on a CUDA device): out against float64, dQ, dK and dV against
    float64 autograd (:func:`assert_grads_close`), in (B, H, N, D) or, ``bshd``, (B, N, H,
    D) storage; then with a loss on the LSE too, against attn_fwd + attn_bwd's gradients of
    the same loss."""
    import flashtune

    torch.manual_seed(seed)

    def make(h: int) -> torch.Tensor:
        if bshd:
            return torch.randn(2, n, h, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
        return torch.randn(2, h, n, d, device="cuda", dtype=torch.bfloat16)

    q, k, v, do = make(hq), make(hkv), make(hkv), make(hq)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = flashtune.attention(*leaves, causal=causal, impl=impl)
    ref, _ = attn_fwd_reference(q, k, v, causal=causal, dtype=torch.float64)
    assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-2
    grads = torch.autograd.grad(out, leaves, do)
    assert_grads_close(grads, q, k, v, do, causal=causal)
    dlse = torch.randn(2, hq, n, device="cuda")
    by_impl = {}
    for name in (impl, "attn_fwd"):
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        out, lse = flashtune.attention(*leaves, causal=causal, impl=name, return_lse=True)
        loss = (out.float() * do.float()).sum() + (lse * dlse).sum()
        by_impl[name] = torch.autograd.grad(loss, leaves)
    for w, h in zip(by_impl["attn_fwd"], by_impl[impl], strict=True):
        assert ((w.float() - h.float()).norm() / w.float().norm()).item() < 1e-2


def assert_compiles_and_captures(loss_fn, inputs, *, tol=2e-2):
    """The contract of every training route, on a CUDA device: ``loss_fn(*inputs)``'s
    gradients through ``torch.compile(fullgraph=True)`` equal eager's, and a forward +
    backward captured in a CUDA graph on other values replays to them from the inputs copied
    in after the capture (relative Frobenius error under ``tol``)."""
    grads = []
    for fn in (loss_fn, torch.compile(loss_fn, fullgraph=True)):
        leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
        fn(*leaves).backward()
        grads.append([t.grad.float() for t in leaves])
    for eager, compiled in zip(*grads, strict=True):
        assert ((eager - compiled).norm() / eager.norm()).item() < tol
    # captured on other values: the replay must read the inputs copied in after
    leaves = [torch.randn_like(t).requires_grad_(True) for t in inputs]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up outside the graph (compiles, allocates)
        captured = torch.autograd.grad(loss_fn(*leaves), leaves)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = torch.autograd.grad(loss_fn(*leaves), leaves)
    with torch.no_grad():
        for t, src in zip(leaves, inputs, strict=True):
            t.copy_(src)
    graph.replay()
    torch.cuda.synchronize()
    for eager, got in zip(grads[0], captured, strict=True):
        assert ((eager - got.float()).norm() / eager.norm()).item() < tol


def load_benchmark(name: str) -> ModuleType:
    """``benchmarks/{name}.py`` as a fresh module (``benchmarks/`` on the path while it
    loads, for the scripts that import each other)."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
        assert spec and spec.loader
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(BENCHMARKS))

"""torch SDPA's fused backends (cuDNN, flash, efficient) as externs on a GPU: output and LSE
against the float64 reference on odd shapes, strided inputs, and gradients through autograd
(``FLASHTUNE_TEST_DEVICE=cuda pytest -m gpu``)."""

from __future__ import annotations

import pytest
import torch

from flashtune.core.problem import AttentionProblem
from flashtune.kernel_templates import get_template
from tests.helpers import assert_close_to_reference, assert_grads_close

pytestmark = pytest.mark.gpu

FUSED = ("sdpa_cudnn", "sdpa_flash", "sdpa_efficient")
DTYPES = [torch.float16, torch.bfloat16]
SHAPES = [
    # (b, hq, nq, nk, d, causal[, hkv])
    (2, 3, 1000, 1000, 64, False),
    (1, 4, 1000, 1000, 128, True),   # causal, Nq == Nk
    (2, 2, 77, 1000, 64, False),     # Nq < Nk
    (3, 4, 1, 1000, 128, True),      # decode-like: one query row sees every key
    (2, 2, 1, 1000, 64, False),
    (2, 8, 1000, 1000, 128, True, 2),  # GQA 4:1
    (1, 8, 1, 1000, 64, True, 1),      # MQA decode
]


def _usable(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    """Skip with the spec's reason when this GPU, torch build or shape is not served."""
    from flashtune.core.device import cuda_device

    b, h, nq, nk, d, causal = shape[:6]
    problem = AttentionProblem(b, h, shape[6] if len(shape) > 6 else h, nq, nk, d, causal,
                               "fp16" if dtype == torch.float16 else "bf16")
    reason = get_template(name).refuse(problem, cuda_device(), return_lse=True)
    if reason is not None:
        pytest.skip(f"{name}: {reason}")


def make_qkv(b, h, nq, nk, d, dtype, *, seed=0, layout="bhnd", hkv=None):
    g = torch.Generator(device="cuda").manual_seed(seed)

    def rand(n, heads):
        if layout == "bnhd":  # (B, N, H, D) storage seen as (B, H, N, D)
            return torch.randn(b, n, heads, d, generator=g, device="cuda").to(dtype) \
                .transpose(1, 2)
        return torch.randn(b, heads, n, d, generator=g, device="cuda").to(dtype)
    hkv = hkv or h
    return rand(nq, h), rand(nk, hkv), rand(nk, hkv)


@pytest.mark.parametrize("layout", ["bhnd", "bnhd"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "b{}h{}q{}k{}d{}{}{}".format(
    *s[:5], "c" if s[5] else "", f"kv{s[6]}" if len(s) > 6 else ""))
@pytest.mark.parametrize("name", FUSED)
def test_output_and_lse_match_the_reference(name, shape, dtype, layout):
    _usable(name, shape, dtype)
    b, h, nq, nk, d, causal = shape[:6]
    q, k, v = make_qkv(b, h, nq, nk, d, dtype, layout=layout,
                       hkv=shape[6] if len(shape) > 6 else None)
    out, lse = get_template(name).launcher(q, k, v, {}, causal=causal, return_lse=True)
    assert lse.shape == (b, h, nq) and lse.dtype == torch.float32
    assert_close_to_reference(out, q, k, v, causal=causal, lse=lse)
    alone = get_template(name).launcher(q, k, v, {}, causal=causal)
    assert torch.equal(alone, out)


@pytest.mark.parametrize("name", FUSED)
def test_a_scale_is_passed_through(name):
    shape = (1, 2, 333, 333, 64, True)
    _usable(name, shape, torch.bfloat16)
    q, k, v = make_qkv(*shape[:5], torch.bfloat16, seed=5)
    out, lse = get_template(name).launcher(q, k, v, {}, causal=True, scale=0.3, return_lse=True)
    assert_close_to_reference(out, q, k, v, causal=True, scale=0.3, lse=lse)


@pytest.mark.parametrize("layout", ["bhnd", "bnhd"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("shape", [(2, 3, 1000, 1000, 64, False), (1, 4, 1000, 1000, 128, True),
                                   (2, 2, 77, 1000, 64, False),
                                   (1, 8, 1000, 1000, 128, True, 2)],
                         ids=["full", "causal", "nq<nk", "gqa"])
@pytest.mark.parametrize("name", FUSED)
def test_gradients_through_autograd_match_the_reference(name, shape, dtype, layout):
    _usable(name, shape, dtype)
    b, h, nq, nk, d, causal = shape[:6]
    q, k, v = make_qkv(b, h, nq, nk, d, dtype, seed=1, layout=layout,
                       hkv=shape[6] if len(shape) > 6 else None)
    dout = torch.randn(b, h, nq, d, device="cuda",
                       generator=torch.Generator(device="cuda").manual_seed(2)).to(dtype)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = get_template(name).launcher(*leaves, {}, causal=causal)
    assert out.requires_grad
    out.backward(dout)
    grads = [t.grad for t in leaves]
    assert_grads_close(grads, q, k, v, dout, causal=causal)


@pytest.mark.parametrize("name", FUSED)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("return_lse", [False, True])
def test_the_bound_call_returns_what_the_launcher_does(name, shape, return_lse):
    """The runtime's memoised plan for an extern (``bound_inference``): the same output (and
    LSE where it binds one) as the launcher, bit for bit."""
    from flashtune.kernel_templates.sdpa_extern import bound_inference

    _usable(name, shape, torch.bfloat16)
    b, h, nq, nk, d, causal = shape[:6]
    hkv = shape[6] if len(shape) > 6 else h
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(b, h, nq, d, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(b, hkv, nk, d, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn_like(k)
    fn = bound_inference(name, q, k, causal=causal, scale=0.1, return_lse=return_lse)
    if fn is None:
        assert return_lse and name != "sdpa_flash"
        return
    with torch.no_grad():
        want = get_template(name).launcher(q, k, v, {}, causal=causal, scale=0.1,
                                           return_lse=return_lse)
        got = fn(q, k, v)
    for g_, w in zip((got,) if not return_lse else got, (want,) if not return_lse else want):
        assert torch.equal(g_, w)


def test_a_call_routed_to_torch_s_own_pick_is_keyed_by_shape_and_serves_any_layout():
    """After the first call of a shape routed to the backend torch's SDPA itself picks, the
    runtime keeps torch's SDPA with the options bound under a key of shapes, dtype, device
    and options alone (``routing._BY_SHAPE``): later calls of another layout run through it
    and match the reference, and bad inputs still get torch's error."""
    import flashtune
    from flashtune.kernel_templates.sdpa_extern import any_layout
    from flashtune.runtime import routing

    q, k, v = make_qkv(2, 8, 300, 300, 128, torch.bfloat16, hkv=2)
    choice = flashtune.lookup_config(q, k, v, causal=True)
    if get_template(choice.template).kind != "extern":
        pytest.skip(f"this GPU routes the shape to {choice.template}")
    flashtune.reload_configs()
    with torch.no_grad():
        flashtune.attention(q, k, v, causal=True)
        bound = list(routing._BY_SHAPE.values())
        if not bound:
            pytest.skip("torch's SDPA would pick another backend than the routed one")
        assert len(bound) == 1 and any_layout(bound[0])
        for layout in ("bnhd", "bhnd"):
            q2, k2, v2 = make_qkv(2, 8, 300, 300, 128, torch.bfloat16, seed=1, layout=layout,
                                  hkv=2)
            out = flashtune.attention(q2, k2, v2, causal=True)
            assert_close_to_reference(out, q2, k2, v2, causal=True)
        assert len(routing._BY_SHAPE) == 1
        with pytest.raises(RuntimeError):
            flashtune.attention(q, k.half(), v, causal=True)

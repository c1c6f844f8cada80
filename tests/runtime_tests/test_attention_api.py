"""flashtune.attention: the public op, its defaults and every bad input."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace
from typing import Any

import pytest
import torch

import flashtune
from flashtune.core.errors import ConfigError, DeviceError, InputError, InputTypeError
from tests.conftest import DEVICE
from tests.helpers import assert_close_to_reference


def qkv(b=1, hq=2, hkv=2, nq=33, nk=47, d=64, dtype=torch.float16, seed=0):
    g = torch.Generator().manual_seed(seed)
    mk = lambda h, n: torch.randn(b, h, n, d, generator=g).to(dtype).to(DEVICE)  # noqa: E731
    return mk(hq, nq), mk(hkv, nk), mk(hkv, nk)


def test_default_config_call_matches_reference():
    q, k, v = qkv(hq=6, hkv=2, nq=77, nk=133)
    out = flashtune.attention(q, k, v, causal=True)
    assert_close_to_reference(out, q, k, v, causal=True)
    out2, lse = flashtune.attention(q, k, v, causal=True, return_lse=True)
    assert torch.equal(out, out2) and lse.shape == (1, 6, 77)


def test_explicit_config():
    q, k, v = qkv()
    cfg = {"BLOCK_M": 16, "BLOCK_N": 32, "num_warps": 2, "num_stages": 1}
    out = flashtune.attention(q, k, v, config=cfg)
    assert_close_to_reference(out, q, k, v, causal=False)


def test_mqa_bf16_through_the_api():
    q, k, v = qkv(hq=4, hkv=1, nq=1, nk=90, d=128, dtype=torch.bfloat16)
    out = flashtune.attention(q, k, v)
    assert_close_to_reference(out, q, k, v, causal=False)


BAD = [
    # (description, mutate(q, k, v) -> (q, k, v, kwargs), exception, message regex)
    ("q not a tensor", lambda q, k, v: ([1.0], k, v, {}), InputTypeError, "q must be a torch.Tensor"),
    ("wrong rank", lambda q, k, v: (q[0], k, v, {}), InputError, "q must have 4 dimensions"),
    ("fp32", lambda q, k, v: (q.float(), k.float(), v.float(), {}), InputTypeError,
     "q must be float16 or bfloat16"),
    ("mixed dtypes", lambda q, k, v: (q, k.bfloat16(), v.bfloat16(), {}), InputTypeError,
     "share one dtype"),
    ("batch mismatch", lambda q, k, v: (q.expand(2, -1, -1, -1), k, v, {}), InputError,
     "batch mismatch"),
    ("head_dim mismatch", lambda q, k, v: (q, k[..., :32], v[..., :32], {}), InputError,
     "head_dim mismatch|contiguous"),
    ("k v shapes differ", lambda q, k, v: (q, k, v[:, :, :5], {}), InputError, "k and v must have"),
    ("heads not a multiple", lambda q, k, v: (q[:, :1].expand(1, 3, -1, -1), k, v, {}), InputError,
     "multiple of k/v's heads"),
    ("head_dim over 256", lambda q, k, v: (*(t.new_zeros(*t.shape[:3], 257) for t in (q, k, v)),
                                           {}),
     InputError, "head_dim 257 is not supported: flashtune serves head dims 1 to 256"),
    ("last dim strided", lambda q, k, v: (q.transpose(2, 3).contiguous().transpose(2, 3)[:, :, :, :],
                                          k, v, {}), InputError, "q must be contiguous in its last"),
    ("empty", lambda q, k, v: (q[:, :, :0], k, v, {}), InputError, "q is empty"),
    ("nan scale", lambda q, k, v: (q, k, v, {"scale": float("nan")}), InputError, "scale must be"),
    ("unknown config key", lambda q, k, v: (q, k, v, {"config": {"BLOCK_M": 16, "BLOCK_N": 16,
                                                                "num_warps": 4, "num_stages": 2,
                                                                "BLOCK_K": 8}}),
     ConfigError, "unknown keys \\['BLOCK_K'\\]"),
    ("config value outside space", lambda q, k, v: (q, k, v, {"config": {
        "BLOCK_M": 24, "BLOCK_N": 16, "num_warps": 4, "num_stages": 2}}),
     ConfigError, "BLOCK_M.*24"),
]


@pytest.mark.parametrize("name,mutate,exc,msg", BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_a_clear_error(name, mutate, exc, msg):
    q, k, v = qkv()
    q2, k2, v2, kwargs = mutate(q, k, v)
    with pytest.raises(exc, match=msg):
        flashtune.attention(q2, k2, v2, **kwargs)


def test_errors_are_builtin_subclasses():
    assert issubclass(InputError, ValueError) and issubclass(InputTypeError, TypeError)
    assert issubclass(ConfigError, ValueError)
    assert issubclass(InputError, flashtune.FlashtuneError)


@pytest.mark.skipif(DEVICE != "cpu", reason="CPU-device check")
def test_mixed_devices_and_meta_device():
    q, k, v = qkv()
    with pytest.raises(InputError, match="one device"):
        flashtune.attention(q, k.to("meta"), v.to("meta"))
    with pytest.raises(DeviceError, match="needs CUDA tensors"):
        flashtune.attention(q.to("meta"), k.to("meta"), v.to("meta"))


def test_cpu_tensors_without_interpreter_are_refused():
    code = ("import torch, flashtune\n"
            "q = torch.randn(1, 1, 4, 16, dtype=torch.float16)\n"
            "try:\n    flashtune.attention(q, q, q)\n"
            "except flashtune.DeviceError as e:\n    print('REFUSED', e)\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          timeout=300)
    assert "REFUSED" in proc.stdout and "TRITON_INTERPRET=1" in proc.stdout, proc.stderr[-2000:]


def test_import_is_light():
    code = "import sys, flashtune; print('torch' in sys.modules, 'triton' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.stdout.split() == ["False", "False"], proc.stdout + proc.stderr


def test_double_backward_is_refused_not_silently_zero():
    """attn_bwd is not differentiable: a gradient penalty (grad of a grad) must raise, not
    quietly add nothing because the first gradient carries no graph."""
    q, k, v = (t.requires_grad_(True) for t in qkv(nq=16, nk=24, d=32))
    out = flashtune.attention(q, k, v, causal=True)
    (dq,) = torch.autograd.grad(out.float().sum(), q, create_graph=True)
    assert dq.requires_grad  # not silently cut off from the graph
    with pytest.raises(RuntimeError, match="differentiate twice.*once_differentiable"):
        dq.float().square().sum().backward()
    _, lse = flashtune.attention(q, k, v, return_lse=True)  # only the LSE's gradient
    (dk,) = torch.autograd.grad(lse.sum(), k, create_graph=True)
    with pytest.raises(RuntimeError, match="differentiate twice"):
        dk.float().sum().backward()
    # one backward still works
    out = flashtune.attention(q, k, v, causal=True)
    out.float().sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()


def test_impl_attn_fwd_is_honoured_with_and_without_gradients(monkeypatch):
    """``impl="attn_fwd"`` forces flashtune's own kernels: the training step is the attn_fwd
    / attn_bwd pair whatever the router would choose (FlashAttention-2's
    ``deterministic=True`` relies on it), and a call without gradients is attn_fwd's."""
    from flashtune.runtime import autograd, ops

    seen = []
    real_train, real_attention = ops._train, ops._attention

    def train(*args):
        seen.append(("train", args[-1]))
        return real_train(*args)

    def attention(*args):
        seen.append(("attention", args[-1] if len(args) == 8 else None))
        return real_attention(*args)

    monkeypatch.setattr(ops, "_train", train)
    monkeypatch.setattr(ops, "_attention", attention)
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 2, 19, 16, generator=g).to(torch.float16).to(DEVICE)
               for _ in range(3))
    out = flashtune.attention(q, k, v, causal=True, impl="attn_fwd")
    assert_close_to_reference(out, q, k, v, causal=True)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out = flashtune.attention(*leaves, causal=True, impl="attn_fwd")
    out.float().sum().backward()
    assert seen == [("attention", "attn_fwd"), ("train", "attn_fwd")]
    route = autograd._train_route(leaves[0], leaves[1], True, False, None, "attn_fwd")
    assert route.fwd.name == "attn_fwd" and route.bwd is not None \
        and route.bwd.name == "attn_bwd"


@pytest.mark.parametrize("uses", ["out", "lse", "both"])
def test_a_compiled_step_hands_its_backward_only_the_gradients_the_loss_uses(monkeypatch,
                                                                             uses):
    """Under ``torch.compile`` the call is the custom op ``flashtune::attention_fwd_v2``: an
    output the loss does not use reaches its backward as None, not zeros (as eager's
    PairFn), so a backward that takes no LSE gradient (cuDNN's) runs where the LSE is
    unused; the gradients equal eager's either way."""
    from flashtune.runtime import autograd
    from flashtune.runtime.routing import TrainRoute

    seen: list[torch.Tensor | None] = []
    paired = autograd._paired

    def spy(*args: Any, **kwargs: Any) -> Any:
        route = paired(*args, **kwargs)
        bwd = route.bwd

        def launcher(*a: Any, dlse: torch.Tensor | None = None, **kw: Any) -> Any:
            seen.append(dlse)
            return bwd.launcher(*a, dlse=dlse, **kw)

        return TrainRoute(route.fwd, route.fwd_config, replace(bwd, launcher=launcher),
                          route.bwd_config)

    monkeypatch.setattr(autograd, "_paired", spy)
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, 2, 40, 16, generator=g).to(DEVICE, torch.float16)
               for _ in range(3))

    def loss_fn(q, k, v):
        out, lse = flashtune.attention(q, k, v, causal=True, return_lse=True)
        terms = {"out": (out.float() ** 2).sum(), "lse": lse.sum()}
        return terms["out"] + terms["lse"] if uses == "both" else terms[uses]

    grads = []
    for fn in (loss_fn, torch.compile(loss_fn, backend="aot_eager", fullgraph=True)):
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        fn(*leaves).backward()
        grads.append([t.grad for t in leaves])
    for eager, compiled in zip(*grads, strict=True):
        # a GPU's backward may accumulate dQ in another order from one run to the next
        torch.testing.assert_close(compiled, eager, atol=2e-3, rtol=2e-3)
    assert len(seen) == 1  # the compiled backward (eager runs PairFn)
    assert (seen[0] is None) == (uses == "out")


@pytest.mark.parametrize("varlen", [False, True])
def test_float32_inputs_under_autocast_run_in_its_dtype_as_torch_sdpa(varlen):
    """Under autocast torch's SDPA runs float32 inputs in autocast's dtype (a rotary
    embedding in float32 hands attention float32 queries): flashtune.attention and
    attention_varlen do the same, with gradients back to the float32 leaves; outside
    autocast float32 is still refused, naming q."""
    half = torch.float16 if DEVICE == "cpu" else torch.bfloat16
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 21, 16, generator=g).to(DEVICE) for _ in range(3))
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]

    def call(q, k, v):
        if not varlen:
            return flashtune.attention(q, k, v, causal=True)
        cu = torch.tensor([0, 21], dtype=torch.int32, device=DEVICE)
        out = flashtune.attention_varlen(q[0].transpose(0, 1), k[0].transpose(0, 1),
                                         v[0].transpose(0, 1), cu, cu, 21, 21, causal=True)
        return out.transpose(0, 1)[None]

    with torch.autocast(DEVICE, dtype=half):
        got = call(*leaves)
        choice = flashtune.lookup_config(q, k, v, causal=True)
    want = call(*(t.to(half).requires_grad_(True) for t in (q, k, v)))  # the same route
    assert got.dtype == half and choice.template
    tol = 2e-3 if half == torch.float16 else 1.6e-2  # bfloat16: 8 bits of mantissa
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    got.float().sum().backward()
    assert all(t.grad is not None and t.grad.dtype == torch.float32 for t in leaves)
    with pytest.raises(InputTypeError, match="q must be float16 or bfloat16"):
        call(q, k, v)

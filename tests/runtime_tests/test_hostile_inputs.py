"""Hostile runtime input: errors before any kernel launch, and NaN in -> NaN out.

The per-argument errors of each public op are listed in ``test_attention_api.py`` and
``test_kvcache.py``; here every one of them is replayed with the kernel launch trapped, to
prove that the check fires before anything reaches the GPU (or the interpreter), plus the
inputs those lists do not cover: absurd head dims, empty key/value and batch, and NaN or inf
values, which must come out as NaN where the float64 reference has NaN, and as the right
numbers everywhere else, never as a crash.
"""

from __future__ import annotations

import math

import pytest
import torch
import triton

import flashtune
from flashtune.core.errors import InputError
from flashtune.runtime import checks
from flashtune.runtime.kvcache import attention_with_kvcache
from tests.conftest import DEVICE
from tests.decode_helpers import make_cache
from tests.runtime_tests import test_attention_api as api_cases
from tests.runtime_tests import test_kvcache as kv_cases

# numpy (the interpreter) warns on the NaN arithmetic these tests ask for
pytestmark = [pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
              pytest.mark.filterwarnings("ignore:All-NaN slice encountered:RuntimeWarning")]


class LaunchTrap:
    """Counts kernel launches: every Triton launch, compiled or interpreted, goes through
    ``JITFunction.run`` (``kernel[grid](...)``) or the interpreter's ``run``."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls = 0
        classes = [triton.runtime.jit.JITFunction]
        try:
            from triton.runtime.interpreter import InterpretedFunction
            classes.append(InterpretedFunction)
        except ImportError:  # pragma: no cover - every triton 3.x has it
            pass
        for cls in classes:
            real = cls.run

            def run(fn_self, *args, _real=real, **kwargs):
                self.calls += 1
                return _real(fn_self, *args, **kwargs)

            monkeypatch.setattr(cls, "run", run)


@pytest.mark.parametrize("name,mutate,exc,msg", api_cases.BAD, ids=[b[0] for b in api_cases.BAD])
def test_attention_errors_come_before_any_launch(monkeypatch, name, mutate, exc, msg):
    trap = LaunchTrap(monkeypatch)
    q, k, v = api_cases.qkv()
    q2, k2, v2, kwargs = mutate(q, k, v)
    with pytest.raises(exc, match=msg):
        flashtune.attention(q2, k2, v2, **kwargs)
    assert trap.calls == 0, f"{name}: a kernel was launched before the error"


@pytest.mark.parametrize("desc,paged,mutate,exc,msg", kv_cases.BAD, ids=[b[0] for b in kv_cases.BAD])
def test_kvcache_errors_come_before_any_launch(monkeypatch, desc, paged, mutate, exc, msg):
    trap = LaunchTrap(monkeypatch)
    q, k, v, lens, table = kv_cases._inputs(paged)
    args, kwargs = mutate(q, k, v, lens, table)
    with pytest.raises(exc, match=msg):
        attention_with_kvcache(*args, **kwargs)
    assert trap.calls == 0, f"{desc}: a kernel was launched before the error"


@pytest.mark.parametrize("which", list(kv_cases.TABLE_ERRORS))
def test_bad_cache_tables_come_before_any_launch(monkeypatch, which):
    trap = LaunchTrap(monkeypatch)
    q, k, v, lens, table = kv_cases._table_case(which)
    with pytest.raises(InputError, match=kv_cases.TABLE_ERRORS[which]):
        attention_with_kvcache(q, k, v, lens, block_table=table, check_tables=True)
    assert trap.calls == 0


def _t(*shape, dtype=torch.float16):
    return torch.randn(*shape).to(dtype).to(DEVICE)


@pytest.mark.parametrize("head_dim", [0, 257, 300, 512, 1 << 20])
def test_absurd_head_dims_are_refused_before_any_launch(monkeypatch, head_dim):
    trap = LaunchTrap(monkeypatch)
    # a (1, 1, 1, D) tensor costs nothing even at D = 2**20; D = 0 is an empty tensor
    q = torch.zeros(1, 1, 1, head_dim, dtype=torch.float16, device=DEVICE)
    with pytest.raises(InputError, match=r"head_dim|empty"):
        flashtune.attention(q, q, q)
    assert trap.calls == 0


@pytest.mark.parametrize("which", ["k", "batch", "heads"])
def test_empty_tensors_are_refused_before_any_launch(monkeypatch, which):
    trap = LaunchTrap(monkeypatch)
    q, k, v = _t(1, 2, 8, 32), _t(1, 2, 8, 32), _t(1, 2, 8, 32)
    if which == "k":
        k, v = k[:, :, :0], v[:, :, :0]
    elif which == "batch":
        q, k, v = q[:0], k[:0], v[:0]
    else:
        q, k, v = q[:, :0], k[:, :0], v[:, :0]
    with pytest.raises(InputError, match=r"(q|k|v) is empty"):
        flashtune.attention(q, k, v)
    assert trap.calls == 0


# -- CUDA's launch grid limit (65535 programs on axes 1 and 2) ---------------------------------


def _meta(*shape):
    return torch.empty(*shape, dtype=torch.float16, device="meta")


def test_grid_limits_by_kernel(monkeypatch):
    """The sizes each template puts on axes 1 and 2, at CUDA's real limit (meta tensors:
    no memory; the interpreter's CPU has no limit)."""
    monkeypatch.setattr(checks, "GRID_LIMITED_DEVICES", frozenset({"meta"}))
    k = _meta(2048, 8, 64, 128)
    assert checks.grid_problem(_meta(2047, 32, 64, 128), k[:2047]) is None
    msg = checks.grid_problem(_meta(2048, 32, 64, 128), k)  # attn_fwd/attn_bwd: B x Hq
    assert msg == ("batch x heads_q = 2048 x 32 = 65536 programs on the launch grid's axis 1, "
                   "more than CUDA's limit of 65535; split the batch into calls of at most "
                   "2047 sequences")
    assert checks.grid_problem(_meta(2048, 32, 1, 128), k, decode=True) is None  # B x Hkv
    msg = checks.grid_problem(_meta(8192, 32, 1, 128), _meta(8192, 8, 64, 128), decode=True)
    assert msg is not None and msg.startswith("batch x heads_kv = 8192 x 8 = 65536")
    assert "split the heads" in checks.grid_problem(_meta(1, 65536, 1, 16), _meta(1, 1, 8, 16))
    # attn_decode's axis 2: the query row tiles of a GQA group (128 rows a tile)
    many = _meta(1, 8, 65535 * 16 + 1, 16)
    msg = checks.grid_problem(many, _meta(1, 1, 8, 16), decode=True)
    assert msg is not None and "65536 row tiles on the launch grid's axis 2" in msg
    with pytest.raises(InputError, match="batch x heads_q = 2048 x 32"):
        checks.check_grid(_meta(2048, 32, 64, 128), k)
    monkeypatch.setattr(checks, "GRID_LIMITED_DEVICES", frozenset({"cuda"}))
    assert checks.grid_problem(_meta(2048, 32, 64, 128), k) is None  # meta: no limit


@pytest.fixture
def small_grid_limit(monkeypatch):
    """CUDA's grid limit, shrunk to 7 programs and applied to this device too (the grid is
    checked once per shape: forget the shapes seen)."""
    monkeypatch.setattr(checks, "GRID_LIMITED_DEVICES", frozenset({"cuda", DEVICE}))
    monkeypatch.setattr(checks, "MAX_GRID_YZ", 7)
    flashtune.reload_configs()
    yield
    flashtune.reload_configs()


def test_grids_past_the_limit_are_refused_before_any_launch(monkeypatch, small_grid_limit):
    trap = LaunchTrap(monkeypatch)
    q, k, v = _t(2, 4, 8, 32), _t(2, 2, 8, 32), _t(2, 2, 8, 32)  # B x Hq = 8 > 7
    want = "batch x heads_q = 2 x 4 = 8 programs .* split the batch into calls of at most 1 "
    for _ in range(2):  # the shape's route is memoised the first time: refused again
        with pytest.raises(InputError, match=want):
            flashtune.attention(q, k, v)
    with pytest.raises(InputError, match=want):
        flashtune.attention(q, k, v, config={"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 2,
                                             "num_stages": 1})
    with pytest.raises(InputError, match=want):
        flashtune.attention(q.requires_grad_(), k, v)
    cq, ck, cv, lens, table = make_cache([5, 40], 8, 4, 1, 32, torch.float16, DEVICE,
                                         page_size=16, capacity=48)  # B x Hkv = 8 > 7
    with pytest.raises(InputError, match="batch x heads_kv = 2 x 4 = 8 programs"):
        attention_with_kvcache(cq, ck, cv, lens, block_table=table)
    assert trap.calls == 0


def test_the_grid_limit_follows_the_route(small_grid_limit):
    """attn_decode's grid has B x Hkv programs on axis 1: a short-query call with
    B x Hq over the limit but B x Hkv under it runs; torch's SDPA takes calls flashtune
    would refuse."""
    from flashtune.runtime import kvcache
    from flashtune.runtime.sdpa import fallback_reason, scaled_dot_product_attention

    q, k, v = _t(2, 4, 1, 32), _t(2, 2, kvcache.DECODE_MIN_KEYS, 32), \
        _t(2, 2, kvcache.DECODE_MIN_KEYS, 32)
    assert flashtune.lookup_config(q, k, v).template == "attn_decode"
    out = flashtune.attention(q, k, v)
    assert out.shape == q.shape and torch.isfinite(out).all()
    assert fallback_reason(q, k, v, enable_gqa=True) == "B x Hq over CUDA's launch grid limit"
    got = scaled_dot_product_attention(q, k, v, enable_gqa=True)
    torch.testing.assert_close(got, out, atol=2e-3, rtol=0)


def test_a_call_with_gradients_past_the_limit_is_refused_before_any_launch(monkeypatch):
    # the training route checks the forward's grid and the backward's when it is chosen
    q, k, v = (_t(2, 4, 8, 32).requires_grad_() for _ in range(3))
    monkeypatch.setattr(checks, "GRID_LIMITED_DEVICES", frozenset({"cuda", DEVICE}))
    monkeypatch.setattr(checks, "MAX_GRID_YZ", 7)
    trap = LaunchTrap(monkeypatch)
    with pytest.raises(InputError, match="batch x heads_q = 2 x 4 = 8 programs"):
        flashtune.attention(q, k, v)
    assert trap.calls == 0


def _reference(q, k, v, causal):
    """Float64 softmax attention (NaN propagates as in any exact implementation);
    bottom-right causal as flashtune.attention."""
    qd, kd, vd = q.double(), k.double(), v.double()
    group = q.shape[1] // k.shape[1]
    kd, vd = kd.repeat_interleave(group, 1), vd.repeat_interleave(group, 1)
    s = qd @ kd.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        nq, nk = q.shape[2], k.shape[2]
        i = torch.arange(nq, device=q.device)[:, None]
        j = torch.arange(nk, device=q.device)[None, :]
        s = s.masked_fill(j > i + (nk - nq), float("-inf"))
    return torch.softmax(s, -1) @ vd


def _check_nan_pattern(out, ref):
    """NaN exactly where the float64 reference is NaN; elsewhere close to it."""
    nan_ref, nan_out = torch.isnan(ref), torch.isnan(out)
    assert nan_ref.any(), "the test must poison something"
    assert torch.equal(nan_out.cpu(), nan_ref.cpu()), (
        f"NaN pattern differs: kernel has {int(nan_out.sum())} NaN, the reference "
        f"{int(nan_ref.sum())}")
    ok = ~nan_ref
    err = (out.double()[ok] - ref[ok]).abs().max().item()
    assert err < 2e-2, f"clean entries moved: max error {err:.3e}"


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("where", ["q", "k", "v"])
def test_nan_in_gives_nan_out_forward(where, causal):
    g = torch.Generator().manual_seed(7)
    mk = lambda h, n: torch.randn(1, h, n, 32, generator=g).half().to(DEVICE)  # noqa: E731
    q, k, v = mk(4, 37), mk(2, 45), mk(2, 45)
    # one poisoned element: q row 5 (that row is NaN); k at key 20 (NaN scores for the
    # queries that see it; a causal mask hides it from the others); v at key 2 (column 3 of
    # every row: key 2 is visible to every query). A NaN in v at a key that the causal mask
    # hides from a query in the same tile leaks into that query as 0 * NaN, as in any
    # matmul-based attention kernel: not a promise either way.
    {"q": q[0, 1, 5], "k": k[0, 0, 20], "v": v[0, 1, 2]}[where][3] = float("nan")
    out = flashtune.attention(q, k, v, causal=causal, config={
        "BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1})
    _check_nan_pattern(out, _reference(q, k, v, causal))


def test_inf_in_q_gives_nan_not_a_crash():
    """+inf in q makes the scores inf - inf = NaN: the reference says NaN too."""
    q, k, v = _t(1, 2, 17, 32), _t(1, 2, 23, 32), _t(1, 2, 23, 32)
    q[0, 0, 3, 0] = float("inf")
    out = flashtune.attention(q, k, v)
    _check_nan_pattern(out, _reference(q, k, v, False))


def test_nan_in_gives_nan_out_short_query_route():
    """Nq <= 16 goes to attn_decode (split-KV): a NaN key poisons every split's partial
    result it lands in, and the combine must keep it NaN."""
    q, k, v = _t(2, 8, 1, 64), _t(2, 2, 150, 64), _t(2, 2, 150, 64)
    k[1, 1, 140, 7] = float("nan")
    out = flashtune.attention(q, k, v)
    _check_nan_pattern(out, _reference(q, k, v, False))


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_nan_in_gives_nan_out_kvcache(paged):
    q, k, v, lens, table = make_cache([9, 40], 4, 2, 1, 64, torch.float16, DEVICE,
                                      page_size=16 if paged else None, capacity=48, seed=5)
    # poison sequence 1's key 30 (in use), and key 12 of sequence 0 (length 9: the slot is
    # in its own first page or row but beyond its length, never read: it must stay clean)
    if paged:
        k[table[1, 30 // 16].item(), 1, 30 % 16, 0] = float("nan")
        k[table[0, 0].item(), 0, 12, 0] = float("nan")
    else:
        k[1, 1, 30, 0] = float("nan")
        k[0, 0, 12, 0] = float("nan")
    out = attention_with_kvcache(q, k, v, lens, block_table=table, causal=True)
    assert torch.isnan(out[1, 2:4]).all(), "the heads of kv head 1 must be NaN in sequence 1"
    assert not torch.isnan(out[1, :2]).any(), "kv head 0 of sequence 1 is clean"
    assert not torch.isnan(out[0]).any(), "an unused cache slot leaked into sequence 0"


def test_nan_in_gives_nonfinite_grads_backward():
    """Autograd through flashtune.attention with a NaN key: the poisoned head's gradients
    are non-finite wherever the float64 reference's are NaN (dq and dk NaN; dv may come
    out as inf, because the forward stores LSE = -inf for a row whose sum is NaN), the
    clean head's are finite and right, and nothing crashes."""
    q = _t(1, 2, 19, 32).requires_grad_()
    k = _t(1, 2, 27, 32)
    v = _t(1, 2, 27, 32).requires_grad_()
    k[0, 1, 4, 2] = float("nan")
    k.requires_grad_()
    out = flashtune.attention(q, k, v)
    assert torch.isnan(out[0, 1]).all() and torch.isfinite(out[0, 0]).all()
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = _reference(qd, kd, vd, False)
    rdq, rdk, rdv = torch.autograd.grad(ref, (qd, kd, vd), torch.ones_like(ref))
    for name, got, want in (("dq", dq, rdq), ("dk", dk, rdk), ("dv", dv, rdv)):
        assert torch.isnan(want[0, 1]).any(), name
        assert torch.equal((~torch.isfinite(got[0, 1])).cpu(), torch.isnan(want[0, 1]).cpu()), \
            f"{name}: head 1's non-finite pattern differs from the reference's NaN"
        assert torch.isfinite(got[0, 0]).all(), f"{name}: NaN leaked into the clean head"
        err = (got[0, 0].double() - want[0, 0]).abs().max().item()
        assert err < 5e-2 * max(1.0, want[0, 0].abs().max().item()), f"{name}: error {err:.3e}"

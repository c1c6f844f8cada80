"""Search across implementations (flashtune.autotune.select): which implementations apply,
forced ones checked before any work, the side-by-side timing, and the whole path
``tune_op`` -> stored choice -> router -> ``attention`` under the interpreter, with torch's
math SDPA standing in for an extern candidate."""

from __future__ import annotations

import pytest
import torch

import flashtune
from flashtune.autotune.options import TuneOptions
from flashtune.autotune.runners import TrialResult
from flashtune.autotune.select import (
    EXTERN_TIE,
    Leader,
    OpResult,
    applicable,
    prefer_extern_on_ties,
    time_side_by_side,
    tune_op,
)
from flashtune.core.device import interpreter_device
from flashtune.core.errors import InputError
from flashtune.core.problem import AttentionProblem
from flashtune.db import open_store
from flashtune.db.records import TrialState
from tests.conftest import DEVICE

TINY = AttentionProblem(1, 2, 2, 48, 48, 32, False, "fp16")
DEV = interpreter_device()
# these tests run the Triton interpreter's path (CPU tensors); a GPU run tests the same
# search in the device's own runs (benchmarks/route_fwd.sh)
interpreter_only = pytest.mark.skipif(DEVICE != "cpu", reason="runs kernels under the "
                                      "Triton interpreter on CPU tensors")


def test_applicable_skips_what_cannot_run_here_with_the_reason():
    specs, skipped = applicable("fwd", TINY, DEV)
    names = [s.name for s in specs]
    assert "attn_fwd" in names and "sdpa_math" in names
    reasons = dict(skipped)
    for gpu_only in ("sdpa_cudnn", "sdpa_flash", "sdpa_efficient", "attn_fwd_gluon"):
        assert "GPU" in reasons[gpu_only], reasons
    decode = [s.name for s in applicable("decode", AttentionProblem(
        1, 2, 2, 1, 200, 32, True, "fp16"), DEV)[0]]
    assert "attn_decode" in decode and "attn_fwd" in decode
    # attn_decode serves at most 16 queries
    assert "attn_decode" in dict(applicable("decode", TINY, DEV)[1])


def test_on_a_gpu_the_math_backend_is_searched_only_when_named():
    from dataclasses import replace

    from flashtune.core.device import DeviceFingerprint

    h100 = DeviceFingerprint("NVIDIA_H100_80GB_HBM3", "9.0", 132, 232448, 85 << 30)
    long = replace(TINY, seqlen_q=32768, seqlen_k=32768, head_dim=128, dtype="bf16")
    specs, skipped = applicable("fwd", long, h100)
    assert "sdpa_math" not in [s.name for s in specs]
    assert "never a contender on a GPU" in dict(skipped)["sdpa_math"]
    assert [s.name for s in applicable("fwd", long, h100, ["sdpa_math"])[0]] == ["sdpa_math"]
    assert "sdpa_math" in [s.name for s in applicable("fwd", long, DEV)[0]]  # interpreter


def test_applicable_refuses_an_unknown_op_and_an_implementation_of_another_op():
    with pytest.raises(InputError, match="op must be one of"):
        applicable("bwd", TINY, DEV)
    with pytest.raises(InputError, match="does not serve op 'fwd'"):
        applicable("fwd", TINY, DEV, ["attn_decode"])


def test_a_forced_implementation_that_cannot_serve_fails_before_any_work(tmp_path):
    url = f"sqlite:///{tmp_path / 't.db'}"
    with pytest.raises(InputError, match="--impl sdpa_cudnn cannot serve .*GPU"):
        tune_op([TINY], "fwd", TuneOptions(trials=1, interpret=True),
                impls=["sdpa_cudnn"], db_url=url, progress=False, _device=DEV)
    assert not (tmp_path / "t.db").exists()
    unaligned = AttentionProblem(1, 2, 2, 48, 64, 32, True, "fp16")
    with pytest.raises(InputError, match="sdpa_math cannot serve .*causal"):
        tune_op([TINY, unaligned], "fwd", TuneOptions(trials=1, interpret=True),
                impls=["sdpa_math"], db_url=url, progress=False, _device=DEV)


class _Timed:
    """A runner with GPU-style timing: ``time_config`` returns the next of ``times``."""

    interpreting = False
    flops = 1.0

    def __init__(self, times, fail_at=None):
        self.times = list(times)
        self.calls = 0
        self.fail_at = fail_at

    def time_config(self, config, rep_ms=100.0):
        self.calls += 1
        if self.fail_at is not None and self.calls == self.fail_at:
            raise RuntimeError("launch failed\nmore")
        t = self.times.pop(0)
        return t, t, t

    def evaluate(self, config):  # pragma: no cover - GPU-style runners are timed
        raise AssertionError("a GPU runner is timed, not evaluated")


class _Evaluated:
    interpreting = True

    def __init__(self, result):
        self.result = result

    def evaluate(self, config):
        return self.result


def test_side_by_side_takes_the_median_of_rounds_and_keeps_failures_as_data():
    a = _Timed([1.0, 5.0, 1.2, 1.1, 0.9])
    b = _Timed([2.0, 2.0, 2.0, 2.0, 2.0], fail_at=3)
    c = _Evaluated(TrialResult(TrialState.COMPLETE, median_ms=7.0))
    d = _Evaluated(TrialResult(TrialState.WRONG_RESULT, "relative error 1"))
    out = time_side_by_side([(a, {}), (b, {}), (c, {}), (d, {})], rounds=5)
    assert out[0] == (1.1, None)
    assert out[1][0] is None and "launch failed" in out[1][1] and "more" not in out[1][1]
    assert out[2] == (7.0, None)
    assert out[3] == (None, "relative error 1")
    assert a.calls == 5 and b.calls == 3  # interleaved; a failed runner is not timed again


def _leader(name: str, kind: str, ms: float | None) -> Leader:
    return Leader(name, kind, {}, ms, None if ms is None else 1.0 / ms)


def test_an_own_kernel_must_beat_the_fastest_extern_by_more_than_the_tie():
    gluon, attn = _leader("attn_fwd_gluon", "gluon", 1.00), _leader("attn_fwd", "triton", 1.05)
    cudnn, flash = _leader("sdpa_cudnn", "extern", 1.015), _leader("sdpa_flash", "extern", 1.3)
    failed = _leader("sdpa_efficient", "extern", None)
    # 1.5% ahead of cuDNN: inside the tie, cuDNN stays first, the rest keep their order
    got = prefer_extern_on_ties((gluon, cudnn, attn, flash, failed))
    assert [x.implementation for x in got] == ["sdpa_cudnn", "attn_fwd_gluon", "attn_fwd",
                                               "sdpa_flash", "sdpa_efficient"]
    r = OpResult(TINY, "fwd", "dev", got, (), ())
    assert r.winner is cudnn and r.runner_up is gluon and r.extern_margin == 1.0
    assert r.margin == pytest.approx(1.0 / 1.015)  # the runner-up was faster: below 1
    # ahead by more than the tie: the own kernel wins
    slower = _leader("sdpa_cudnn", "extern", 1.0 + EXTERN_TIE + 0.005)
    assert prefer_extern_on_ties((gluon, slower))[0] is gluon
    assert prefer_extern_on_ties((gluon, slower), tie=0.05)[0] is slower
    # an extern already first, or no extern timed: nothing moves
    assert prefer_extern_on_ties((cudnn, gluon)) == (cudnn, gluon)
    assert prefer_extern_on_ties((gluon, attn, failed)) == (gluon, attn, failed)
    assert prefer_extern_on_ties(()) == ()


@interpreter_only
def test_tune_op_stores_the_choice_and_attention_serves_it(tmp_path, monkeypatch):
    url = f"sqlite:///{tmp_path / 'op.db'}"
    results = tune_op([TINY], "fwd", TuneOptions(trials=2, interpret=True, seed=0),
                      db_url=url, progress=False, rounds=1, _device=DEV)
    (r,) = results
    ran = {x.implementation for x in r.leaders}
    assert ran == {"attn_fwd", "sdpa_math"}
    assert {name for name, _ in r.skipped} >= {"sdpa_cudnn", "attn_fwd_gluon"}
    win = r.winner
    assert win is not None and r.runner_up is not None
    assert r.margin == pytest.approx(r.runner_up.median_ms / win.median_ms)
    assert r.best_extern.implementation == "sdpa_math"
    with open_store(url) as store:
        (choice,) = store.list_choices(op="fwd")
    assert choice.implementation == win.implementation
    assert choice.problem_key == TINY.key()
    assert choice.runner_up == r.runner_up.implementation
    assert choice.extern == "sdpa_math"
    assert len(choice.candidates) == 2

    # the runtime serves the stored choice, exactly for this problem
    monkeypatch.setenv("FLASHTUNE_DB", url)
    flashtune.reload_configs()
    try:
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(1, 2, 48, 32, generator=g).half() for _ in range(3))
        got = flashtune.lookup_config(q, k, v)
        assert (got.source, got.template) == ("exact", win.implementation)
        ref = torch.softmax((q.float() @ k.float().transpose(-1, -2)) / 32 ** 0.5, -1) \
            @ v.float()
        out = flashtune.attention(q, k, v)
        assert (out.float() - ref).norm() / ref.norm() < 5e-3
        # a call asking for the LSE is never sent to the math backend, which has none
        with_lse = flashtune.lookup_config(q, k, v, return_lse=True)
        assert with_lse.template != "sdpa_math"
        out, lse = flashtune.attention(q, k, v, return_lse=True)
        assert lse.shape == (1, 2, 48)
    finally:
        monkeypatch.delenv("FLASHTUNE_DB")
        flashtune.reload_configs()


@interpreter_only
def test_a_forced_extern_runs_it_and_refuses_what_it_cannot_give():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 40, 32, generator=g).half() for _ in range(3))
    out = flashtune.attention(q, k, v, causal=True, impl="sdpa_math")
    ref = flashtune.attention(q, k, v, causal=True, impl="attn_fwd")
    assert (out.float() - ref.float()).norm() / ref.float().norm() < 5e-3
    with pytest.raises(InputError, match="impl 'sdpa_math' cannot serve .*LSE"):
        flashtune.attention(q, k, v, impl="sdpa_math", return_lse=True)
    with pytest.raises(InputError, match="impl 'sdpa_math' cannot serve .*causal"):
        flashtune.attention(q, k[:, :, :30], v[:, :, :30], causal=True, impl="sdpa_math")
    with pytest.raises(InputError, match="not an attention forward"):
        flashtune.attention(q, k, v, impl="attn_bwd")


@interpreter_only
def test_impl_narrows_the_search_not_the_choice(tmp_path):
    url = f"sqlite:///{tmp_path / 'n.db'}"
    opts = TuneOptions(trials=1, interpret=True, seed=0)
    tune_op([TINY], "fwd", opts, impls=["attn_fwd"], db_url=url, progress=False, rounds=1,
            _device=DEV)
    (r,) = tune_op([TINY], "fwd", opts, impls=["sdpa_math"], db_url=url, progress=False,
                   rounds=1, _device=DEV)
    assert {res.template for res in r.results} == {"sdpa_math"}  # only it was searched
    assert {x.implementation for x in r.leaders} == {"attn_fwd", "sdpa_math"}  # both timed
    with open_store(url) as store:
        (choice,) = store.list_choices(op="fwd")
    assert {c["implementation"] for c in choice.candidates} == {"attn_fwd", "sdpa_math"}


def test_impl_times_the_externs_beside_it_though_none_was_ever_searched(tmp_path):
    """A database seeded from exported files holds no search of the SDPA backends: with
    ``--impl`` they still take part, with no config (they have no knobs)."""
    url = f"sqlite:///{tmp_path / 'n.db'}"
    opts = TuneOptions(trials=1, interpret=True, seed=0)
    (r,) = tune_op([TINY], "fwd", opts, impls=["attn_fwd"], db_url=url, progress=False,
                   rounds=1, _device=DEV)
    assert {res.template for res in r.results} == {"attn_fwd"}
    assert {x.implementation for x in r.leaders} == {"attn_fwd", "sdpa_math"}
    assert r.best_extern is not None and r.best_extern.implementation == "sdpa_math"


class _Leading:
    """A GPU-timed leader that passes its check and times ``first`` for ``n_first`` calls,
    then ``then``."""

    interpreting = False
    flops = 1.0

    def __init__(self, first: float, then: float, n_first: int = 5):
        self.first, self.then, self.n_first, self.calls = first, then, n_first, 0
        self.reps: list[float] = []

    def evaluate(self, config):
        return TrialResult(TrialState.COMPLETE, median_ms=self.first)

    def time_config(self, config, rep_ms=100.0):
        self.calls += 1
        self.reps.append(rep_ms)
        t = self.first if self.calls <= self.n_first else self.then
        return t, t, t


@pytest.mark.parametrize("extern_first,extern_then,retimed,winner", [
    (1.01, 0.95, True, "sdpa_math"),   # 1% behind at first: timed again, the extern wins
    (0.97, 1.10, True, "attn_fwd"),    # 3% ahead at first: timed again, the own kernel wins
    (1.20, 0.50, False, "attn_fwd"),   # 20% behind: decided, not timed again
])
def test_a_close_call_between_own_kernel_and_extern_is_timed_again_with_more_rounds(
        extern_first, extern_then, retimed, winner):
    from flashtune.autotune import select
    from flashtune.kernel_templates import get_template

    own, ext = _Leading(1.0, 1.0), _Leading(extern_first, extern_then)
    fakes = {"attn_fwd": own, "sdpa_math": ext}
    candidates = [(get_template("attn_fwd"), {"BLOCK_M": 16}), (get_template("sdpa_math"), {})]
    leaders = select._side_by_side(candidates, TINY, DEV, TuneOptions(trials=1), 5,
                                   lambda spec, *a: fakes[spec.name])
    rounds = 5 + (5 * select.CLOSE_CALL_ROUNDS if retimed else 0)
    assert own.calls == ext.calls == rounds
    assert leaders[0].implementation == winner
    assert select._close_call(["triton", "extern"], [(1.0, None), (1.04, None)])
    assert not select._close_call(["triton", "extern"], [(1.0, None), (None, "failed")])
    assert not select._close_call(["triton", "gluon"], [(1.0, None), (1.01, None)])


def test_the_side_by_side_frees_its_leaders_and_torchs_cached_blocks_before_returning(
        monkeypatch):
    """The leaders' runners (their inputs, their checks' references) are dropped and torch's
    cached blocks given back before the next shape starts its candidate worker: on the
    H100 this process held 58 GiB after the GQA training shapes at 8k-16k tokens, and the
    next shape's worker could not build its inputs."""
    import gc
    import weakref

    import torch

    from flashtune.autotune import select
    from flashtune.kernel_templates import get_template

    built: list[weakref.ref] = []
    alive_at_empty: list[int] = []

    def factory(spec, *args):
        runner = _Leading(1.0 if spec.name == "attn_fwd" else 1.5, 1.0)
        built.append(weakref.ref(runner))
        return runner

    def empty_cache():
        gc.collect()
        alive_at_empty.append(sum(ref() is not None for ref in built))

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", empty_cache)
    candidates = [(get_template("attn_fwd"), {"BLOCK_M": 16}), (get_template("sdpa_math"), {})]
    leaders = select._side_by_side(candidates, TINY, DEV, TuneOptions(trials=1), 5, factory)
    assert [x.implementation for x in leaders] == ["attn_fwd", "sdpa_math"]
    assert len(built) == 2 and alive_at_empty == [0]


def _race_of_three(own: _Leading, extern: _Leading, other: _Leading) -> tuple[Leader, ...]:
    """``select._side_by_side`` of attn_fwd (``own``), the extern sdpa_math (``extern``) and
    attn_decode (``other``), each timed by its fake runner, five rounds."""
    from flashtune.autotune import select
    from flashtune.kernel_templates import get_template

    fakes = {"attn_fwd": own, "sdpa_math": extern, "attn_decode": other}
    candidates = [(get_template("attn_fwd"), {"BLOCK_M": 16}), (get_template("sdpa_math"), {}),
                  (get_template("attn_decode"), {})]
    return select._side_by_side(candidates, TINY, DEV, TuneOptions(trials=1), 5,
                                lambda spec, *a: fakes[spec.name])


def test_a_close_call_times_again_only_the_leaders_near_the_fastest():
    """The re-timing decides between the near-equal leaders; one 20% behind keeps its first
    timing (re-timing every leader was a third of a training shape's tuning time)."""
    from flashtune.autotune import select

    own, ext, behind = _Leading(1.0, 1.0), _Leading(1.03, 0.97), _Leading(1.2, 1.2)
    leaders = _race_of_three(own, ext, behind)
    again = 5 * select.CLOSE_CALL_ROUNDS
    assert (own.calls, ext.calls, behind.calls) == (5 + again, 5 + again, 5)
    # the close call's rounds split five rounds' measuring time: more samples, no more time
    assert own.reps[:5] == [100.0] * 5 and sum(own.reps[5:]) == pytest.approx(500.0)
    assert len(set(own.reps[5:])) == 1 and own.reps == ext.reps
    assert [(x.implementation, x.median_ms) for x in leaders] == [
        ("sdpa_math", 0.97), ("attn_fwd", 1.0), ("attn_decode", 1.2)]
    assert select._near_fastest([(1.0, None), (None, "failed"), (1.1, None), (1.11, None)]) \
        == [0, 2]


def test_a_candidate_far_behind_at_its_check_is_not_timed_in_the_rounds():
    """SDPA flash or the efficient kernel 1.5-3x behind cuDNN and the Gluon kernels: their
    check's timing stands, and the rounds time only the race that is open."""

    own, near, far = _Leading(1.0, 1.0), _Leading(1.25, 1.25), _Leading(2.0, 0.1)
    leaders = _race_of_three(own, far, near)
    assert (own.calls, near.calls, far.calls) == (5, 5, 0)
    assert [(x.implementation, x.median_ms) for x in leaders] == [
        ("attn_fwd", 1.0), ("attn_decode", 1.25), ("sdpa_math", 2.0)]


def test_a_leader_whose_runner_cannot_be_built_fails_and_the_others_race_on():
    """Building a leader's inputs can fail (a 26 GB decode cache ran an H200 out of memory):
    that leader is a failure with the reason and the shape is still decided."""
    from flashtune.autotune import select
    from flashtune.kernel_templates import get_template

    own = _Leading(1.0, 1.0)

    def factory(spec, *args):
        if spec.name == "sdpa_math":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 12.00 GiB.")
        return own

    candidates = [(get_template("attn_fwd"), {"BLOCK_M": 16}), (get_template("sdpa_math"), {})]
    leaders = select._side_by_side(candidates, TINY, DEV, TuneOptions(trials=1), 5, factory)
    assert [(x.implementation, x.median_ms) for x in leaders] == [("attn_fwd", 1.0),
                                                                  ("sdpa_math", None)]
    assert "out of memory" in leaders[1].message and "inputs" in leaders[1].message
    assert own.calls == 5


def test_the_leaders_of_a_shape_share_one_copy_of_its_inputs():
    """Every leader draws the same seeded inputs; side by side they hold one copy, not one
    each (six copies of a decode shape's cache did not fit an H200)."""
    from flashtune.autotune import select
    from flashtune.autotune.runners import LocalRunner
    from flashtune.kernel_templates import get_template

    built = []

    def factory(spec, problem, device, options):
        built.append(LocalRunner(spec, problem, device, seed=0))
        return built[-1]

    candidates = [(get_template("attn_fwd"), {"BLOCK_M": 16}), (get_template("sdpa_math"), {})]
    if DEVICE == "cpu":  # checked and timed under the interpreter
        select._side_by_side(candidates, TINY, DEV, TuneOptions(trials=1), 1, factory)
    else:  # pragma: no cover - the sharing itself needs no kernel to run
        built.extend(select._built_leader(s, TINY, DEV, TuneOptions(), factory)
                     for s, _ in candidates)
    a, b = (r.case.inputs for r in built)
    assert all(a[n] is b[n] for n in ("q", "k", "v"))
    # outside a side-by-side every runner draws its own (equal) tensors
    c = LocalRunner(get_template("attn_fwd"), TINY, DEV, seed=0).case.inputs
    assert c["k"] is not a["k"] and torch.equal(c["k"], a["k"])


@interpreter_only
def test_a_twin_of_a_searched_template_takes_its_best_without_a_search(tmp_path):
    """Two names of one kernel (the Gluon training pair's forward is attn_fwd_gluon): the
    second takes the first's best, stored under its own name too, and runs no trial."""
    from dataclasses import replace

    from flashtune.autotune.select import _twins
    from flashtune.kernel_templates import get_template, register_template, unregister_template

    attn = get_template("attn_fwd")
    register_template(replace(attn, name="attn_fwd_twin"))
    try:
        assert _twins("attn_fwd", "attn_fwd_twin") and not _twins("attn_fwd", "attn_fwd")
        assert not _twins("attn_fwd", "attn_decode")
        url = f"sqlite:///{tmp_path / 'twin.db'}"
        (r,) = tune_op([TINY], "fwd", TuneOptions(trials=2, interpret=True, seed=0),
                       impls=["attn_fwd", "attn_fwd_twin"], db_url=url, progress=False,
                       rounds=1, _device=DEV)
        first, twin = r.results
        assert (first.template, twin.template) == ("attn_fwd", "attn_fwd_twin")
        assert first.trials > 0 and twin.trials == 0
        assert twin.best_config == first.best_config is not None
        with open_store(url) as store:
            bests = {b.template.name: b for b in store.list_best()}
            assert bests["attn_fwd_twin"].config == first.best_config
            assert not store.list_trials(template_id=store.ensure_template(
                "attn_fwd_twin", attn.source_hash).id)
    finally:
        unregister_template("attn_fwd_twin")

"""Measurement errors: a time that is not positive or beats the hardware is re-measured
once, then recorded as a failure; the winner is the one confirmed by interleaved re-timing."""

from __future__ import annotations

import math

import pytest

from flashtune.autotune import timing
from flashtune.autotune.jobs import tune
from flashtune.autotune.options import TuneOptions
from flashtune.autotune.runners import LocalRunner, TrialResult, time_interleaved
from flashtune.autotune.timing import MeasurementError, physical_floor_ms
from flashtune.core.device import interpreter_device
from flashtune.core.problem import AttentionProblem
from flashtune.core.space import SearchSpace
from flashtune.db import TrialState, canonical_json, open_store
from flashtune.kernel_templates import get_template
from tests.autotune_tests.synthetic import H100

PROBLEM = AttentionProblem(1, 2, 2, 64, 48, 32, True, "fp16")
CFG = {"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 2, "num_stages": 1}


def exact(q, k, v, config, *, causal):
    """A 'kernel' that returns the reference: every config is numerically right."""
    out, _ = get_template("attn_fwd").reference(q, k, v, causal=causal)
    return out.to(q.dtype)


class FakeTimer(LocalRunner):
    """LocalRunner on a fake H100 whose measurements come from ``script`` (per config key,
    or one list for all), as a GPU runner (interleaved re-timing on)."""

    def __init__(self, script):
        super().__init__(get_template("attn_fwd"), PROBLEM, H100, launcher=exact)
        self.interpreting = False
        self.script = script
        self.calls = 0
        self.reps: list[float] = []

    def _measure(self, rep_ms=100.0):
        self.calls += 1
        self.reps.append(rep_ms)
        seq = self.script if isinstance(self.script, list) else \
            self.script[canonical_json(self._config)]
        ms = seq.pop(0) if len(seq) > 1 else seq[0]
        return ms, ms, ms


def test_the_physical_floor():
    assert physical_floor_ms(H100, 989.4e9) == pytest.approx(1.0)  # 1 ms at 989 TFLOP/s
    assert physical_floor_ms(H100, 0, 3.9e9) == pytest.approx(1.0)  # 1 ms at 3.9 TB/s
    assert physical_floor_ms(interpreter_device(), 1e15, 1e12) == 0.0
    unknown = type(H100)(name="Some_Future_GPU", compute_capability="12.0", sm_count=1,
                         shared_mem_per_block=1, total_memory=1)
    assert physical_floor_ms(unknown, 10e12) == pytest.approx(1.0)  # at 10 PFLOP/s
    runner = FakeTimer([1.0])
    # the tiny problem: its FLOPs on 989 TFLOP/s vs q, k, v and o over 3.9 TB/s
    io = 2 * (2 * 2 * 64 * 32 + 2 * 2 * 48 * 32)
    assert runner.floor_ms == pytest.approx(max(PROBLEM.flops() / 989.4e12,
                                                io / 3.9e12) * 1e3)


def test_a_window_s_floor_counts_only_the_keys_some_query_sees():
    """A decode step under a 4096 window reads 4096 keys of a 32k cache: its floor counts
    those (all of them put every H200 decode trial of Mistral's window below the floor),
    while a prefill's windows together reach every key."""
    from dataclasses import replace

    from flashtune.core.case import least_bytes
    from flashtune.core.problem import visible_keys

    assert visible_keys(1, 32768, 4095, 0) == 4096
    assert visible_keys(16, 100, 9, 0) == 25 and visible_keys(16, 100, -1, 0) == 100
    assert visible_keys(4, 100, 2, 3) == 6  # not causal: no key lies past the last query's
    assert visible_keys(100, 50, 0, 3) == 50 and visible_keys(100, 50, 0, 0) == 50
    assert visible_keys(8, 4, 1, 0) == 4  # queries before the first key see none of it
    step = AttentionProblem(2, 4, 2, 1, 64, 16, True, "fp16", window_left=15)
    assert step.keys_read() == 16 / 64
    assert replace(step, seqlen_q=64).keys_read() == 1.0  # a prefill reads every key
    assert replace(step, window_left=-1).keys_read() == 1.0
    packed = replace(step, batch=2, seqlen_q=40, seqlen_k=40, tokens_q=48, tokens_k=48)
    lens_q, lens_k = packed.packed_lengths()
    assert packed.keys_read() == pytest.approx(
        sum(visible_keys(a, b, 15, 0) for a, b in zip(lens_q, lens_k, strict=True)) / 48)
    import torch

    q, k, v = (torch.empty(2, h, n, 16, dtype=torch.float16) for h, n in
               ((4, 1), (2, 64), (2, 64)))
    assert least_bytes(step, q, k, v) == 2 * q.nbytes + (k.nbytes + v.nbytes) * 16 / 64
    runner = LocalRunner(get_template("attn_decode"), step, H100, launcher=exact)
    assert runner.floor_ms == pytest.approx(least_bytes(step, q, k, v) / 3.9e12 * 1e3)


@pytest.mark.parametrize("first,second,state,message", [
    (0.0, 0.02, TrialState.COMPLETE, None),
    (-1.0, 0.02, TrialState.COMPLETE, None),
    (float("nan"), 0.02, TrialState.COMPLETE, None),
    (1e-9, 0.02, TrialState.COMPLETE, None),
    (0.0, -1.0, TrialState.RUNTIME_ERROR,
     r"^MeasurementError: a median of -1\.0 ms is not a positive time \(first measurement: "
     r"a median of 0\.0 ms\); re-measured once$"),
    (1e-9, 2e-9, TrialState.RUNTIME_ERROR,
     r"^MeasurementError: a median of 2e-09 ms is below the physical floor of .* ms \(FLOPs "
     r"over peak, bytes over bandwidth\)"),
    (float("inf"), float("inf"), TrialState.RUNTIME_ERROR, "inf ms is not a positive time"),
])
def test_impossible_times_are_re_measured_then_rejected(first, second, state, message):
    runner = FakeTimer([first, second])
    res = runner.evaluate(CFG)
    assert res.state is state and runner.calls == 2
    if state is TrialState.COMPLETE:
        assert res.median_ms == 0.02 and res.tflops == pytest.approx(PROBLEM.flops() / 2e-5 / 1e12)
    else:
        assert res.median_ms is None and res.message is not None
        assert __import__("re").search(message, res.message), res.message


def test_a_good_time_is_measured_once():
    runner = FakeTimer([0.5])
    assert runner.evaluate(CFG).median_ms == 0.5 and runner.calls == 1


def test_interleaved_re_timing_rejects_impossible_times():
    a, b = CFG, {**CFG, "BLOCK_M": 32}
    runner = FakeTimer({canonical_json(a): [2.0], canonical_json(b): [0.0]})
    got = time_interleaved(runner, [a, b], rounds=3)
    assert got[canonical_json(a)].state is TrialState.COMPLETE
    assert got[canonical_json(a)].median_ms == 2.0
    bad = got[canonical_json(b)]
    assert bad.state is TrialState.RUNTIME_ERROR and "MeasurementError" in bad.message


class Retimed:
    """Search timings say A (BLOCK_M 16) is fastest and C (64) even faster, but the
    interleaved re-timing finds A slower than B and cannot measure C at all."""

    interpreting = False
    flops = PROBLEM.flops()
    SEARCH = {16: 1.0, 32: 2.0, 64: 0.5}
    RETIME = {16: 3.0, 32: 2.0}

    def evaluate(self, config):
        ms = self.SEARCH[config["BLOCK_M"]]
        return TrialResult(TrialState.COMPLETE, None, ms, ms, ms, None, 0.0)

    def time_config(self, config, rep_ms=100.0):
        if config["BLOCK_M"] not in self.RETIME:
            raise MeasurementError("a median of 0 ms is not a positive time; re-measured once")
        ms = self.RETIME[config["BLOCK_M"]]
        return ms, ms, ms


def test_the_best_is_the_confirmed_fastest(tmp_path):
    space = SearchSpace(params={"BLOCK_M": (16, 32, 64), "BLOCK_N": (16,), "num_warps": (2,),
                                "num_stages": (1,)}, predicate=lambda c, p, d: None)
    url = f"sqlite:///{tmp_path / 'ft.db'}"
    options = TuneOptions(trials=3, sampler="grid", seed=0, top_k_confirm=3, isolate=False)
    [res] = tune([PROBLEM], options, db_url=url, progress=False,
                 _runner_factory=lambda *a: Retimed(), _device=H100, _space=space)
    assert res.best_config["BLOCK_M"] == 32 and res.best_ms == 2.0
    with open_store(url) as store:
        [best] = store.list_best()
        trial = next(t for t in store.list_trials() if t.id == best.trial_id)
    assert trial.config["BLOCK_M"] == 32 and best.median_ms == 2.0
    assert math.isclose(trial.median_ms, 2.0)


def test_floor_constants_cover_anchors():
    # ANCHORS.md: H100 datasheet 989 TFLOP/s dense, 3.35 TB/s; the floor may not exceed them
    flops, bw = timing.device_peaks(H100)
    assert flops >= 989e12 and bw >= 3.35e12


@pytest.mark.parametrize("rounds,rep", [(1, 100.0), (3, 100.0), (5, 100.0), (10, 50.0),
                                        (15, 500 / 15), (100, 20.0)])
def test_more_rounds_split_five_rounds_measuring_time(rounds, rep):
    """A pair's rounds measure it for five rounds of bench's 100 ms in all: a close call's
    15 rounds take a third of that each (more samples of the drift between rounds, not three
    times the GPU time), never under 20 ms a round."""
    from flashtune.autotune.runners import round_rep_ms

    assert round_rep_ms(rounds) == pytest.approx(rep)
    runner = FakeTimer([1.0])
    time_interleaved(runner, [CFG], rounds=rounds)
    assert runner.reps == [pytest.approx(rep)] * rounds


def test_bench_queued_times_fewer_runs_for_a_shorter_measuring_time():
    from flashtune.autotune.timing import MIN_QUEUED_REPS, QUEUED_REPS, REP_MS, queued_reps

    assert queued_reps(REP_MS) == QUEUED_REPS == 100
    assert queued_reps(REP_MS / 3) == 33
    assert queued_reps(1.0) == MIN_QUEUED_REPS == 20
    assert queued_reps(10 * REP_MS) == QUEUED_REPS


def test_host_bound_medians_are_re_timed():
    """A median under SHORT_KERNEL_MS, or one whose host time per call is half of it or
    more, may hold launch gaps (timing.bench re-times it queued); a long kernel behind a
    cheap launch does not."""
    from flashtune.autotune.timing import HOST_BOUND_SHARE, SHORT_KERNEL_MS, host_bound

    assert host_bound(SHORT_KERNEL_MS / 2, 0.0)
    assert host_bound(1.2, 1.2 * HOST_BOUND_SHARE)
    assert host_bound(1.2, 1.5)
    assert not host_bound(1.2, 0.05)
    assert not host_bound(30.0, 0.2)


def test_settling_runs_the_call_back_to_back_for_its_time_waiting_every_2_ms():
    now = [0.0]
    log: list[str] = []

    def call():  # each call: 0.5 ms of GPU work, seen at the next wait
        log.append("call")
        now[0] += 0.0005

    def sync():
        log.append("sync")

    calls = timing.settle(call, 10.0, sync=sync, clock=lambda: now[0])
    # the first call alone sizes the rest: 4 calls (2 ms of work) between two waits
    assert log[:2] == ["call", "sync"] and log[2:7] == ["call"] * 4 + ["sync"]
    assert calls == 1 + 4 * 5 and math.isclose(now[0], 0.0105)
    assert timing.settle(call, 0.0, sync=sync, clock=lambda: now[0]) == 0


def test_a_runner_settles_each_timing_window_as_its_options_say(monkeypatch):
    seen = []

    def fake_bench(fn, *, rep_ms, settle_ms):
        seen.append((rep_ms, settle_ms))
        return timing.Timing(1.0, 0.9, 1.1)

    monkeypatch.setattr(timing, "bench", fake_bench)
    runner = LocalRunner(get_template("attn_fwd"), PROBLEM, H100, launcher=exact, settle_ms=250)
    runner.interpreting = False
    runner._config = dict(CFG)
    assert runner._measure(40.0) == (1.0, 0.9, 1.1)
    assert seen == [(40.0, 250)]


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf"), True, "200", 20_000])
def test_settle_ms_must_be_a_number_of_milliseconds(bad):
    from flashtune.core.errors import InputError

    with pytest.raises(InputError, match="settle_ms"):
        TuneOptions(settle_ms=bad)
    assert TuneOptions(settle_ms=200).settle_ms == 200

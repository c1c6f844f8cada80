"""Store contract, part 2: trials (numbers, states, resume, stale) and best configs.

Every test taking ``store`` runs on every backend (see conftest.py).
"""

from __future__ import annotations

import math
from datetime import timedelta, timezone

import pytest
from sqlalchemy import Engine, event

from flashtune.db import BestConfigRecord, TrialState
from flashtune.db.jsonutil import config_hash
from flashtune.db.store import TuningStore
from tests.db_tests.support import A100, BUCKET, KEY, Study, make_study

FINAL_STATES = [s for s in TrialState if s is not TrialState.RUNNING]
CFG = {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3}


def test_start_trial_numbers_count_within_the_study(store: TuningStore, study: Study) -> None:
    second_run = store.create_run(*study.ids, study_name="s", sampler="random")
    numbers = []
    for i in range(6):
        run = study.run if i % 2 else second_run
        trial = store.start_trial(run.id, {"BLOCK_M": 16 << i})
        assert trial.state is TrialState.RUNNING and trial.finished_at is None
        assert (trial.device_id, trial.template_id, trial.problem_id) == study.ids
        assert trial.run_id == run.id
        numbers.append(trial.number)
    assert numbers == list(range(6))
    other = make_study(store, device=A100)  # another study counts from 0
    assert store.start_trial(other.run.id, CFG).number == 0


@pytest.mark.parametrize("state", FINAL_STATES, ids=str)
def test_every_final_state_round_trips(store: TuningStore, study: Study,
                                       state: TrialState) -> None:
    started = store.start_trial(study.run.id, CFG)
    assert started.config == CFG and started.config_hash == config_hash(CFG)
    timings = (dict(median_ms=1.25, p20_ms=1.2, p80_ms=1.31, tflops=371.5, compile_s=3.5)
               if state is TrialState.COMPLETE else {})
    message = None if state is TrialState.COMPLETE else f"{state.value.lower()}: details"
    finished = store.finish_trial(started.id, state.value, message=message, **timings)
    [listed] = store.list_trials(run_id=study.run.id)
    assert listed == finished
    assert listed.state is state and listed.message == message
    assert {k: getattr(listed, k) for k in timings} == timings
    assert listed.started_at == started.started_at
    assert listed.finished_at is not None and listed.finished_at >= listed.started_at
    assert listed.finished_at.tzinfo == timezone.utc


def test_finish_trial_validates_before_writing(store: TuningStore, study: Study) -> None:
    trial = store.start_trial(study.run.id, CFG)
    with pytest.raises(ValueError):
        store.finish_trial(trial.id, TrialState.RUNNING)
    with pytest.raises(ValueError):
        store.finish_trial(trial.id, "FINISHED")
    with pytest.raises(ValueError, match="median_ms"):
        store.finish_trial(trial.id, TrialState.COMPLETE, median_ms=math.nan)
    assert store.list_trials() == [trial]


def test_record_trial_starts_and_finishes_in_one_go(store: TuningStore, study: Study) -> None:
    first = store.start_trial(study.run.id, CFG)
    pruned = store.record_trial(study.run.id, {"BLOCK_M": 256}, TrialState.PRUNED_STATIC,
                                message="needs 294912 bytes of shared memory")
    assert pruned.number == first.number + 1
    assert pruned.state is TrialState.PRUNED_STATIC and pruned.finished_at is not None
    assert store.list_trials(state="PRUNED_STATIC") == [pruned]


def test_find_trial_returns_the_latest_finished_trial(store: TuningStore, study: Study) -> None:
    ids = study.ids
    assert store.find_trial(*ids, CFG) is None
    running = store.start_trial(study.run.id, CFG)
    assert store.find_trial(*ids, CFG) is None  # still running: not a result
    store.finish_trial(running.id, TrialState.TIMEOUT, message="timed out after 60 s")
    retried = store.record_trial(study.run.id, CFG, TrialState.COMPLETE, median_ms=1.5)
    store.record_trial(study.run.id, CFG, TrialState.DUPLICATE)  # skipped: not a result
    reordered = dict(reversed(list(CFG.items())))
    assert store.find_trial(*ids, reordered) == retried
    assert store.find_trial(*ids, {**CFG, "num_warps": 4}) is None
    other = make_study(store, device=A100)
    assert store.find_trial(*other.ids, CFG) is None


def test_list_trials_filters(store: TuningStore, study: Study) -> None:
    other = make_study(store, device=A100)
    a = store.record_trial(study.run.id, CFG, TrialState.COMPLETE, median_ms=1.0)
    b = store.start_trial(study.run.id, {"BLOCK_M": 64})
    c = store.record_trial(other.run.id, CFG, TrialState.COMPILE_ERROR, message="boom")
    assert store.list_trials() == [a, b, c]
    assert store.list_trials(device_id=study.device.id) == [a, b]
    assert store.list_trials(run_id=other.run.id) == [c]
    assert store.list_trials(template_id=study.template.id, state=TrialState.RUNNING) == [b]
    assert store.list_trials(problem_id=study.problem.id, device_id=other.device.id,
                             state="COMPLETE") == []


def test_fail_stale_trials_spares_the_callers_run(store: TuningStore, study: Study) -> None:
    dead = study.run
    mine = store.create_run(*study.ids, study_name="s", sampler="tpe")
    lost1 = store.start_trial(dead.id, CFG)
    lost2 = store.start_trial(dead.id, {"BLOCK_M": 64})
    done = store.record_trial(dead.id, {"BLOCK_M": 32}, TrialState.COMPLETE, median_ms=2.0)
    live = store.start_trial(mine.id, {"BLOCK_M": 16})
    other = make_study(store, device=A100)
    elsewhere = store.start_trial(other.run.id, CFG)

    assert store.fail_stale_trials(*study.ids, current_run_id=mine.id,
                                   older_than=timedelta(hours=1)) == 0  # all fresh
    assert store.fail_stale_trials(*study.ids, current_run_id=mine.id) == 2
    by_id = {t.id: t for t in store.list_trials()}
    for lost in (lost1, lost2):
        assert by_id[lost.id].state is TrialState.RUNTIME_ERROR
        assert by_id[lost.id].message == "stale: job died"
        assert by_id[lost.id].finished_at is not None
    assert by_id[done.id] == done
    assert by_id[live.id].state is TrialState.RUNNING
    assert by_id[elsewhere.id].state is TrialState.RUNNING
    assert store.fail_stale_trials(*study.ids, current_run_id=mine.id) == 0
    # a worker that was alive after all may still report its result
    late = store.finish_trial(lost1.id, TrialState.COMPLETE, median_ms=1.1)
    assert late.state is TrialState.COMPLETE and late.message is None


def offer(store: TuningStore, study: Study, config: dict, ms: float, **kw: object) -> bool:
    return store.offer_best(*study.ids, config=config, median_ms=ms,
                            tflops=kw.get("tflops", 100.0),  # type: ignore[arg-type]
                            trial_id=kw.get("trial_id"),  # type: ignore[arg-type]
                            trials_count=kw.get("trials_count", 1))  # type: ignore[arg-type]


def test_offer_best_keeps_the_faster(store: TuningStore, study: Study) -> None:
    assert store.get_best(*study.ids) is None
    t1 = store.record_trial(study.run.id, CFG, TrialState.COMPLETE, median_ms=1.5)
    assert offer(store, study, CFG, 1.5, trial_id=t1.id, trials_count=1, tflops=350.0)
    first = store.get_best(*study.ids)
    assert isinstance(first, BestConfigRecord)
    assert (first.config, first.median_ms, first.tflops, first.trial_id, first.trials_count) \
        == (CFG, 1.5, 350.0, t1.id, 1)
    assert (first.device, first.template, first.problem) == \
        (study.device, study.template, study.problem)
    assert first.tuned_at.tzinfo == timezone.utc

    slower = {**CFG, "num_warps": 4}
    assert not offer(store, study, slower, 1.6, trials_count=7)
    assert not offer(store, study, slower, 1.5, trials_count=7)  # equal is not faster
    assert store.get_best(*study.ids) == first  # nothing changed

    t2 = store.record_trial(study.run.id, slower, TrialState.COMPLETE, median_ms=1.4)
    assert offer(store, study, slower, 1.4, trial_id=t2.id, trials_count=9, tflops=None)
    best = store.get_best(*study.ids)
    assert best is not None and best.id == first.id
    assert (best.config, best.median_ms, best.tflops, best.trial_id, best.trials_count) \
        == (slower, 1.4, None, t2.id, 9)
    assert best.tuned_at >= first.tuned_at


@pytest.mark.parametrize("bad", [0.0, -1.0, math.nan, math.inf])
def test_offer_best_rejects_impossible_timings(store: TuningStore, study: Study,
                                              bad: float) -> None:
    with pytest.raises(ValueError, match="median_ms"):
        offer(store, study, CFG, bad)
    assert store.get_best(*study.ids) is None


def test_list_best_joins_in_one_query(store: TuningStore) -> None:
    h100 = make_study(store)
    h100_small = make_study(store, key={**KEY, "seqlen_q": 77, "seqlen_k": 133},
                            bucket="fp16-d128-causal-hq32-hkv8-b4-nq128-nk256")
    a100 = make_study(store, device=A100)
    bwd = make_study(store, template="attn_bwd")
    for i, s in enumerate((h100, h100_small, a100, bwd)):
        offer(store, s, {"BLOCK_M": 64, "i": i}, 1.0 + i)

    statements: list[str] = []

    def count(conn: object, cursor: object, statement: str, *args: object) -> None:
        if "ft_best_configs" in statement:
            statements.append(statement)

    event.listen(Engine, "before_cursor_execute", count)
    try:
        everything = store.list_best()
    finally:
        event.remove(Engine, "before_cursor_execute", count)
    assert len(statements) == 1  # devices, templates and problems come joined, not N+1
    assert [(b.device.name, b.template.name, b.problem.bucket) for b in everything] == [
        (A100.name, "attn_fwd", BUCKET),
        ("NVIDIA_H100_80GB_HBM3", "attn_bwd", BUCKET),
        ("NVIDIA_H100_80GB_HBM3", "attn_fwd", "fp16-d128-causal-hq32-hkv8-b4-nq128-nk256"),
        ("NVIDIA_H100_80GB_HBM3", "attn_fwd", BUCKET),  # buckets sort as text
    ]
    assert everything[2].problem.key["seqlen_q"] == 77
    assert [b.config["i"] for b in store.list_best(device_name="NVIDIA_H100_80GB_HBM3",
                                                   template_name="attn_fwd")] == [1, 0]
    assert store.list_best(source_hash="5f0c2a9e41d7b3c8") == everything
    assert store.list_best(source_hash="0000") == []
    assert store.get_best(*a100.ids) == everything[0]

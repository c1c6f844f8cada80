"""Finishing ``tune --op`` over several commands (flashtune.autotune.resume, tune_op's
``skip_tuned`` and ``deadline``): a current stored choice is skipped, a stale one made again,
an implementation's finished search reused, and no shape is started after the deadline.
Runs under the interpreter with made-up timings (tests/autotune_tests/op_runners.py)."""

from __future__ import annotations

import time

from flashtune.autotune.jobs import tune
from flashtune.autotune.options import TuneOptions
from flashtune.autotune.resume import finished_search, stored_choice
from flashtune.autotune.select import applicable, tune_op
from flashtune.core.device import interpreter_device
from flashtune.core.problem import AttentionProblem
from flashtune.db import open_store
from tests.autotune_tests.op_runners import synthetic_runner

TINY = AttentionProblem(1, 2, 2, 48, 48, 32, False, "fp16")
OTHER = AttentionProblem(1, 2, 2, 40, 40, 16, True, "fp16")
TINY2 = AttentionProblem(1, 2, 2, 32, 32, 16, False, "fp16")
DEV = interpreter_device()
OPTS = TuneOptions(trials=1, interpret=True, seed=0, top_k_confirm=1)


def _tune(url, problems, **kw):
    return tune_op(problems, "fwd", OPTS, db_url=url, progress=False, rounds=1,
                   _runner_factory=synthetic_runner, _device=DEV, **kw)


def _state(url, problem):
    with open_store(url) as store:
        return stored_choice(store, "fwd", problem, DEV, applicable("fwd", problem, DEV)[0])


def _restamp(url, problem, name, source_hash):
    """Store the problem's choice again as if ``name`` had been timed at ``source_hash``."""
    with open_store(url) as store:
        (c,) = [c for c in store.list_choices(op="fwd") if c.problem_key == problem.key()]
        candidates = [dict(x, source_hash=source_hash) if x["implementation"] == name else x
                      for x in c.candidates]
        store.put_choice(c.device.id, "fwd", c.problem_key, implementation=c.implementation,
                         source_hash=c.source_hash, config=c.config, median_ms=c.median_ms,
                         tflops=c.tflops, runner_up=c.runner_up, runner_up_ms=c.runner_up_ms,
                         extern=c.extern, extern_ms=c.extern_ms, candidates=candidates)


def test_a_current_choice_is_skipped_and_rebuilt_from_the_store(tmp_path):
    url = f"sqlite:///{tmp_path / 'r.db'}"
    assert _state(url, TINY).choice is None
    (first,) = _tune(url, [TINY])
    assert not first.reused and first.stale is None
    assert _state(url, TINY).current
    with open_store(url) as store:
        (choice,) = store.list_choices(op="fwd")
    specs = {s.name: s for s in applicable("fwd", TINY, DEV)[0]}
    assert {c["implementation"]: c["source_hash"] for c in choice.candidates} \
        == {name: s.source_hash for name, s in specs.items()}

    (again,) = _tune(url, [TINY], skip_tuned=True)
    assert again.reused and again.results == () and again.skipped == ()
    assert [x.implementation for x in again.leaders] == [x.implementation
                                                         for x in first.leaders]
    assert again.winner.median_ms == first.winner.median_ms
    assert again.margin == first.margin
    with open_store(url) as store:
        (same,) = store.list_choices(op="fwd")
    assert same.decided_at == choice.decided_at  # not decided again

    (without,) = _tune(url, [TINY])  # without skip_tuned: tuned again
    assert not without.reused and without.results


def test_a_stale_choice_is_made_again_reusing_the_searches_that_are_current(tmp_path):
    url = f"sqlite:///{tmp_path / 's.db'}"
    _tune(url, [TINY])
    _restamp(url, TINY, "attn_fwd", "0" * 16)
    state = _state(url, TINY)
    assert not state.current and "attn_fwd's source changed (0000000000000000 ->" in state.stale

    (r,) = _tune(url, [TINY], skip_tuned=True)
    assert not r.reused and "attn_fwd's source changed" in r.stale
    # both searches finished at the current sources: only the side-by-side ran again
    assert r.results == () and {x.implementation for x in r.leaders} == {"attn_fwd",
                                                                          "sdpa_math"}
    assert _state(url, TINY).current

    _restamp(url, TINY, "sdpa_math", None)  # a choice from before hashes were recorded
    assert "does not record" in _state(url, TINY).stale


def test_a_shape_killed_half_way_searches_only_what_it_had_not_finished(tmp_path):
    url = f"sqlite:///{tmp_path / 'k.db'}"
    # the attn_fwd search finished and the command died before the choice was stored
    tune([TINY], OPTS, db_url=url, progress=False, _runner_factory=synthetic_runner,
         _device=DEV)
    with open_store(url) as store:
        assert finished_search(store, "attn_fwd", TINY, DEV)[0]
        assert finished_search(store, "sdpa_math", TINY, DEV) == (False, None)
        assert _state(url, TINY).choice is None
    (r,) = _tune(url, [TINY], skip_tuned=True)
    assert [res.template for res in r.results] == ["sdpa_math"]
    assert {x.implementation for x in r.leaders} == {"attn_fwd", "sdpa_math"}


def test_no_shape_is_started_after_the_deadline_once_one_was_tuned(tmp_path):
    url = f"sqlite:///{tmp_path / 'd.db'}"
    past = time.time() - 1
    # every call makes progress: the first shape is tuned however late it is
    assert [r.problem for r in _tune(url, [TINY, OTHER], deadline=past)] == [TINY]
    # a shape skipped as tuned is not progress: the next one is still tuned
    done = _tune(url, [TINY, OTHER, TINY2], deadline=past, skip_tuned=True)
    assert [(r.problem, r.reused) for r in done] == [(TINY, True), (OTHER, False)]
    assert [r.problem for r in _tune(url, [TINY2], deadline=time.time() + 600)] == [TINY2]


def test_no_shape_is_started_that_the_longest_so_far_would_carry_past_the_deadline(
        tmp_path, monkeypatch):
    """A deadline in the future still stops the next shape when the longest shape tuned so
    far would end past it (a device command's hard limit is the real constraint)."""
    from flashtune.autotune import select

    url = f"sqlite:///{tmp_path / 'l.db'}"
    clock = [1000.0]
    monkeypatch.setattr(select.time, "time", lambda: clock[0])

    def slow_runner(spec, problem, device, options):  # every evaluation: 10 s of "time"
        runner = synthetic_runner(spec, problem, device, options)
        evaluate = runner.evaluate

        def timed(config):
            clock[0] += 10.0
            return evaluate(config)
        runner.evaluate = timed
        return runner

    done = tune_op([TINY, OTHER, TINY2], "fwd", OPTS, db_url=url, progress=False, rounds=1,
                   _runner_factory=slow_runner, _device=DEV, deadline=clock[0] + 10_000)
    assert len(done) == 3  # far away: every shape
    first = clock[0] - 1000.0  # what three shapes took, > 0
    assert first > 0
    # a deadline one shape away from now: the first shape runs, the second would not end
    done = tune_op([TINY, OTHER], "fwd", OPTS, db_url=f"sqlite:///{tmp_path / 'm.db'}",
                   progress=False, rounds=1, _runner_factory=slow_runner, _device=DEV,
                   deadline=clock[0] + first / 3 * 1.5)
    assert [r.problem for r in done] == [TINY]
    assert not select.past_deadline(None, 1e9)
    assert select.past_deadline(clock[0] + 5, 5.0) and not select.past_deadline(clock[0] + 5, 4)


def test_a_training_step_choice_is_skipped_when_current(tmp_path):
    url = f"sqlite:///{tmp_path / 't.db'}"
    problem = AttentionProblem(1, 2, 2, 32, 32, 16, False, "fp16")
    opts = dict(db_url=url, progress=False, rounds=1, _runner_factory=synthetic_runner,
                _device=DEV)
    (first,) = tune_op([problem], "train", OPTS, **opts)
    assert {r.template for r in first.results} == {"attn_fwd", "attn_bwd"}
    (again,) = tune_op([problem], "train", OPTS, skip_tuned=True, **opts)
    assert again.reused and again.winner.implementation == first.winner.implementation


def test_a_narrowed_run_s_choice_is_current_for_the_same_narrowed_run(tmp_path):
    """``--impl`` narrows what a run can time to the named implementations and the others'
    stored bests: its choice is current for a run narrowed the same way (it used to be
    stale for want of an implementation the run could never time, so ``--skip-tuned`` made
    it again at every command), and stale for a run across all."""
    url = f"sqlite:///{tmp_path / 'n.db'}"
    (first,) = _tune(url, [TINY], impls=["sdpa_math"], skip_tuned=True)
    assert not first.reused and [x.implementation for x in first.leaders] == ["sdpa_math"]
    (again,) = _tune(url, [TINY], impls=["sdpa_math"], skip_tuned=True)
    assert again.reused and again.results == ()
    # attn_fwd has no stored best: a run across all would time it
    assert "attn_fwd was not timed in it" in _state(url, TINY).stale
    (full,) = _tune(url, [TINY], skip_tuned=True)
    assert not full.reused and {x.implementation for x in full.leaders} == {"attn_fwd",
                                                                            "sdpa_math"}
    # now attn_fwd has a stored best: the narrowed run times it too, so the choice is
    # current for it as well
    (narrow,) = _tune(url, [TINY], impls=["sdpa_math"], skip_tuned=True)
    assert narrow.reused

"""Strategies through the whole job loop, with recorded (synthetic) results: no GPU."""

from __future__ import annotations

import pytest

from flashtune.autotune.jobs import tune
from flashtune.autotune.options import TuneOptions
from flashtune.autotune.runners import ReplayRunner
from flashtune.autotune.strategies import config_from_trial, enqueue, make_sampler
from flashtune.kernel_templates.attn_fwd.space import SPACE as FULL_SPACE
from tests.autotune_tests.synthetic import FIXTURE, H100, PROBLEM
from tests.autotune_tests.synthetic import RECORDED_SPACE as SPACE


def _replay_tune(tmp_path, name, **opts):
    runners = []

    def factory(spec, problem, device, options):
        runners.append(ReplayRunner.from_json(FIXTURE))
        return runners[-1]

    url = "sqlite://"  # in memory: flashtune store and Optuna InMemoryStorage
    options = TuneOptions(**{"top_k_confirm": 3, **opts})
    [res] = tune([PROBLEM], options, db_url=url, progress=False, _runner_factory=factory,
                 _device=H100, _space=SPACE)
    return res, runners[0], url


def _optimum_ms():
    runner = ReplayRunner.from_json(FIXTURE)
    return min(r.median_ms for r in runner.records.values() if r.ok)


def test_fixture_is_marked_synthetic():
    runner = ReplayRunner.from_json(FIXTURE)
    assert runner.meta["synthetic"] is True
    assert runner.evaluate({"BLOCK_M": 1, "BLOCK_N": 1, "num_warps": 1,
                            "num_stages": 1}).message == "not in recording"


def test_seeded_tpe_is_reproducible(tmp_path):
    a, ra, _ = _replay_tune(tmp_path, "a.db", sampler="tpe", seed=7, trials=15)
    b, rb, _ = _replay_tune(tmp_path, "b.db", sampler="tpe", seed=7, trials=15)
    assert ra.calls == rb.calls
    assert a.best_config == b.best_config and a.trials == b.trials == 15


def test_grid_visits_every_valid_config(tmp_path):
    res, runner, url = _replay_tune(tmp_path, "g.db", sampler="grid", seed=0, trials=10_000,
                                  top_k_confirm=1)
    valid = SPACE.valid_configs(PROBLEM, H100)
    visited = runner.calls[:len(valid)]
    confirm = runner.calls[len(valid):]  # the winner re-timed against the default
    assert len(confirm) == 2 and res.default_config in confirm
    assert len({str(sorted(c.items())) for c in visited}) == len(valid)  # each once
    assert sorted(map(sorted, (c.items() for c in visited))) == \
        sorted(map(sorted, (c.items() for c in valid)))
    assert res.states["PRUNED_STATIC"] == SPACE.size - len(valid)
    assert res.best_ms == pytest.approx(_optimum_ms())


def test_tpe_beats_grid_budget(tmp_path):
    valid = SPACE.valid_configs(PROBLEM, H100)
    res, runner, _ = _replay_tune(tmp_path, "t.db", sampler="tpe", seed=0, trials=80)
    assert res.trials <= 80 < len(valid)
    assert res.best_ms <= 1.02 * _optimum_ms()
    assert res.speedup is not None and res.speedup > 1.0


def test_patience_stops_early(tmp_path):
    res, _, _ = _replay_tune(tmp_path, "p.db", sampler="random", seed=0, trials=200, patience=5)
    assert res.trials < 200


def test_sampler_errors():
    with pytest.raises(ValueError, match="unknown sampler"):
        make_sampler("nope", 0, SPACE)
    try:
        import cmaes  # noqa: F401
    except ImportError:
        with pytest.raises(ValueError, match="pip install cmaes"):
            make_sampler("cmaes", 0, SPACE)


def test_enqueue_and_config_from_trial():
    import optuna

    study = optuna.create_study(sampler=make_sampler("random", 0, FULL_SPACE))
    cfg = {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4, "num_stages": 3}
    assert enqueue(study, cfg, FULL_SPACE)  # the optional knobs take their defaults
    assert not enqueue(study, {**cfg, "BLOCK_M": 48}, FULL_SPACE)
    assert config_from_trial(study.ask(), FULL_SPACE) == {**cfg, "USE_TMA": 0, "REVERSE_M": 0,
                                                         "SPLIT_D": 0}


def test_rerunning_an_exhausted_grid_stops_at_once(tmp_path):
    """A finished grid study resumed: no new evaluations and no spinning on re-asks."""
    import time

    url = f"sqlite:///{tmp_path / 'grid.db'}"

    def run():
        runners = []

        def factory(spec, problem, device, options):
            runners.append(ReplayRunner.from_json(FIXTURE))
            return runners[-1]

        t0 = time.monotonic()
        [res] = tune([PROBLEM], TuneOptions(sampler="grid", seed=0, trials=10_000,
                                            top_k_confirm=1),
                     db_url=url, progress=False, _runner_factory=factory, _device=H100,
                     _space=SPACE)
        return res, runners[0], time.monotonic() - t0

    import optuna

    def asked():
        return len(optuna.load_study(study_name=first.study_name, storage=url).trials)

    first, r1, _ = run()
    n_first = asked()
    again, r2, wall = run()
    assert asked() == n_first  # nothing asked of the exhausted grid
    assert first.trials == len(SPACE.valid_configs(PROBLEM, H100))
    assert again.trials == 0 and again.best_ms == pytest.approx(first.best_ms)
    assert len(r2.calls) <= 2  # at most the final confirmation: the best and the default
    # another sampler on the exhausted space ends at once too (it found no unmeasured
    # config; the audit saw TPE ask 640 times for measured ones, 8 minutes on a big db)
    runners = []

    def factory(spec, problem, device, options):
        runners.append(ReplayRunner.from_json(FIXTURE))
        return runners[-1]

    [tpe] = tune([PROBLEM], TuneOptions(sampler="tpe", seed=1, trials=5, top_k_confirm=1),
                 db_url=url, progress=False, _runner_factory=factory, _device=H100,
                 _space=SPACE)
    assert asked() == n_first
    assert tpe.trials == 0 and tpe.states == {} and len(runners[0].calls) <= 2
    assert tpe.best_ms == pytest.approx(first.best_ms)



def test_a_search_that_has_measured_every_valid_config_stops_asking(monkeypatch, caplog):
    """A space with few valid configs among many: once each valid one is measured, the
    sampler can only propose measured configs or static prunes; after ``EXHAUSTION_CHECK``
    such asks in a row the job sees nothing is left and ends, long before it has asked for
    every point of the space or spent its 20-asks-per-trial limit."""
    import logging

    from flashtune.autotune import trial_loop
    from flashtune.core.space import SearchSpace

    keep = {(64, 64, 4, 3), (64, 32, 4, 3), (128, 64, 8, 3), (64, 64, 4, 2)}

    def predicate(cfg, problem, device):
        key = (cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["num_warps"], cfg["num_stages"])
        return SPACE.check(cfg, problem, device) or (None if key in keep else "not kept")

    space = SearchSpace(params=SPACE.params, predicate=predicate)
    monkeypatch.setattr(trial_loop, "EXHAUSTION_CHECK", 5)
    runners = []

    def factory(spec, problem, device, options):
        runners.append(ReplayRunner.from_json(FIXTURE))
        return runners[-1]

    with caplog.at_level(logging.INFO, logger="flashtune.autotune.trial_loop"):
        [res] = tune([PROBLEM], TuneOptions(sampler="random", seed=0, trials=1000,
                                            top_k_confirm=1),
                     db_url="sqlite://", progress=False, _runner_factory=factory,
                     _device=H100, _space=space)
    assert res.trials == len(keep)
    assert "every valid config of the space is measured; search ends" in caplog.text
    assert res.trials + res.states["PRUNED_STATIC"] < space.size


def test_a_rerun_records_this_runs_figure_not_the_luckiest_one(tmp_path):
    """The stored best is re-timed beside the candidates, and the record follows that
    measurement: a best stored with a lucky (too fast) figure is corrected by the next run
    (issue 22: tune recorded 528 TFLOP/s that bench never saw)."""
    from flashtune.db import open_store

    url = f"sqlite:///{tmp_path / 'ft.db'}"

    def factory(spec, problem, device, options):
        return ReplayRunner.from_json(FIXTURE)

    options = TuneOptions(trials=6, sampler="random", seed=0, top_k_confirm=3)
    [first] = tune([PROBLEM], options, db_url=url, progress=False, _runner_factory=factory,
                   _device=H100, _space=SPACE)
    with open_store(url) as store:
        [best] = store.list_best()
        ids = (best.device.id, best.template.id, best.problem.id)
        recorded = ReplayRunner.from_json(FIXTURE).evaluate(best.config).median_ms
        assert best.median_ms == recorded
        # a lucky earlier figure, faster than the config can run
        assert store.offer_best(*ids, config=best.config, median_ms=recorded / 2,
                                tflops=None, trial_id=best.trial_id, trials_count=1,
                                refreshes=best.config)
        assert store.get_best(*ids).median_ms == recorded / 2
    tune([PROBLEM], TuneOptions(trials=2, sampler="random", seed=1, top_k_confirm=3),
         db_url=url, progress=False, _runner_factory=factory, _device=H100, _space=SPACE)
    with open_store(url, read_only=True) as store:
        [again] = store.list_best()
    runner = ReplayRunner.from_json(FIXTURE)
    assert again.median_ms == runner.evaluate(again.config).median_ms  # a real measurement
    assert again.median_ms <= recorded  # never worse than the config it replaced

"""The tuning pipeline end to end under the Triton interpreter on a tiny problem."""

from __future__ import annotations

import dataclasses

import pytest

from flashtune.autotune import runners as runners_mod
from flashtune.autotune.jobs import tune
from flashtune.autotune.options import TuneOptions
from flashtune.autotune.runners import LocalRunner, TrialResult
from flashtune.core.device import interpreter_device
from flashtune.core.space import SearchSpace
from flashtune.db import TrialState, canonical_json, open_store
from flashtune.kernel_templates import get_template

PROBLEM_ARGS = (1, 2, 2, 64, 48, 32, True, "fp16")


@pytest.fixture(autouse=True)
def _one_timed_call(monkeypatch):
    monkeypatch.setattr(runners_mod, "INTERPRETER_REPS", 1)


@pytest.fixture
def problem():
    from flashtune.core.problem import AttentionProblem

    return AttentionProblem(*PROBLEM_ARGS)


OPTS = TuneOptions(trials=4, sampler="random", seed=0, interpret=True, top_k_confirm=2)


def test_pipeline_records_and_resumes(tmp_path, problem):
    url = f"sqlite:///{tmp_path / 'ft.db'}"
    [res] = tune([problem], OPTS, db_url=url, progress=False)
    assert res.trials == 4 and res.device_name == "cpu-interpreter"
    assert res.states == {"COMPLETE": 4}
    assert res.default_ms is not None and res.speedup is not None
    spec = get_template("attn_fwd")
    with open_store(url) as store:
        trials = store.list_trials()
        assert len(trials) == 4
        assert {t.state for t in trials} <= set(TrialState) - {TrialState.RUNNING}
        assert trials[0].config == res.default_config  # warm start: default first
        [best] = store.list_best(device_name="cpu-interpreter")
        assert spec.space.validate(best.config) == best.config
        assert best.config == res.best_config
    # same job again: continues the study, never re-runs or re-records a config
    [res2] = tune([problem], OPTS, db_url=url, progress=True)
    assert res2.trials == 4 and res2.study_name == res.study_name
    with open_store(url) as store:
        trials = store.list_trials()
        assert len(trials) == 8
        keys = [canonical_json(t.config) for t in trials]
        assert len(set(keys)) == len(keys)
        assert len({t.run_id for t in trials}) == 2


def test_the_templates_seeds_are_tried_right_after_the_default(tmp_path, problem,
                                                               monkeypatch):
    """A template's ``seed_configs`` (its default's rivals) are queued after the default,
    in their order, before the sampler's own picks: a search of a few trials compares
    them. Keys the space does not search are dropped, as the default's are."""
    import flashtune.kernel_templates as registry

    spec = get_template("attn_fwd")
    default = spec.default_config(problem, interpreter_device())
    valid = [c for c in spec.space.valid_configs(problem, interpreter_device())
             if c != default]
    rivals = [valid[-1], valid[len(valid) // 2]]
    seeded = dataclasses.replace(
        spec, seed_configs=lambda p, d: [{**rivals[0], "NOT_A_KNOB": 1}, rivals[1]])
    monkeypatch.setattr(registry, "get_template",
                        lambda name: seeded if name == "attn_fwd" else get_template(name))
    url = f"sqlite:///{tmp_path / 'ft.db'}"
    [res] = tune([problem], dataclasses.replace(OPTS, trials=3), db_url=url, progress=False)
    with open_store(url) as store:
        configs = [t.config for t in store.list_trials()]
    assert configs == [res.default_config, *rivals]


def test_static_prune_and_failures_are_recorded(tmp_path, problem):
    spec = get_template("attn_fwd")
    # tiny space: half of it "needs too much shared memory" on this device
    space = SearchSpace(
        params={"BLOCK_M": (16, 32), "BLOCK_N": (16, 32), "num_warps": (2,), "num_stages": (1,)},
        predicate=lambda c, p, d: "needs ~99999 B of shared memory" if c["BLOCK_N"] == 32
        else None)
    device = dataclasses.replace(interpreter_device(), name="fake-gpu-tiny-smem")

    class Launchers:
        """BLOCK_M 16 raises, BLOCK_M 32 returns garbage."""

        def __call__(self, q, k, v, config, *, causal, **kw):
            if config["BLOCK_M"] == 16:
                raise RuntimeError("boom: illegal memory access\nsecond line")
            return spec.launcher(q, k, v, config, causal=causal, **kw) * 2

    def factory(spec_, problem_, device_, options):
        return LocalRunner(spec_, problem_, device_, seed=0, launcher=Launchers())

    url = f"sqlite:///{tmp_path / 'ft.db'}"
    options = dataclasses.replace(OPTS, sampler="grid", trials=10)
    [res] = tune([problem], options, db_url=url, progress=False, _runner_factory=factory,
                 _device=device, _space=space)
    assert res.states == {"PRUNED_STATIC": 2, "RUNTIME_ERROR": 1, "WRONG_RESULT": 1}
    assert res.best_config is None and not res.became_best
    with open_store(url) as store:
        by_state = {t.state: t for t in store.list_trials()}
    assert "shared memory" in by_state[TrialState.PRUNED_STATIC].message
    assert by_state[TrialState.RUNTIME_ERROR].message == \
        "RuntimeError: boom: illegal memory access"
    assert "relative error" in by_state[TrialState.WRONG_RESULT].message


def test_a_budget_spent_before_the_first_trial_still_measures_the_first_batch(tmp_path,
                                                                                problem):
    """--timeout is checked between batches, as Optuna's ``optimize(timeout=)`` checks it
    between trials: a runner that takes longer to start than the whole budget (a GPU worker
    process importing torch) still gets the first batch, the default, measured and stored,
    instead of a run marked complete with no trial."""
    import time

    def slow_start(spec_, problem_, device_, options):
        time.sleep(0.3)
        return LocalRunner(spec_, problem_, device_, seed=0)

    url = f"sqlite:///{tmp_path / 'ft.db'}"
    [res] = tune([problem], dataclasses.replace(OPTS, timeout_s=0.1), db_url=url,
                 progress=False, _runner_factory=slow_start)
    assert res.trials == 1 and res.states == {"COMPLETE": 1}
    assert res.best_config == res.default_config
    with open_store(url) as store:
        [trial] = store.list_trials()
        assert trial.config == res.default_config
        assert len(store.list_best(device_name="cpu-interpreter")) == 1


def test_local_runner_states(problem):
    spec = get_template("attn_fwd")
    dev = interpreter_device()
    runner = LocalRunner(spec, problem, dev, seed=0)
    ok = runner.evaluate({"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 2, "num_stages": 1})
    assert ok.state is TrialState.COMPLETE and ok.median_ms > 0 and ok.compile_s > 0
    bad = runner.evaluate({"BLOCK_M": 8, "BLOCK_N": 16, "num_warps": 2, "num_stages": 1})
    assert bad.state in (TrialState.COMPILE_ERROR, TrialState.RUNTIME_ERROR)
    assert bad.message and "\n" not in bad.message
    slow = LocalRunner(spec, problem, dev, seed=0, timeout_s=0.0)
    res = slow.evaluate({"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 2, "num_stages": 1})
    assert res.state is TrialState.TIMEOUT
    assert TrialResult.from_dict(ok.to_dict()) == ok


def test_a_config_far_behind_the_best_is_timed_once(problem, monkeypatch):
    """On a GPU, after a full measurement: a config whose one timed launch is 3x the best
    median or more (and at least 5 ms) keeps that timing and says so; one closer is measured
    in full. Played on the CPU with the GPU timings made up (the kernel still runs and is
    checked under the interpreter)."""
    spec = get_template("attn_fwd")
    runner = LocalRunner(spec, problem, interpreter_device(), seed=0)
    runner.interpreting = False  # as on a GPU: the timings below stand in for CUDA events
    full = iter([(8.0, 7.9, 8.1), (16.0, 15.9, 16.1)])
    once = iter([30.0, 16.5])
    monkeypatch.setattr(runner, "time_config", lambda config=None: next(full))
    monkeypatch.setattr(runner, "_once_ms", lambda: next(once))
    cfg = {"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 2, "num_stages": 1}
    first = runner.evaluate(cfg)  # nothing measured yet: in full
    assert (first.state, first.median_ms, first.message) == (TrialState.COMPLETE, 8.0, None)
    far = runner.evaluate(cfg)  # 30 ms >= 3 x 8: once
    assert (far.state, far.median_ms, far.p80_ms) == (TrialState.COMPLETE, 30.0, 30.0)
    assert far.message == "timed once: 30 ms, over 3x the best so far (8 ms)"
    near = runner.evaluate(cfg)  # 16.5 ms < 24: in full
    assert (near.median_ms, near.message) == (16.0, None)
    with pytest.raises(StopIteration):
        next(once)  # both one-launch timings were taken
    short = LocalRunner(spec, problem, interpreter_device(), seed=0)
    short.interpreting, short._best_ms = False, 0.5
    monkeypatch.setattr(short, "_once_ms", lambda: 4.0)  # 8x, but under 5 ms: host time
    assert short._far_behind() is None


def test_precompile_is_skipped_under_interpreter(problem):
    from flashtune.autotune.precompile import precompile
    from flashtune.kernel_templates.attn_fwd.warmup import attn_fwd_warmup_args

    spec = get_template("attn_fwd")
    cfg = {"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 2, "num_stages": 1}
    assert precompile(spec, problem, [cfg], workers=2) == {}
    args, kwargs, grid = attn_fwd_warmup_args(problem, cfg)
    # every kernel parameter is given exactly once, positionally or as a constexpr keyword
    names = list(spec.kernel.arg_names)
    assert names[len(args):] == [n for n in kwargs if n not in ("num_warps", "num_stages")]
    assert grid == (4, 2) and kwargs["BLOCK_M"] == 16


def test_unsupported_head_dim_is_refused_before_any_work(tmp_path):
    from flashtune.core.errors import InputError
    from flashtune.core.problem import AttentionProblem

    url = f"sqlite:///{tmp_path / 'ft.db'}"
    with pytest.raises(InputError, match=r"head_dim 300 is not supported .*1 to 256"):
        tune([AttentionProblem(1, 2, 2, 40, 40, 300, False, "fp16")], OPTS, db_url=url)
    assert not (tmp_path / "ft.db").exists()


@pytest.mark.parametrize("field,value,needle", [
    ("seed", -1, "seed must be an integer from 0 to 4294967295"),
    ("seed", 2**32, "seed must be an integer from 0 to 4294967295"),
    ("seed", 10**20, "seed must be an integer from 0"),
    ("timeout_s", float("nan"), "timeout_s must be a finite number of seconds > 0"),
    ("timeout_s", float("inf"), "timeout_s must be a finite number"),
    ("timeout_s", 0, "timeout_s must be a finite number"),
    ("trials", 0, "trials must be an integer >= 1"),
    ("sampler", "bayes", "sampler must be one of tpe, random, grid, cmaes"),
    ("patience", 0, "patience must be an integer >= 1 or None"),
    ("workers", True, "workers must be an integer"),
    ("trial_timeout_s", float("nan"), "trial_timeout_s must be a finite number"),
])
def test_options_the_search_cannot_use_are_refused_before_any_work(tmp_path, field, value,
                                                                   needle):
    """Each of these used to fail inside Optuna (seed range), SQLite (a 20-digit seed) or
    the canonical JSON of the run's params (nan, inf) after the run row was written, which
    then stayed RUNNING."""
    from flashtune.core.errors import InputError

    with pytest.raises(InputError, match=needle):
        dataclasses.replace(OPTS, **{field: value})
    assert dataclasses.replace(OPTS, seed=2**32 - 1).seed == 2**32 - 1  # the range's top


def test_cmaes_without_its_package_is_refused_up_front(monkeypatch):
    import importlib.util

    from flashtune.core.errors import InputError

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "cmaes" else real(name, *a))
    with pytest.raises(InputError, match="sampler 'cmaes' needs the cmaes package"):
        TuneOptions(sampler="cmaes")


def test_decode_template_is_tuned_and_served(tmp_path, monkeypatch):
    """`flashtune tune --template attn_decode`: a short-query problem tuned under the
    interpreter (every candidate checked against the reference), its best served to
    flashtune.attention's decode route."""
    import torch

    import flashtune
    from flashtune.core.problem import AttentionProblem

    p = AttentionProblem(1, 4, 2, 1, 300, 32, True, "fp16")
    url = f"sqlite:///{tmp_path / 'ft.db'}"
    opts = dataclasses.replace(OPTS, template="attn_decode", trials=3)
    [res] = tune([p], opts, db_url=url, progress=False)
    # every candidate that ran was checked and correct (invalid ones pruned before running)
    assert res.states.get("COMPLETE", 0) >= 1, res.states
    assert set(res.states) <= {"COMPLETE", "PRUNED_STATIC"}, res.states
    assert set(res.best_config) == {"BLOCK_N", "NUM_SPLITS", "num_warps", "num_stages",
                                    "SPLIT_D"}
    monkeypatch.setenv("FLASHTUNE_DB", url)
    flashtune.reload_configs()
    try:
        q = torch.randn(1, 4, 1, 32).half()
        k = torch.randn(1, 2, 300, 32).half()
        choice = flashtune.lookup_config(q, k, k, causal=True)
        assert (choice.template, choice.source, choice.config) == (
            "attn_decode", "exact", res.best_config)
    finally:
        flashtune.reload_configs()


def test_jobs_keeps_its_public_names():
    """``flashtune.autotune.jobs`` is the module users import ``tune`` from; the options and
    the result live in ``autotune.options`` and stay importable from ``jobs`` too."""
    from flashtune.autotune import jobs, options

    assert sorted(jobs.__all__) == ["TuneOptions", "TuneResult", "tune"]
    assert jobs.TuneOptions is options.TuneOptions and jobs.TuneResult is options.TuneResult

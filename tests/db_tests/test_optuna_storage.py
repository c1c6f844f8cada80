"""flashtune's database is an Optuna RDB storage as it is: Optuna's own tables live beside
flashtune's ``ft_*`` ones, so ``optuna-dashboard sqlite:///path/to/flashtune.db`` (and
``optuna.load_study``) see every study a tuning job ran (README, "Dashboards")."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import optuna
import pytest

from flashtune.autotune import runners
from flashtune.autotune.jobs import tune
from flashtune.autotune.options import TuneOptions
from flashtune.core.problem import AttentionProblem
from flashtune.db import TrialState, open_store
from tests.db_tests.exchange_support import populate
from tests.db_tests.support import H100

PROBLEM = AttentionProblem(1, 2, 2, 32, 32, 16, False, "fp16")


@pytest.fixture(scope="module")
def tuned(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """A database filled by a tiny tuning run under the interpreter: (url, study name)."""
    url = f"sqlite:///{tmp_path_factory.mktemp('optuna') / 'flashtune.db'}"
    reps = runners.INTERPRETER_REPS
    runners.INTERPRETER_REPS = 1
    try:
        [result] = tune([PROBLEM], TuneOptions(trials=4, sampler="random", seed=0,
                                               interpret=True, top_k_confirm=1),
                        db_url=url, progress=False)
    finally:
        runners.INTERPRETER_REPS = reps
    return url, result.study_name


def test_study_summaries_list_the_tuning_study(tuned: tuple[str, str]) -> None:
    url, name = tuned
    [summary] = optuna.get_all_study_summaries(storage=url)
    assert summary.study_name == name
    assert name.startswith("cpu-interpreter/attn_fwd@") and name.endswith(
        '/{"batch":1,"causal":false,"dtype":"fp16","head_dim":16,"heads_kv":2,"heads_q":2,'
        '"seqlen_k":32,"seqlen_q":32}')
    assert summary.direction == optuna.study.StudyDirection.MINIMIZE
    assert summary.n_trials >= 4 and summary.best_trial is not None
    with open_store(url, read_only=True) as store:
        complete = store.list_trials(state=TrialState.COMPLETE)
        [run_id] = {t.run_id for t in complete}
        run = store.get_run(run_id)
    assert run is not None and run.study_name == name
    # the study's objective is flashtune's median ms, its best the fastest trial's
    assert summary.best_trial.value == min(t.median_ms for t in complete if t.median_ms)


def test_load_study_reads_the_trials(tuned: tuple[str, str]) -> None:
    url, name = tuned
    study = optuna.load_study(study_name=name, storage=url)
    done = study.get_trials(states=(optuna.trial.TrialState.COMPLETE,))
    with open_store(url, read_only=True) as store:
        ours = store.list_trials(state=TrialState.COMPLETE)
    assert len(done) == len(ours) == 4
    # Optuna's parameters are ordinal indices into the template's value lists
    assert all(set(t.params) == {f"{k}_idx" for k in ours[0].config} for t in done)
    assert sorted(t.value for t in done) == sorted(t.median_ms for t in ours)


def test_a_database_without_optuna_tables_still_opens(tmp_path: Path) -> None:
    """An import-only database (no tuning run, so no Optuna tables): Optuna adds its own
    tables and finds no study; flashtune's store opens it as before."""
    url = f"sqlite:///{tmp_path / 'imported.db'}"
    populate(url, H100, {0: 1.0})
    assert optuna.get_all_study_summaries(storage=url) == []
    with open_store(url, read_only=True) as store:
        assert len(store.list_best()) == 1


def test_optuna_dashboard_serves_the_studies(tuned: tuple[str, str]) -> None:
    dashboard = pytest.importorskip("optuna_dashboard")
    url, name = tuned
    app = dashboard.wsgi(url)
    status: list[str] = []

    def start_response(code: str, headers: list[Any], exc_info: Any = None) -> None:
        status.append(code)

    environ = {"REQUEST_METHOD": "GET", "PATH_INFO": "/api/studies", "QUERY_STRING": "",
               "SERVER_NAME": "localhost", "SERVER_PORT": "8080", "SERVER_PROTOCOL": "HTTP/1.1",
               "wsgi.url_scheme": "http", "wsgi.input": io.BytesIO(b""),
               "wsgi.errors": io.StringIO()}
    body = b"".join(app(environ, start_response))
    assert status and status[0].startswith("200")
    studies = json.loads(body)["study_summaries"]
    assert [s["study_name"] for s in studies] == [name]

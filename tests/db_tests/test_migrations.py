"""Schema history: the frozen 0001-0004 databases, upgrades, refusals, and sharing with
Optuna."""

from __future__ import annotations

import hashlib
import os
import shutil
import socket
import sqlite3
from datetime import datetime, timedelta
from pathlib import Path

import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import MetaData, create_engine, insert

from flashtune import SchemaError
from flashtune.db import RunStatus, SoftwareVersions, TrialState, open_store, upgrade
from flashtune.db.engine import make_engine, write_engine
from flashtune.db.models import Base
from flashtune.db.schema import (
    HEAD_REVISION,
    VERSION_TABLE,
    alembic_config,
    current_revision,
    downgrade,
    known_revisions,
)
from tests.db_tests.support import ASSETS, wipe_postgres

ASSET = ASSETS / "flashtune_0001.db"
ASSET_0002 = ASSETS / "flashtune_0002.db"
ASSET_0003 = ASSETS / "flashtune_0003.db"
ASSET_0004 = ASSETS / "flashtune_0004.db"
RUN_1 = SoftwareVersions(cuda="12.4", driver="", flashtune="0.1.0", torch="2.5.1+cu124",
                         triton="3.1.0")  # what run 1 of the 0001 asset recorded


def fingerprint(path: Path) -> tuple[str, list[str]]:
    """The file's bytes digest and the folder's file names (a -wal file is a write too)."""
    return hashlib.sha256(path.read_bytes()).hexdigest(), sorted(p.name for p in path.parent.iterdir())


def rows(path: Path, sql: str) -> list[tuple]:
    con = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        return con.execute(sql).fetchall()
    finally:
        con.close()


@pytest.fixture
def old_db(tmp_path: Path) -> Path:
    path = tmp_path / "flashtune_0001.db"
    shutil.copyfile(ASSET, path)
    return path


def test_head_revision_matches_the_migration_scripts() -> None:
    script = ScriptDirectory.from_config(alembic_config())
    assert script.get_current_head() == HEAD_REVISION
    assert known_revisions() == ("0001", "0002", "0003", "0004", "0005")


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_migrations_build_exactly_the_models(backend: str, tmp_path: Path,
                                             request: pytest.FixtureRequest) -> None:
    url = f"sqlite:///{tmp_path / 'm.db'}" if backend == "sqlite" else \
        request.getfixturevalue("pg_url")
    if backend == "postgresql":
        wipe_postgres(url)
    upgrade(url)
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            ctx = MigrationContext.configure(conn, opts={"compare_type": True})
            diffs = [d for d in compare_metadata(ctx, Base.metadata)
                     if "alembic_version" not in repr(d)]
        assert diffs == []
    finally:
        engine.dispose()
        if backend == "postgresql":
            wipe_postgres(url)


def test_the_0001_asset_is_refused_unchanged_with_the_upgrade_command(old_db: Path) -> None:
    before = fingerprint(old_db)
    url = f"sqlite:///{old_db}"
    expected = (f"database {url} is at schema revision 0001, this flashtune needs "
                f"{HEAD_REVISION}: run `flashtune --db {url} db upgrade`")
    for read_only in (False, True):
        with pytest.raises(SchemaError) as info:
            open_store(url, read_only=read_only)
        assert str(info.value) == expected
        assert fingerprint(old_db) == before


def test_upgrading_the_0001_asset_keeps_its_data(old_db: Path) -> None:
    url = f"sqlite:///{old_db}"
    assert upgrade(url) == ("0001", HEAD_REVISION)
    assert upgrade(url) == (HEAD_REVISION, HEAD_REVISION)  # idempotent
    with open_store(url) as store:
        [device] = store.list_devices()
        assert device.hardware_key() == ("NVIDIA_H100_80GB_HBM3", "9.0", 132, 232448,
                                          85520809984)
        [problem] = store.list_problems("attn_fwd")
        assert problem.key["seqlen_q"] == 4096 and problem.key["causal"] is True
        run = store.get_run(1)
        assert run is not None and run.status is RunStatus.COMPLETE
        assert (run.host, run.driver_version, run.torch_version) == ("", "", "2.5.1+cu124")
        assert run.params == {"n_trials": 5, "timeout_s": 600}
        trials = store.list_trials(run_id=1)
        assert [t.state for t in trials] == [
            TrialState.COMPLETE, TrialState.PRUNED_STATIC, TrialState.COMPLETE,
            TrialState.OUT_OF_RESOURCES, TrialState.COMPLETE]
        assert all(t.p20_ms is None and t.p80_ms is None for t in trials)  # never measured
        assert "232448" in (trials[1].message or "")
        [best] = store.list_best(device_name="NVIDIA_H100_80GB_HBM3")
        assert (best.median_ms, best.trial_id, best.trials_count) == (1.397, 5, 5)
        assert best.config == trials[4].config
        assert best.software == RUN_1  # 0004: its trial's run's versions
        ids = (device.id, best.template.id, problem.id)
        # hashes written by 0001 code still find the same configs
        assert store.find_trial(*ids, trials[2].config) == trials[2]
        # the study goes on where it stopped, with the 0002 columns
        new_run = store.create_run(*ids, study_name=run.study_name, sampler="TPESampler",
                                   host="node-7", driver_version="550.54.15")
        trial = store.record_trial(new_run.id, {"BLOCK_M": 64}, TrialState.COMPLETE,
                                   median_ms=1.3, p20_ms=1.28, p80_ms=1.33)
        assert trial.number == 5 and trial.p80_ms == 1.33
    assert rows(old_db, "PRAGMA integrity_check") == [("ok",)]


@pytest.fixture
def db_0002(tmp_path: Path) -> Path:
    path = tmp_path / "flashtune_0002.db"
    shutil.copyfile(ASSET_0002, path)
    return path


def test_the_0002_asset_is_refused_unchanged(db_0002: Path) -> None:
    before = fingerprint(db_0002)
    for read_only in (False, True):
        with pytest.raises(SchemaError,
                           match="at schema revision 0002.*`flashtune --db .* db upgrade`"):
            open_store(f"sqlite:///{db_0002}", read_only=read_only)
    assert fingerprint(db_0002) == before


def test_upgrading_the_0002_asset_keeps_its_data_and_its_dead_run(db_0002: Path) -> None:
    """0002 -> head: runs gain a NULL pid (owner unknown); the RUNNING run a killed job
    left on another host is still there, and ages out as stale."""
    url = f"sqlite:///{db_0002}"
    assert upgrade(url) == ("0002", HEAD_REVISION)
    with open_store(url) as store:
        runs = store.list_runs()
        assert [(r.id, r.status, r.host, r.pid) for r in runs] == [
            (1, RunStatus.COMPLETE, "", None), (2, RunStatus.RUNNING, "node-7", None)]
        assert store.list_runs(status="RUNNING") == [runs[1]]
        assert runs[1].driver_version == "550.54.15"
        [dead] = store.list_trials(state=TrialState.RUNNING)
        assert (dead.run_id, dead.number) == (2, 5)
        ids = (dead.device_id, dead.template_id, dead.problem_id)
        assert store.fail_stale_trials(*ids, older_than=timedelta(minutes=5)) == 1
        assert store.fail_stale_runs(*ids, older_than=timedelta(minutes=5)) == 1
        [best] = store.list_best()
        assert (best.median_ms, best.trial_id) == (1.397, 5)
        run = store.create_run(*ids, study_name=runs[1].study_name, sampler="tpe")
        assert run.pid == os.getpid() and run.host == socket.gethostname()
        assert store.start_trial(run.id, {"BLOCK_M": 16}).number == 6
    assert rows(db_0002, "PRAGMA integrity_check") == [("ok",)]
    assert rows(db_0002, "PRAGMA foreign_key_check") == []


@pytest.fixture
def db_0003(tmp_path: Path) -> Path:
    path = tmp_path / "flashtune_0003.db"
    shutil.copyfile(ASSET_0003, path)
    return path


def test_the_0003_asset_is_refused_unchanged_with_the_upgrade_command(db_0003: Path) -> None:
    before = fingerprint(db_0003)
    url = f"sqlite:///{db_0003}"
    for read_only in (False, True):
        with pytest.raises(SchemaError) as info:
            open_store(url, read_only=read_only)
        assert str(info.value) == (f"database {url} is at schema revision 0003, this "
                                   f"flashtune needs {HEAD_REVISION}: run `flashtune --db "
                                   f"{url} db upgrade`")
    assert fingerprint(db_0003) == before


def test_upgrading_the_0003_asset_gives_each_best_config_its_software(db_0003: Path) -> None:
    """0003 -> 0004: a best config takes its trial's run's versions; the imported one (no
    trial) has none to take and keeps empty ones. New best configs record theirs."""
    url = f"sqlite:///{db_0003}"
    assert upgrade(url) == ("0003", HEAD_REVISION)
    with open_store(url) as store:
        best = {b.id: b for b in store.list_best()}
        assert sorted(best) == [1, 2, 3]
        assert best[1].software == RUN_1
        assert best[2].software == SoftwareVersions(
            cuda="12.6", driver="560.35.03", flashtune="0.3.0", torch="2.6.0+cu126",
            triton="3.2.0")
        assert (best[3].trial_id, best[3].software) == (None, SoftwareVersions())
        assert (best[2].median_ms, best[2].trial_id, best[3].trials_count) == (0.031, 7, 40)
        run = store.get_run(3)
        assert run is not None and (run.pid, run.host) == (4242, "node-7")
        # the study of problem 3 goes on here: its new best config records its run's
        ids = (best[3].device.id, best[3].template.id, best[3].problem.id)
        new_run = store.create_run(*ids, study_name="s3", sampler="tpe", torch_version="2.7.0",
                                   triton_version="3.3.0")
        trial = store.record_trial(new_run.id, {"BLOCK_M": 64}, TrialState.COMPLETE,
                                   median_ms=0.04)
        assert store.offer_best(*ids, config=trial.config, median_ms=0.04, tflops=None,
                                trial_id=trial.id, trials_count=41)
        stored = store.get_best(*ids)
        assert stored is not None and (stored.software.torch, stored.software.triton) == \
            ("2.7.0", "3.3.0")
    assert rows(db_0003, "PRAGMA integrity_check") == [("ok",)]
    assert rows(db_0003, "PRAGMA foreign_key_check") == []


def test_downgrading_0004_drops_only_the_software(db_0003: Path) -> None:
    url = f"sqlite:///{db_0003}"
    before = rows(db_0003, "SELECT * FROM ft_best_configs ORDER BY id")
    upgrade(url)
    downgrade(url, "0003")
    assert rows(db_0003, f"SELECT version_num FROM {VERSION_TABLE}") == [("0003",)]
    # ft_best_configs was rebuilt by batch mode: the rows, trial ids included, are intact
    assert rows(db_0003, "SELECT * FROM ft_best_configs ORDER BY id") == before
    assert rows(db_0003, "PRAGMA foreign_key_check") == []
    upgrade(url)
    with open_store(url) as store:
        assert {b.id: b.software.flashtune for b in store.list_best()} == \
            {1: "0.1.0", 2: "0.3.0", 3: ""}


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_the_0004_backfill_on_every_backend(backend: str, tmp_path: Path,
                                            request: pytest.FixtureRequest) -> None:
    """The backfill is one UPDATE with correlated subqueries: run it where it was not
    written by hand (PostgreSQL), on a measured best config and an imported one."""
    url = f"sqlite:///{tmp_path / 'b.db'}" if backend == "sqlite" else \
        request.getfixturevalue("pg_url")
    if backend == "postgresql":
        wipe_postgres(url)
    engine = make_engine(url, wal=False)
    t0 = datetime(2026, 12, 1, 8, 0, 0)
    try:
        with write_engine(engine).begin() as conn:
            command.upgrade(alembic_config(conn), "0003")
            meta = MetaData()
            meta.reflect(conn, only=["ft_devices", "ft_templates", "ft_problems", "ft_runs",
                                     "ft_trials", "ft_best_configs"])
            t = meta.tables
            conn.execute(insert(t["ft_devices"]).values(
                id=1, name="H100", compute_capability="9.0", sm_count=132,
                shared_mem_per_block=232448, total_memory=1, created_at=t0))
            conn.execute(insert(t["ft_templates"]).values(
                id=1, name="attn_fwd", source_hash="5f0c2a9e41d7b3c8", created_at=t0))
            conn.execute(insert(t["ft_problems"]), [
                dict(id=i, template_name="attn_fwd", key_json=f'{{"k":{i}}}', bucket=f"b{i}",
                     created_at=t0) for i in (1, 2)])
            conn.execute(insert(t["ft_runs"]).values(
                id=1, device_id=1, template_id=1, problem_id=1, study_name="s", sampler="tpe",
                params_json="{}", status="COMPLETE", started_at=t0, flashtune_version="0.3.0",
                torch_version="2.6.0", triton_version="3.2.0", cuda_version="12.6",
                driver_version="560", host="node-1"))
            conn.execute(insert(t["ft_trials"]).values(
                id=1, run_id=1, device_id=1, template_id=1, problem_id=1, number=0,
                config_json="{}", config_hash="44136fa355b3678a", state="COMPLETE",
                started_at=t0))
            conn.execute(insert(t["ft_best_configs"]), [
                dict(id=i, device_id=1, template_id=1, problem_id=i, config_json="{}",
                     median_ms=float(i), trial_id=trial, trials_count=1, tuned_at=t0)
                for i, trial in ((1, 1), (2, None))])
        assert upgrade(url) == ("0003", HEAD_REVISION)
        with open_store(url, read_only=True) as store:
            assert [b.software for b in store.list_best()] == [
                SoftwareVersions(cuda="12.6", driver="560", flashtune="0.3.0", torch="2.6.0",
                                 triton="3.2.0"),
                SoftwareVersions()]
    finally:
        engine.dispose()
        if backend == "postgresql":
            wipe_postgres(url)


# -- 0005: op choices --------------------------------------------------------------------------

FT_OLD_TABLES = ("ft_devices", "ft_templates", "ft_problems", "ft_runs", "ft_trials",
                 "ft_best_configs")
CHOSEN = {"batch": 1, "heads_q": 4, "heads_kv": 4, "seqlen_q": 77, "seqlen_k": 133,
          "head_dim": 64, "causal": False, "dtype": "bf16"}  # problem 2 of the 0003 asset


def tables(path: Path) -> set[str]:
    return {r[0] for r in rows(path, "SELECT name FROM sqlite_master WHERE type='table'")}


def content(path: Path) -> dict[str, list[tuple]]:
    return {t: rows(path, f"SELECT * FROM {t} ORDER BY id") for t in FT_OLD_TABLES}


@pytest.fixture
def db_0004(tmp_path: Path) -> Path:
    path = tmp_path / "flashtune_0004.db"
    shutil.copyfile(ASSET_0004, path)
    return path


def test_the_0004_asset_is_refused_unchanged_with_the_upgrade_command(db_0004: Path) -> None:
    before = fingerprint(db_0004)
    url = f"sqlite:///{db_0004}"
    for read_only in (False, True):
        with pytest.raises(SchemaError) as info:
            open_store(url, read_only=read_only)
        assert str(info.value) == (f"database {url} is at schema revision 0004, this "
                                   f"flashtune needs {HEAD_REVISION}: run `flashtune --db "
                                   f"{url} db upgrade`")
    assert fingerprint(db_0004) == before


def test_upgrading_the_0003_asset_adds_an_empty_choices_table(db_0003: Path) -> None:
    """0003 -> head: every old row is as it was (but for 0004's software columns), and
    ft_choices is there, empty, ready for the tuner's decisions."""
    before = content(db_0003)
    url = f"sqlite:///{db_0003}"
    assert upgrade(url) == ("0003", HEAD_REVISION)
    assert "ft_choices" in tables(db_0003)
    assert rows(db_0003, "SELECT count(*) FROM ft_choices") == [(0,)]
    after = content(db_0003)
    assert {t: after[t] for t in FT_OLD_TABLES if t != "ft_best_configs"} == \
        {t: before[t] for t in FT_OLD_TABLES if t != "ft_best_configs"}
    assert [r[:10] for r in after["ft_best_configs"]] == before["ft_best_configs"]
    with open_store(url) as store:
        assert store.list_choices() == []
        [device] = store.list_devices()
        choice = store.put_choice(device.id, "fwd", CHOSEN, implementation="attn_fwd",
                                  source_hash="5f0c2a9e41d7b3c8", config={"BLOCK_M": 64},
                                  median_ms=0.031, tflops=12.5)
        assert store.list_choices(device_name=device.name) == [choice]
        assert choice.bucket == "bf16-d64-full-hq4-hkv4-b1-nq128-nk256"
    assert rows(db_0003, "PRAGMA integrity_check") == [("ok",)]
    assert rows(db_0003, "PRAGMA foreign_key_check") == []


def test_upgrading_the_0004_asset_keeps_its_data(db_0004: Path) -> None:
    url = f"sqlite:///{db_0004}"
    before = content(db_0004)
    assert upgrade(url) == ("0004", HEAD_REVISION)
    assert content(db_0004) == before
    with open_store(url) as store:
        best = {b.id: b for b in store.list_best()}
        assert sorted(best) == [1, 2, 3, 4]
        assert (best[4].trial_id, best[4].median_ms, best[4].software.torch) == \
            (None, 0.021, "2.7.0")
        assert best[1].software == RUN_1
        assert store.list_choices() == [] and store.info()["counts"]["ft_choices"] == 0


def test_downgrading_0005_drops_only_the_choices(db_0004: Path) -> None:
    url = f"sqlite:///{db_0004}"
    before = content(db_0004)
    upgrade(url)
    with open_store(url) as store:
        store.put_choice(1, "decode", {**CHOSEN, "seqlen_q": 1}, implementation="attn_decode",
                         source_hash="a0748953ade86dbe", config={"BLOCK_N": 64},
                         median_ms=0.01, tflops=None)
    downgrade(url, "0004")
    assert rows(db_0004, f"SELECT version_num FROM {VERSION_TABLE}") == [("0004",)]
    assert "ft_choices" not in tables(db_0004)
    assert content(db_0004) == before
    assert rows(db_0004, "PRAGMA foreign_key_check") == []
    upgrade(url)
    with open_store(url) as store:
        assert store.list_choices() == []  # the decision went with the table


def test_downgrade_then_upgrade_round_trips(old_db: Path) -> None:
    url = f"sqlite:///{old_db}"
    upgrade(url)
    downgrade(url, "0001")
    assert rows(old_db, f"SELECT version_num FROM {VERSION_TABLE}") == [("0001",)]
    assert "host" not in [r[1] for r in rows(old_db, "PRAGMA table_info(ft_runs)")]
    assert rows(old_db, "SELECT count(*) FROM ft_trials") == [(5,)]
    # ft_trials was rebuilt by batch mode: ON DELETE SET NULL must not have fired
    assert rows(old_db, "SELECT trial_id FROM ft_best_configs") == [(5,)]
    assert rows(old_db, "PRAGMA foreign_key_check") == []
    upgrade(url)
    with open_store(url) as store:
        assert len(store.list_trials()) == 5


def test_a_database_from_a_newer_flashtune_is_refused_unchanged(tmp_path: Path) -> None:
    path = tmp_path / "future.db"
    url = f"sqlite:///{path}"
    open_store(url).close()
    con = sqlite3.connect(path)
    con.execute(f"UPDATE {VERSION_TABLE} SET version_num = '0099'")
    con.execute("PRAGMA journal_mode = DELETE")  # one file, so the digest sees everything
    con.commit()
    con.close()
    before = fingerprint(path)
    for read_only in (False, True):
        with pytest.raises(SchemaError, match="revision 0099.*newer flashtune; upgrade flashtune"):
            open_store(url, read_only=read_only)
    with pytest.raises(SchemaError, match="newer flashtune"):
        upgrade(url)
    assert fingerprint(path) == before


def test_flashtune_tables_without_a_version_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "hand_made.db"
    con = sqlite3.connect(path)
    con.execute("CREATE TABLE ft_devices (id INTEGER PRIMARY KEY)")
    con.close()
    with pytest.raises(SchemaError, match="no flashtune_alembic_version table"):
        open_store(f"sqlite:///{path}")
    with pytest.raises(SchemaError, match="no flashtune_alembic_version table"):
        upgrade(f"sqlite:///{path}")


def test_a_fresh_database_is_created_at_head(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "fresh.db"
    path.parent.mkdir()
    with open_store(f"sqlite:///{path}") as store:
        assert store.info()["revision"] == HEAD_REVISION
    engine = create_engine(f"sqlite:///{path}")
    try:
        assert current_revision(engine) == HEAD_REVISION
    finally:
        engine.dispose()
    assert rows(path, "PRAGMA journal_mode") == [("wal",)]


@pytest.mark.parametrize("optuna_first", [True, False], ids=["optuna-first", "flashtune-first"])
def test_optuna_can_share_the_database(tmp_path: Path, optuna_first: bool) -> None:
    optuna = pytest.importorskip("optuna")
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    path = tmp_path / "shared.db"
    url = f"sqlite:///{path}"

    def use_optuna() -> None:
        study = optuna.create_study(storage=url, study_name="attn_fwd-h100",
                                    load_if_exists=True)
        study.optimize(lambda t: (t.suggest_int("BLOCK_M", 16, 128) - 64) ** 2, n_trials=3)

    def use_flashtune() -> None:
        with open_store(url) as store:
            d = store.ensure_device(__import__("tests.db_tests.support").db_tests.support.H100)
            assert store.info()["revision"] == HEAD_REVISION
            assert d.id == 1

    for step in ((use_optuna, use_flashtune) if optuna_first else (use_flashtune, use_optuna)):
        step()
    use_flashtune()  # re-opening beside Optuna's tables is fine
    tables = {r[0] for r in rows(path, "SELECT name FROM sqlite_master WHERE type='table'")}
    assert {"alembic_version", VERSION_TABLE, "studies", "trials", "ft_trials",
            "ft_best_configs"} <= tables
    assert rows(path, f"SELECT version_num FROM {VERSION_TABLE}") == [(HEAD_REVISION,)]
    [(optuna_revision,)] = rows(path, "SELECT version_num FROM alembic_version")
    assert optuna_revision != HEAD_REVISION and optuna_revision.startswith("v")
    loaded = optuna.load_study(storage=url, study_name="attn_fwd-h100")
    assert len(loaded.trials) == 3

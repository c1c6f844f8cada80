"""Store contract, part 1: identities, runs, records, errors, threads, info.

Every test taking ``store`` runs on every backend (see conftest.py).
"""

from __future__ import annotations

import dataclasses
import math
import threading
from dataclasses import replace
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest

from flashtune import SchemaError, StoreError
from flashtune.core.device import DeviceFingerprint
from flashtune.db import HEAD_REVISION, RunStatus, SoftwareVersions, TrialState, open_store
from flashtune.db.records import ImportedBest
from flashtune.db.store import TuningStore
from tests.db_tests.support import A100, BUCKET, H100, KEY, Study, make_study


def test_ensure_device_is_get_or_create_on_the_hardware_key(store: TuningStore) -> None:
    first = store.ensure_device(H100)
    assert store.ensure_device(H100) == first
    # software versions are not part of the identity
    assert store.ensure_device(replace(H100, torch_version="2.6.0", driver_version="560")) == first
    assert first.hardware_key() == H100.hardware_key()
    other = store.ensure_device(replace(H100, sm_count=114))  # an H100 PCIe
    a100 = store.ensure_device(A100)
    assert len({first.id, other.id, a100.id}) == 3
    assert store.list_devices() == [first, other, a100]


def test_ensure_template_is_get_or_create_on_name_and_hash(store: TuningStore) -> None:
    t1 = store.ensure_template("attn_fwd", "aaaa")
    assert store.ensure_template("attn_fwd", "aaaa") == t1
    t2 = store.ensure_template("attn_fwd", "bbbb")
    t3 = store.ensure_template("attn_bwd", "aaaa")
    assert (t1.name, t1.source_hash) == ("attn_fwd", "aaaa")
    assert len({t1.id, t2.id, t3.id}) == 3
    assert store.list_templates() == [t1, t2, t3]


def test_ensure_problem_keys_on_canonical_json(store: TuningStore) -> None:
    p1 = store.ensure_problem("attn_fwd", KEY, BUCKET)
    reordered = dict(reversed(list(KEY.items())))
    assert store.ensure_problem("attn_fwd", reordered, BUCKET) == p1
    assert p1.key == KEY and p1.bucket == BUCKET
    assert p1.key_json == ('{"batch":4,"causal":true,"dtype":"fp16","head_dim":128,'
                           '"heads_kv":8,"heads_q":32,"seqlen_k":4096,"seqlen_q":4096}')
    p2 = store.ensure_problem("attn_fwd", {**KEY, "seqlen_q": 77}, "other")
    p3 = store.ensure_problem("attn_bwd", KEY, BUCKET)
    assert len({p1.id, p2.id, p3.id}) == 3
    assert store.list_problems("attn_fwd") == [p1, p2]
    assert store.list_problems() == [p1, p2, p3]


def test_ensure_problem_rejects_nan_before_writing(store: TuningStore) -> None:
    with pytest.raises(ValueError, match="NaN|JSON"):
        store.ensure_problem("attn_fwd", {"x": float("nan")}, "b")
    assert store.list_problems() == []


def test_create_and_finish_run(store: TuningStore) -> None:
    s = make_study(store)
    run = store.create_run(*s.ids, study_name="attn_fwd/h100", sampler="TPESampler", seed=7,
                           params={"n_trials": 50, "timeout_s": 600.0},
                           torch_version="2.5.1", triton_version="3.1.0", cuda_version="12.4",
                           driver_version="550.54.15", host="node-3")
    assert run.status is RunStatus.RUNNING and run.finished_at is None
    assert (run.device_id, run.template_id, run.problem_id) == s.ids
    assert run.params == {"n_trials": 50, "timeout_s": 600.0}
    assert (run.seed, run.host, run.driver_version) == (7, "node-3", "550.54.15")
    assert run.started_at.tzinfo == timezone.utc
    assert store.get_run(run.id) == run
    assert s.run.host  # defaults to this host's name
    done = store.finish_run(run.id, RunStatus.COMPLETE)
    assert done.status is RunStatus.COMPLETE
    assert done.finished_at is not None and done.finished_at >= done.started_at
    assert store.get_run(run.id) == done
    assert store.finish_run(s.run.id, "INTERRUPTED").status is RunStatus.INTERRUPTED
    assert store.get_run(10_000) is None
    with pytest.raises(ValueError):
        store.finish_run(run.id, RunStatus.RUNNING)
    with pytest.raises(StoreError, match="no row 10000 in ft_runs"):
        store.finish_run(10_000, RunStatus.FAILED)


def test_fail_stale_runs(store: TuningStore, study: Study) -> None:
    mine = store.create_run(*study.ids, study_name="s", sampler="tpe")
    other_study = make_study(store, device=A100)
    assert store.fail_stale_runs(*study.ids, current_run_id=mine.id) == 1
    status = {r.id: r.status for r in map(store.get_run, (study.run.id, mine.id,
                                                           other_study.run.id)) if r}
    assert status == {study.run.id: RunStatus.FAILED, mine.id: RunStatus.RUNNING,
                      other_study.run.id: RunStatus.RUNNING}
    failed = store.get_run(study.run.id)
    assert failed is not None and failed.finished_at is not None
    assert store.fail_stale_runs(older_than=timedelta(hours=1)) == 0  # all started just now
    assert store.fail_stale_runs() == 2


def test_records_are_frozen(store: TuningStore, study: Study) -> None:
    trial = store.start_trial(study.run.id, {"BLOCK_M": 64})
    store.offer_best(*study.ids, config={"BLOCK_M": 64}, median_ms=1.0, tflops=None,
                     trial_id=trial.id, trials_count=1)
    best = store.get_best(*study.ids)
    for record in (study.device, study.template, study.problem, study.run, trial, best):
        assert dataclasses.is_dataclass(record)
        with pytest.raises(dataclasses.FrozenInstanceError):
            record.id = 99  # type: ignore[misc, union-attr]


def test_writes_are_all_or_nothing(store: TuningStore, study: Study) -> None:
    with pytest.raises(StoreError):
        store.start_trial(10_000, {"BLOCK_M": 64})  # no such run
    with pytest.raises(ValueError):
        store.start_trial(study.run.id, {"BLOCK_M": float("inf")})
    assert store.list_trials() == []


def test_foreign_keys_are_enforced(store: TuningStore, study: Study) -> None:
    with pytest.raises(StoreError, match="(?i)foreign key"):
        store.create_run(10_000, study.template.id, study.problem.id, study_name="s",
                         sampler="tpe")
    assert store.get_run(study.run.id + 1) is None


def test_info_counts_rows(store: TuningStore, study: Study) -> None:
    store.start_trial(study.run.id, {"BLOCK_M": 64})
    info = store.info()
    assert info["revision"] == info["head"] == HEAD_REVISION
    assert info["counts"] == {"ft_devices": 1, "ft_templates": 1, "ft_problems": 1,
                              "ft_runs": 1, "ft_trials": 1, "ft_best_configs": 0,
                              "ft_choices": 0}
    assert info["read_only"] is False and info["url"] == store.url


def test_a_store_can_be_shared_by_threads(store: TuningStore, study: Study) -> None:
    errors: list[BaseException] = []

    def worker(w: int) -> None:
        try:
            for i in range(10):
                t = store.start_trial(study.run.id, {"w": w, "i": i})
                store.finish_trial(t.id, TrialState.COMPLETE, median_ms=1.0 + w + i / 100)
                store.offer_best(*study.ids, config=t.config, median_ms=1.0 + w + i / 100,
                                 tflops=None, trial_id=t.id, trials_count=i + 1)
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    trials = store.list_trials(run_id=study.run.id)
    assert sorted(t.number for t in trials) == list(range(60))
    assert all(t.state is TrialState.COMPLETE for t in trials)
    best = store.get_best(*study.ids)
    assert best is not None and best.median_ms == 1.0 and best.config == {"w": 0, "i": 0}


# -- errors and read-only (SQLite files: what a user points the store at by mistake) --------

def test_a_file_that_is_not_a_database_raises_store_error_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "notes.db"
    path.write_bytes(b"these are my notes, not a database\n" * 200)
    with pytest.raises(StoreError, match=f"database sqlite:///{path}: file is not a database"):
        open_store(f"sqlite:///{path}")


def test_store_error_hides_the_password() -> None:
    url = "postgresql+psycopg://tuner:hunter2@127.0.0.1:1/flashtune"
    with pytest.raises(StoreError) as info:
        open_store(url)  # no server there (or no driver): either way a StoreError
    message = str(info.value)
    assert "hunter2" not in message and "tuner:***@127.0.0.1:1/flashtune" in message
    assert "\n" not in message


def test_read_only_store_reads_and_refuses_writes(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'ft.db'}"
    with open_store(url) as rw:
        s = make_study(rw)
        rw.start_trial(s.run.id, {"BLOCK_M": 64})
    with open_store(url, read_only=True) as ro:
        assert ro.list_devices() == [s.device]
        assert len(ro.list_trials()) == 1 and ro.info()["read_only"] is True
        with pytest.raises(StoreError, match="read-only"):
            ro.ensure_template("attn_fwd", "new")
        with pytest.raises(StoreError, match="read-only"):
            ro.start_trial(s.run.id, {"BLOCK_M": 128})


def test_read_only_store_on_an_empty_database_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "empty.db"
    path.touch()
    with pytest.raises(SchemaError, match="no flashtune schema.*read-only"):
        open_store(f"sqlite:///{path}", read_only=True)
    assert path.read_bytes() == b""
    with pytest.raises(StoreError, match="missing.db does not exist .unable to open"):
        open_store(f"sqlite:///{tmp_path / 'missing.db'}", read_only=True)
    with pytest.raises(SchemaError, match="`flashtune --db .* db upgrade`"):
        open_store(f"sqlite:///{path}", create=False)


# -- latest_run and import_best (what export and import of config files rely on) ------------

KEY_SMALL = {**KEY, "seqlen_q": 77, "seqlen_k": 133}
BUCKET_SMALL = "fp16-d128-causal-hq32-hkv8-b4-nq128-nk256"
TUNED_AT = datetime(2025, 1, 31, 12, 0, 0, 123456, tzinfo=timezone(timedelta(hours=2)))


def imported(*, device: DeviceFingerprint = H100, key: dict | None = None,
             bucket: str = BUCKET, ms: float = 1.0, source_hash: str = "5f0c2a9e41d7b3c8",
             **changes: Any) -> ImportedBest:
    entry = ImportedBest(*device.hardware_key(), template_name="attn_fwd",
                         source_hash=source_hash, problem_key=key or KEY, bucket=bucket,
                         config={"BLOCK_M": 64, "ms": ms}, median_ms=ms, tflops=300.0,
                         trials_count=40, tuned_at=TUNED_AT)
    return replace(entry, **changes)


def test_latest_run_is_the_last_started_of_device_and_template(store: TuningStore,
                                                               study: Study) -> None:
    assert store.latest_run(study.device.id, study.template.id) == study.run
    later = make_study(store, key=KEY_SMALL, bucket=BUCKET_SMALL)  # another problem counts
    a100 = make_study(store, device=A100)  # another device does not
    assert store.latest_run(study.device.id, study.template.id) == later.run
    assert store.latest_run(a100.device.id, study.template.id) == a100.run
    assert store.latest_run(study.device.id, 10_000) is None


def test_import_best_finds_or_creates_identities(store: TuningStore) -> None:
    h100 = store.ensure_device(H100)
    outcomes = store.import_best([imported(), imported(device=A100),
                                  imported(key=KEY_SMALL, bucket=BUCKET_SMALL, ms=2.0)])
    assert outcomes == ["added", "added", "added"]
    devices = store.list_devices()
    assert devices[0] == h100 and [d.hardware_key() for d in devices] == \
        [H100.hardware_key(), A100.hardware_key()]
    assert [(t.name, t.source_hash) for t in store.list_templates()] == \
        [("attn_fwd", "5f0c2a9e41d7b3c8")]
    assert [(p.key, p.bucket) for p in store.list_problems()] == \
        [(KEY, BUCKET), (KEY_SMALL, BUCKET_SMALL)]
    best = store.list_best(device_name=H100.name)
    assert [(b.problem.key, b.config, b.median_ms, b.tflops, b.trial_id, b.trials_count)
            for b in best] == [(KEY_SMALL, {"BLOCK_M": 64, "ms": 2.0}, 2.0, 300.0, None, 40),
                               (KEY, {"BLOCK_M": 64, "ms": 1.0}, 1.0, 300.0, None, 40)]
    assert best[0].tuned_at == TUNED_AT and best[0].tuned_at.tzinfo == timezone.utc
    assert store.import_best([]) == []


@pytest.mark.parametrize("policy, ms, outcome, stored_ms", [
    ("keep-faster", 0.5, "replaced", 0.5),
    ("keep-faster", 1.0, "kept", 1.0),  # equal is not faster
    ("keep-faster", 3.0, "kept", 1.0),
    ("overwrite", 3.0, "replaced", 3.0),
    ("skip", 0.5, "skipped", 1.0),
])
def test_import_best_policies(store: TuningStore, study: Study, policy: str, ms: float,
                              outcome: str, stored_ms: float) -> None:
    trial = store.record_trial(study.run.id, {"BLOCK_M": 64}, TrialState.COMPLETE, median_ms=1.0)
    store.offer_best(*study.ids, config={"BLOCK_M": 64}, median_ms=1.0, tflops=None,
                     trial_id=trial.id, trials_count=3)
    assert store.import_best([imported(ms=ms)], policy=policy) == [outcome]
    best = store.get_best(*study.ids)
    assert best is not None and best.median_ms == stored_ms
    replaced = outcome == "replaced"
    assert best.trial_id == (None if replaced else trial.id)
    assert best.trials_count == (40 if replaced else 3)


def test_import_best_applies_entries_in_order(store: TuningStore) -> None:
    batch = [imported(ms=2.0), imported(ms=1.0), imported(ms=1.5)]
    assert store.import_best(batch) == ["added", "replaced", "kept"]
    assert [b.median_ms for b in store.list_best()] == [1.0]
    assert store.import_best(batch, policy="overwrite") == ["replaced"] * 3
    assert [b.median_ms for b in store.list_best()] == [1.5]
    assert store.import_best(batch, policy="skip") == ["skipped"] * 3


# -- the software a best config was tuned under ----------------------------------------------

TUNED_UNDER = SoftwareVersions(cuda="12.6", driver="560.35.03", flashtune="0.3.0",
                               torch="2.6.0+cu126", triton="3.2.0")


def test_a_best_config_keeps_the_software_of_its_trials_run(store: TuningStore) -> None:
    s = make_study(store)
    run = store.create_run(*s.ids, study_name="s", sampler="tpe", flashtune_version="0.3.0",
                           torch_version="2.6.0+cu126", triton_version="3.2.0",
                           cuda_version="12.6", driver_version="560.35.03")
    trial = store.record_trial(run.id, {"BLOCK_M": 64}, TrialState.COMPLETE, median_ms=2.0)
    assert store.offer_best(*s.ids, config=trial.config, median_ms=2.0, tflops=None,
                            trial_id=trial.id, trials_count=1)
    best = store.get_best(*s.ids)
    assert best is not None and best.software == TUNED_UNDER
    assert store.list_best() == [best]
    # a faster config of a later run, under other software, takes over with its software
    later = store.create_run(*s.ids, study_name="s", sampler="tpe", torch_version="2.7.0")
    faster = store.record_trial(later.id, {"BLOCK_M": 128}, TrialState.COMPLETE,
                                median_ms=1.0)
    slower = store.record_trial(later.id, {"BLOCK_M": 32}, TrialState.COMPLETE, median_ms=3.0)
    assert not store.offer_best(*s.ids, config=slower.config, median_ms=3.0, tflops=None,
                                trial_id=slower.id, trials_count=3)
    assert store.get_best(*s.ids) == best  # kept, software and all
    assert store.offer_best(*s.ids, config=faster.config, median_ms=1.0, tflops=None,
                            trial_id=faster.id, trials_count=3)
    now = store.get_best(*s.ids)
    assert now is not None and now.software == SoftwareVersions(
        flashtune=later.flashtune_version, torch="2.7.0")


def test_an_offer_timed_beside_the_stored_best_refreshes_it(store: TuningStore) -> None:
    """``refreshes``: compare and swap on the stored config; keep-faster once it changed."""
    s = make_study(store)
    run = store.create_run(*s.ids, study_name="s", sampler="tpe")
    a = store.record_trial(run.id, {"BLOCK_M": 64}, TrialState.COMPLETE, median_ms=1.0)
    b = store.record_trial(run.id, {"BLOCK_M": 128}, TrialState.COMPLETE, median_ms=1.1)
    assert store.offer_best(*s.ids, config=a.config, median_ms=1.0, tflops=None,
                            trial_id=a.id, trials_count=2)
    # a later measurement of the same config, slower: without refreshes the record stays
    assert not store.offer_best(*s.ids, config=a.config, median_ms=1.2, tflops=None,
                                trial_id=a.id, trials_count=2)
    assert store.get_best(*s.ids).median_ms == 1.0
    # timed beside the stored best: the record follows the fresh figure
    assert store.offer_best(*s.ids, config=a.config, median_ms=1.2, tflops=None,
                            trial_id=a.id, trials_count=2, refreshes=a.config)
    assert store.get_best(*s.ids).median_ms == 1.2
    # b beat a in one measurement, though slower than a's old record: it replaces a
    assert store.offer_best(*s.ids, config=b.config, median_ms=1.15, tflops=None,
                            trial_id=b.id, trials_count=2, refreshes=a.config)
    best = store.get_best(*s.ids)
    assert (best.config, best.median_ms) == (b.config, 1.15)
    # an offer measured against a config that is no longer the best: keep-faster
    assert not store.offer_best(*s.ids, config=a.config, median_ms=1.18, tflops=None,
                                trial_id=a.id, trials_count=2, refreshes=a.config)
    assert store.get_best(*s.ids).config == b.config


def test_offer_best_takes_explicit_software_and_none_without_a_trial(store: TuningStore,
                                                                     study: Study) -> None:
    assert store.offer_best(*study.ids, config={"BLOCK_M": 64}, median_ms=2.0, tflops=None,
                            trial_id=None, trials_count=0)
    best = store.get_best(*study.ids)
    assert best is not None and best.software == SoftwareVersions()
    trial = store.record_trial(study.run.id, {"BLOCK_M": 16}, TrialState.COMPLETE,
                               median_ms=1.0)
    assert store.offer_best(*study.ids, config=trial.config, median_ms=1.0, tflops=None,
                            trial_id=trial.id, trials_count=2, software=TUNED_UNDER)
    best = store.get_best(*study.ids)
    assert best is not None and best.software == TUNED_UNDER


def test_import_best_keeps_each_entrys_software(store: TuningStore) -> None:
    other = replace(TUNED_UNDER, triton="3.1.0", driver="")
    assert store.import_best([imported(software=TUNED_UNDER),
                              imported(key=KEY_SMALL, bucket=BUCKET_SMALL, software=other),
                              imported(device=A100)]) == ["added"] * 3
    by_device = {(b.device.name, b.problem.bucket): b.software for b in store.list_best()}
    assert by_device == {(H100.name, BUCKET): TUNED_UNDER, (H100.name, BUCKET_SMALL): other,
                         (A100.name, BUCKET): SoftwareVersions()}
    # a replacement brings its software; a kept entry keeps the stored one
    assert store.import_best([imported(ms=0.5, software=other),
                              imported(ms=0.7, software=SoftwareVersions())]) == \
        ["replaced", "kept"]
    [best] = [b for b in store.list_best(device_name=H100.name) if b.problem.bucket == BUCKET]
    assert best.software == other


def test_software_versions_up_to_200_characters_are_kept_whole(store: TuningStore) -> None:
    longest = SoftwareVersions(torch="2." + "9" * 198, triton="t" * 200)
    assert store.import_best([imported(software=longest)]) == ["added"]
    assert [b.software for b in store.list_best()] == [longest]
    with pytest.raises(ValueError, match="software.torch must be a string of at most 200"):
        store.import_best([imported(device=A100),
                           imported(software=SoftwareVersions(torch="2" * 201))])
    assert len(store.list_best()) == 1 and len(store.list_devices()) == 1
    study = make_study(store, key=KEY_SMALL, bucket=BUCKET_SMALL)
    with pytest.raises(ValueError, match="software.cuda"):
        store.offer_best(*study.ids, config={"BLOCK_M": 64}, median_ms=1.0, tflops=None,
                         trial_id=None, trials_count=1,
                         software=SoftwareVersions(cuda=12.4))  # type: ignore[arg-type]
    assert store.get_best(*study.ids) is None


def test_software_versions_convert_to_and_from_a_software_block() -> None:
    from flashtune.db.exchange_checks import SOFTWARE_KEYS

    assert tuple(TUNED_UNDER.as_dict()) == SOFTWARE_KEYS
    assert SoftwareVersions.from_dict(TUNED_UNDER.as_dict()) == TUNED_UNDER
    assert SoftwareVersions.from_dict({"torch": "2.5.1"}) == SoftwareVersions(torch="2.5.1")
    with pytest.raises(ValueError, match="unknown software keys \\['python'\\]"):
        SoftwareVersions.from_dict({"python": "3.11"})


@pytest.mark.parametrize("bad, match", [
    (dict(median_ms=math.nan), "median_ms"),
    (dict(median_ms=0.0), "median_ms"),
    (dict(tflops=math.inf), "tflops"),
    (dict(trials_count=-1), "trials_count"),
    (dict(tuned_at=datetime(2025, 1, 1)), "tuned_at"),
    (dict(config={"BLOCK_M": math.nan}), "JSON"),
])
def test_import_best_checks_every_entry_before_writing(store: TuningStore, bad: dict,
                                                       match: str) -> None:
    with pytest.raises(ValueError, match=match):
        store.import_best([imported(device=A100), imported(**bad)])
    assert (store.list_devices(), store.list_problems(), store.list_best()) == ([], [], [])


def test_import_best_rejects_an_unknown_policy(store: TuningStore) -> None:
    with pytest.raises(ValueError, match="keep-faster, overwrite, skip"):
        store.import_best([imported()], policy="newest")
    assert store.list_best() == []


def test_import_best_on_a_read_only_store_raises_store_error(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'ft.db'}"
    open_store(url).close()
    with open_store(url, read_only=True) as ro:
        with pytest.raises(StoreError, match="read-only"):
            ro.import_best([imported()])
        with pytest.raises(StoreError, match="read-only"):
            ro.import_best([])

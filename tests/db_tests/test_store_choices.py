"""Store contract, part 3: op choices (put, list, upsert, checks, imports).

Every test taking ``store`` runs on every backend (see conftest.py).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import replace
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest

from flashtune.core.errors import InputError, StoreError
from flashtune.db import ChoiceRecord, SoftwareVersions, open_store
from flashtune.db.records import ImportedBest, ImportedChoice
from flashtune.db.store import TuningStore
from tests.db_tests.support import A100, BUCKET, H100, KEY

FWD_HASH = "26cc4bcd80fd449b"
CFG = {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3}
DECODE_KEY = {**KEY, "seqlen_q": 1, "seqlen_k": 8192}
CANDIDATES = ({"implementation": "attn_fwd", "config": CFG, "median_ms": 1.0},
              {"implementation": "attn_fwd_gluon", "config": {"BLOCK_M": 128},
               "median_ms": 1.07},
              {"implementation": "sdpa_cudnn", "config": {}, "median_ms": 1.3})
UNDER = SoftwareVersions(cuda="12.6", driver="560.35.03", flashtune="0.5.0",
                         torch="2.6.0+cu126", triton="3.2.0")
DECIDED = datetime(2027, 1, 10, 12, 0, 0, 250000, tzinfo=timezone(timedelta(hours=-5)))


def put(store: TuningStore, device_id: int, op: str = "fwd", key: dict | None = None,
        **changes: Any) -> ChoiceRecord:
    kwargs: dict[str, Any] = dict(
        implementation="attn_fwd", source_hash=FWD_HASH, config=CFG, median_ms=1.0,
        tflops=440.5, runner_up="attn_fwd_gluon", runner_up_ms=1.07, extern="sdpa_cudnn",
        extern_ms=1.3, candidates=CANDIDATES, software=UNDER)
    kwargs.update(changes)
    return store.put_choice(device_id, op, key or KEY, **kwargs)


def test_put_choice_returns_the_stored_decision(store: TuningStore) -> None:
    device = store.ensure_device(H100)
    before = datetime.now(timezone.utc)
    choice = put(store, device.id)
    assert (choice.device, choice.op, choice.problem_key, choice.bucket) == \
        (device, "fwd", KEY, BUCKET)
    assert (choice.implementation, choice.source_hash, choice.config) == \
        ("attn_fwd", FWD_HASH, CFG)
    assert (choice.median_ms, choice.tflops, choice.runner_up, choice.runner_up_ms,
            choice.extern, choice.extern_ms) == (1.0, 440.5, "attn_fwd_gluon", 1.07,
                                                 "sdpa_cudnn", 1.3)
    assert choice.candidates == CANDIDATES and choice.software == UNDER
    assert choice.margin == pytest.approx(1.07) and choice.extern_margin == pytest.approx(1.3)
    assert choice.decided_at.tzinfo == timezone.utc
    assert before - timedelta(seconds=1) <= choice.decided_at <= \
        datetime.now(timezone.utc) + timedelta(seconds=1)
    assert store.list_choices() == [choice]
    assert store.info()["counts"]["ft_choices"] == 1


def test_margins_are_none_without_rivals_and_one_when_the_extern_wins(
        store: TuningStore) -> None:
    device = store.ensure_device(H100)
    alone = put(store, device.id, runner_up=None, runner_up_ms=None, extern=None,
                extern_ms=None, candidates=(), software=None)
    assert (alone.margin, alone.extern_margin, alone.candidates) == (None, None, ())
    assert alone.software == SoftwareVersions()  # None: unknown
    extern = put(store, device.id, implementation="sdpa_cudnn", source_hash="e" * 16,
                 config={}, median_ms=0.9, runner_up="attn_fwd", runner_up_ms=1.0,
                 extern="sdpa_cudnn", extern_ms=0.9)
    assert extern.config == {} and extern.extern_margin == 1.0
    assert extern.margin == pytest.approx(1.0 / 0.9)


def test_a_new_decision_replaces_the_old_one_whatever_its_time(store: TuningStore) -> None:
    device = store.ensure_device(H100)
    first = put(store, device.id)
    second = put(store, device.id, key=dict(reversed(list(KEY.items()))),
                 implementation="attn_fwd_gluon", config={"BLOCK_M": 64}, median_ms=1.2,
                 runner_up="attn_fwd", runner_up_ms=1.25)
    assert second.id == first.id and second.decided_at >= first.decided_at
    assert store.list_choices() == [second]
    assert (second.implementation, second.median_ms, second.runner_up) == \
        ("attn_fwd_gluon", 1.2, "attn_fwd")


def test_choices_are_keyed_on_device_op_and_problem(store: TuningStore) -> None:
    h100, a100 = store.ensure_device(H100), store.ensure_device(A100)
    a = put(store, h100.id)
    b = put(store, h100.id, op="decode", key=DECODE_KEY, implementation="attn_decode",
            config={"BLOCK_N": 64})
    c = put(store, a100.id)
    d = put(store, h100.id, key={**KEY, "seqlen_q": 77})
    assert len({a.id, b.id, c.id, d.id}) == 4
    # sorted by device name, op, bucket, key: A100 first, then the H100's decode choice
    assert store.list_choices() == [c, b, d, a]
    assert store.list_choices(device_name=H100.name) == [b, d, a]
    assert store.list_choices(op="fwd") == [c, d, a]
    assert store.list_choices(device_name=H100.name, op="decode") == [b]
    assert store.list_choices(device_name="nope") == []
    with pytest.raises(InputError, match="op 'bwd' is not a user op; expected one of fwd, "
                                         "train, decode"):
        store.list_choices(op="bwd")


@pytest.mark.parametrize("bad, error, match", [
    (dict(op="bwd"), InputError, "not a user op"),
    (dict(op="FWD"), InputError, "not a user op"),
    (dict(key={**KEY, "dtype": "fp8"}), ValueError, "not an attention problem's key"),
    (dict(key={k: v for k, v in KEY.items() if k != "causal"}), ValueError, "attention"),
    (dict(key={**KEY, "page_size": 16}), ValueError, "unknown keys \\['page_size'\\]"),
    (dict(median_ms=math.nan), ValueError, "median_ms"),
    (dict(median_ms=0.0), ValueError, "median_ms"),
    (dict(tflops=math.inf), ValueError, "tflops"),
    (dict(runner_up_ms=None), ValueError, "runner_up and runner_up_ms go together"),
    (dict(extern=None), ValueError, "extern and extern_ms go together"),
    (dict(runner_up="attn_fwd"), ValueError, "winner itself"),
    (dict(runner_up_ms=-1.0), ValueError, "runner_up_ms"),
    (dict(implementation=""), ValueError, "implementation"),
    (dict(implementation="x" * 201), ValueError, "implementation"),
    (dict(source_hash="f" * 65), ValueError, "source_hash"),
    (dict(config={"BLOCK_M": True}), ValueError, "config"),
    (dict(config={"BLOCK_M": 1.5}), ValueError, "config"),
    (dict(candidates=[{"implementation": "attn_fwd"}]), ValueError, "candidates\\[0\\]"),
    (dict(candidates=[{**CANDIDATES[0], "median_ms": math.nan}]), ValueError,
     "candidates\\[0\\].median_ms"),
    (dict(candidates="attn_fwd"), ValueError, "candidates"),
    (dict(software=SoftwareVersions(torch="t" * 201)), ValueError, "software.torch"),
])
def test_put_choice_checks_before_writing(store: TuningStore, bad: dict, error: type,
                                          match: str) -> None:
    device = store.ensure_device(H100)
    args = {"op": "fwd", "key": KEY, **bad}
    with pytest.raises(error, match=match):
        put(store, device.id, **args)
    assert store.list_choices() == []


def test_a_failed_candidate_may_have_no_time(store: TuningStore) -> None:
    device = store.ensure_device(H100)
    candidates = [*CANDIDATES, {"implementation": "sdpa_flash", "config": {},
                                "median_ms": None, "state": "RUNTIME_ERROR"}]
    assert put(store, device.id, candidates=candidates).candidates[-1] == \
        {"implementation": "sdpa_flash", "config": {}, "median_ms": None,
         "state": "RUNTIME_ERROR"}


def test_put_choice_of_an_unknown_device_is_a_store_error(store: TuningStore) -> None:
    with pytest.raises(StoreError, match="no row 10000 in ft_devices"):
        put(store, 10_000)
    assert store.list_choices() == []


def test_choice_records_are_frozen(store: TuningStore) -> None:
    choice = put(store, store.ensure_device(H100).id)
    assert dataclasses.is_dataclass(choice)
    with pytest.raises(dataclasses.FrozenInstanceError):
        choice.implementation = "sdpa_math"  # type: ignore[misc]


def test_read_only_store_lists_choices_and_refuses_to_put_them(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'ft.db'}"
    with open_store(url) as rw:
        choice = put(rw, rw.ensure_device(H100).id)
    with open_store(url, read_only=True) as ro:
        assert ro.list_choices() == [choice]
        with pytest.raises(StoreError, match="read-only"):
            put(ro, choice.device.id)
        with pytest.raises(StoreError, match="read-only"):
            ro.import_choices([imported()])


# -- import_choices (what importing op choice files relies on) --------------------------------

def imported(*, device: Any = H100, ms: float = 1.0, **changes: Any) -> ImportedChoice:
    entry = ImportedChoice(*device.hardware_key(), op="fwd", problem_key=KEY,
                           implementation="attn_fwd", source_hash=FWD_HASH, config=CFG,
                           median_ms=ms, tflops=300.0, decided_at=DECIDED,
                           runner_up="sdpa_cudnn", runner_up_ms=ms * 1.2, software=UNDER)
    return replace(entry, **changes)


def test_import_choices_finds_or_creates_devices_and_keeps_time_and_software(
        store: TuningStore) -> None:
    h100 = store.ensure_device(H100)
    outcomes = store.import_choices([imported(), imported(device=A100, ms=2.0),
                                     imported(op="decode", problem_key=DECODE_KEY)])
    assert outcomes == ["added", "added", "added"]
    assert store.list_devices()[0] == h100 and len(store.list_devices()) == 2
    a100_choice, decode, fwd = store.list_choices()
    assert a100_choice.device.name == A100.name and a100_choice.median_ms == 2.0
    assert (decode.op, decode.problem_key) == ("decode", DECODE_KEY)
    assert fwd.decided_at == DECIDED and fwd.decided_at.tzinfo == timezone.utc
    assert (fwd.software, fwd.candidates, fwd.runner_up, fwd.margin) == \
        (UNDER, (), "sdpa_cudnn", pytest.approx(1.2))
    assert store.import_choices([]) == []


@pytest.mark.parametrize("policy, ms, outcome, stored_ms", [
    ("keep-faster", 0.5, "replaced", 0.5),
    ("keep-faster", 1.0, "kept", 1.0),  # equal is not faster
    ("keep-faster", 3.0, "kept", 1.0),
    ("overwrite", 3.0, "replaced", 3.0),
    ("skip", 0.5, "skipped", 1.0),
])
def test_import_choices_policies(store: TuningStore, policy: str, ms: float, outcome: str,
                                 stored_ms: float) -> None:
    put(store, store.ensure_device(H100).id, median_ms=1.0)
    assert store.import_choices([imported(ms=ms, implementation="sdpa_cudnn", config={},
                                          runner_up="attn_fwd")],
                                policy=policy) == [outcome]
    [choice] = store.list_choices()
    assert choice.median_ms == stored_ms
    assert choice.implementation == ("sdpa_cudnn" if outcome == "replaced" else "attn_fwd")


def test_import_choices_applies_entries_in_order(store: TuningStore) -> None:
    batch = [imported(ms=2.0), imported(ms=1.0), imported(ms=1.5)]
    assert store.import_choices(batch) == ["added", "replaced", "kept"]
    assert [c.median_ms for c in store.list_choices()] == [1.0]
    assert store.import_choices(batch, policy="overwrite") == ["replaced"] * 3
    assert [c.median_ms for c in store.list_choices()] == [1.5]
    assert store.import_choices(batch, policy="skip") == ["skipped"] * 3


@pytest.mark.parametrize("bad, match", [
    (dict(op="bwd"), "not a user op"),
    (dict(median_ms=math.nan), "median_ms"),
    (dict(decided_at=datetime(2025, 1, 1)), "decided_at"),
    (dict(runner_up_ms=None), "go together"),
])
def test_import_choices_checks_every_entry_before_writing(store: TuningStore, bad: dict,
                                                          match: str) -> None:
    with pytest.raises(ValueError, match=match):
        store.import_choices([imported(device=A100), imported(**bad)])
    assert (store.list_devices(), store.list_choices()) == ([], [])
    with pytest.raises(ValueError, match="keep-faster, overwrite, skip"):
        store.import_choices([imported()], policy="newest")
    assert store.list_choices() == []


def test_import_entries_writes_best_configs_and_choices_in_one_transaction(
        store: TuningStore) -> None:
    best = ImportedBest(*H100.hardware_key(), template_name="attn_fwd", source_hash=FWD_HASH,
                        problem_key=KEY, bucket=BUCKET, config=CFG, median_ms=1.0,
                        tflops=None, trials_count=40, tuned_at=DECIDED)
    with pytest.raises(ValueError, match="median_ms"):
        store.import_entries([best], [imported(median_ms=-1.0)])
    assert (store.list_devices(), store.list_best(), store.list_choices()) == ([], [], [])
    assert store.import_entries([best], [imported(), imported(device=A100)]) == \
        (["added"], ["added", "added"])
    assert len(store.list_devices()) == 2  # the H100 row is shared by both kinds
    assert [b.median_ms for b in store.list_best()] == [1.0]
    assert len(store.list_choices()) == 2

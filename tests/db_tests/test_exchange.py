"""Export/import of best configs (flashtune.db.exchange): naming, round trips, policies,
stale sources, all-or-nothing imports. The hostile-file corpus is test_exchange_corpus.py.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import random
from dataclasses import replace
from pathlib import Path

import pytest
from sqlalchemy.exc import OperationalError

import flashtune
from flashtune.core.device import DeviceFingerprint
from flashtune.core.errors import ImportRejected, StoreError, UnknownTemplateError
from flashtune.core.problem import AttentionProblem
from flashtune.db import SoftwareVersions, TrialState, open_store, rows
from flashtune.db.exchange import (
    ConfigDocument,
    DeviceInfo,
    ImportReport,
    config_file_name,
    document_to_json,
    export_documents,
    import_documents,
    parse_document,
    read_document,
)
from flashtune.db.records import ImportedBest
from flashtune.db.store import TuningStore
from flashtune.kernel_templates import catalog  # noqa: E402
from tests.db_tests.exchange_support import (
    CONFIGS,
    OLD_SOURCE,
    PROBLEMS,
    SOURCE,
    T0,
    VERSIONS,
    dump,
    make_document,
    populate,
    without_exported_at,
)
from tests.db_tests.support import A100, H100

SPECS = catalog()


@pytest.fixture
def url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'a.db'}"


def other_url(tmp_path: Path, name: str) -> str:
    return f"sqlite:///{tmp_path / name}"


def export(url: str, **filters: str) -> list[ConfigDocument]:
    with open_store(url, read_only=True) as store:
        return export_documents(store, **filters, specs=SPECS)


def import_(url: str, docs: list[ConfigDocument], policy: str = "keep-faster") -> ImportReport:
    with open_store(url) as store:
        return import_documents(store, [(d.file_name(), d) for d in docs], policy=policy, specs=SPECS)


def best_ms(url: str, device: str = H100.name) -> dict[int, float]:
    """{index in PROBLEMS: stored median_ms} of one device."""
    keys = [p.key() for p in PROBLEMS]
    with open_store(url, read_only=True) as store:
        return {keys.index(b.problem.key): b.median_ms for b in store.list_best(device_name=device)}


# -- the naming function --------------------------------------------------------------------

@pytest.mark.parametrize("device", ["NVIDIA_H100_80GB_HBM3", "NVIDIA_A100-SXM4-80GB",
                                    "cpu-interpreter", "gfx90a+sramecc", "7", "a" * 200])
def test_config_file_name_accepts_safe_names(device: str) -> None:
    assert config_file_name(device, "attn_fwd") == f"device_name={device},template=attn_fwd.json"


@pytest.mark.parametrize("device", ["..", "a..b", "../etc", "a/b", "/abs", "a\\b", "C:x",
                                    "x\x00", "", "a" * 201, ".hidden", "-rf", "a b", "a\n",
                                    "H100\u2028", "\u0661\u0662", "a,b", "a=b"])
def test_config_file_name_refuses_unsafe_names(device: str) -> None:
    with pytest.raises(ValueError, match="cannot be part of a config file name; expected 1-200"):
        config_file_name(device, "attn_fwd")
    with pytest.raises(ValueError, match="template name"):
        config_file_name("NVIDIA_H100_80GB_HBM3", device)


def test_config_file_name_refuses_non_strings() -> None:
    with pytest.raises(ValueError):
        config_file_name(None, "attn_fwd")  # type: ignore[arg-type]


# -- documents ------------------------------------------------------------------------------

def test_document_json_is_deterministic_and_parses_back() -> None:
    doc = make_document(n=5)
    shuffled = list(doc.entries)
    random.Random(0).shuffle(shuffled)
    text = document_to_json(doc)
    assert document_to_json(replace(doc, entries=tuple(shuffled))) == text
    assert text.endswith("}\n") and text.startswith('{\n "device": {\n  "compute_capability"')
    data = json.loads(text)
    assert list(data) == sorted(data)
    assert data["format"] == "flashtune-configs" and data["schema_version"] == 1
    assert data["template"] == {"name": "attn_fwd", "source_hash": SOURCE}
    assert data["exported_at"] == "2025-01-31T12:00:00+00:00"
    keys = [json.dumps(e["problem"], sort_keys=True, separators=(",", ":"))
            for e in data["entries"]]
    assert keys == sorted(keys)
    parsed = parse_document(text, specs=SPECS)
    assert parse_document(text.encode(), specs=SPECS) == parsed
    assert parsed.file_name() == "device_name=NVIDIA_H100_80GB_HBM3,template=attn_fwd.json"
    # optional knobs are filled in by the space's validation
    assert all(set(e.config) >= {"USE_TMA", "REVERSE_M"} for e in parsed.entries)
    assert document_to_json(parsed) == document_to_json(parse_document(document_to_json(parsed), specs=SPECS))
    assert dataclasses.is_dataclass(parsed) and parsed.device.hardware_key() == \
        ("NVIDIA_H100_80GB_HBM3", "9.0", 132, 232448, 85520809984)


def test_document_to_json_refuses_what_it_could_not_read_back() -> None:
    doc = make_document()
    with pytest.raises(ValueError, match="software"):
        document_to_json(replace(doc, software={"python": "3.11"}))
    bad = replace(doc.entries[0], median_ms=math.nan)
    with pytest.raises(ValueError):
        document_to_json(replace(doc, entries=(bad,)))


def test_an_entry_has_its_own_software_only_where_it_differs() -> None:
    doc = parse_document(document_to_json(make_document(n=3)), specs=SPECS)
    other = {**doc.software, "triton": "3.3.0", "driver": ""}
    entries = (replace(doc.entries[0], software=None),  # None: the document's
               replace(doc.entries[1], software=dict(doc.software)),
               replace(doc.entries[2], software={"triton": "3.3.0", "torch": "2.5.1",
                                                 "flashtune": "0.1.0", "cuda": "12.4"}))
    text = document_to_json(replace(doc, entries=entries))
    data = json.loads(text)
    assert data["schema_version"] == 2 and data["software"] == doc.software
    own = {PROBLEMS.index(AttentionProblem.from_key(e["problem"])): e.get("software")
           for e in data["entries"]}
    assert own == {0: None, 1: None, 2: other}  # missing keys written empty
    parsed = parse_document(text, specs=SPECS)
    assert [e.software for e in parsed.entries] == [doc.software, doc.software, other]
    assert document_to_json(parsed) == text
    # one software for all: schema_version 1, no entry's own block, as before
    plain = document_to_json(replace(doc, entries=entries[:2]))
    assert json.loads(plain)["schema_version"] == 1 and '"software"' not in \
        plain.split('"entries"')[1].split('"exported_at"')[0]
    with pytest.raises(ValueError, match="unknown software keys \\['python'\\]"):
        document_to_json(replace(doc, entries=(replace(entries[0], software={"python": "3"}),)))


def test_a_version_2_file_is_read_and_written_in_its_one_form() -> None:
    """An entry's own software equal to the document's is allowed, and dropped on writing
    (which then writes version 1): a document has one text."""
    text = document_to_json(parse_document(document_to_json(make_document(n=2)),
                                           specs=SPECS))
    data = json.loads(text)
    data["schema_version"] = 2
    data["entries"][0]["software"] = dict(data["software"])
    parsed = parse_document(json.dumps(data), specs=SPECS)
    assert parsed.entries[0].software == parsed.entries[1].software == parsed.software
    assert document_to_json(parsed) == text


def test_read_document_names_the_file_and_refuses_non_files(tmp_path: Path) -> None:
    path = tmp_path / "x.json"
    path.write_text(document_to_json(make_document()))
    assert read_document(path, specs=SPECS) == read_document(str(path), specs=SPECS) == parse_document(path.read_bytes(), specs=SPECS)
    with pytest.raises(ImportRejected, match=f"^{tmp_path}: is not a regular file"):
        read_document(tmp_path, specs=SPECS)
    with pytest.raises(ImportRejected, match="cannot be read"):
        read_document(tmp_path / "missing.json", specs=SPECS)
    if hasattr(os, "mkfifo"):
        fifo = tmp_path / "fifo.json"
        os.mkfifo(fifo)
        with pytest.raises(ImportRejected, match="not a regular file"):
            read_document(fifo, specs=SPECS)  # refused by stat, never opened (which would block)


# -- round trips, merges, policies ----------------------------------------------------------

def test_export_import_export_round_trip(tmp_path: Path, url: str) -> None:
    populate(url, H100, {0: 1.5, 1: 0.25, 2: 4.0})
    populate(url, A100, {0: 2.5, 3: 3.0})
    populate(url, A100, {4: 9.0}, source=OLD_SOURCE)  # stale: never exported
    docs = export(url)
    assert [d.file_name() for d in docs] == [
        "device_name=NVIDIA_A100-SXM4-80GB,template=attn_fwd.json",
        "device_name=NVIDIA_H100_80GB_HBM3,template=attn_fwd.json"]
    assert [len(d.entries) for d in docs] == [2, 3]
    assert docs[1].device.hardware_key() == H100.hardware_key()
    assert docs[1].software == {"flashtune": docs[1].software["flashtune"], "torch": "2.5.1",
                                "triton": "3.1.0", "cuda": "12.4", "driver": "550.54.15"}
    assert {d.source_hash for d in docs} == {SOURCE}

    fresh = other_url(tmp_path, "b.db")
    report = import_(fresh, docs)
    assert [(f.added, f.replaced, f.kept, f.skipped, f.stale) for f in report.files] == \
        [(2, 0, 0, 0, 0), (3, 0, 0, 0, 0)]
    again = export(fresh)
    # the same text but for exported_at: the software came along although imports record
    # no run, and one software per document is still schema_version 1
    texts = [document_to_json(d) for d in docs]
    assert [without_exported_at(document_to_json(d)) for d in again] == \
        [without_exported_at(t) for t in texts]
    assert [json.loads(t)["schema_version"] for t in texts] == [1, 1]
    assert again[1].software == docs[1].software
    with open_store(fresh, read_only=True) as store:
        assert {b.trial_id for b in store.list_best()} == {None}
        assert store.list_trials() == []
        assert {b.software.torch for b in store.list_best()} == {"2.5.1"}


NEWER = dict(flashtune_version="0.9.0", torch_version="2.7.0", triton_version="3.3.0",
             cuda_version="12.8", driver_version="570.86.10")


def test_a_document_of_entries_tuned_under_two_softwares_round_trips(
        tmp_path: Path, url: str, store: TuningStore) -> None:
    """Problems 0 and 1 tuned under VERSIONS, then 2 under NEWER: the document's software
    is NEWER (its most recently tuned entry's), and 0 and 1 carry their own. Imported into
    a fresh database of each backend and exported again: the same text."""
    populate(url, H100, {0: 1.5, 1: 0.25})
    populate(url, H100, {2: 4.0}, versions=NEWER)
    (doc,) = export(url)
    text = document_to_json(doc)
    data = json.loads(text)
    older = {"flashtune": flashtune.__version__,  # create_run's default
             **{k.removesuffix("_version"): v for k, v in VERSIONS.items()}}
    newer = {k.removesuffix("_version"): v for k, v in NEWER.items()}
    assert data["schema_version"] == 2 and data["software"] == newer
    own = {PROBLEMS.index(AttentionProblem.from_key(e["problem"])): e.get("software")
           for e in data["entries"]}
    assert own == {0: older, 1: older, 2: None}
    assert {PROBLEMS.index(AttentionProblem.from_key(e.problem)): e.software
            for e in doc.entries} == {0: older, 1: older, 2: newer}

    report = import_documents(store, [("h100.json", doc)], specs=SPECS)
    assert report.total("added") == 3
    assert sorted(b.software.torch for b in store.list_best()) == ["2.5.1", "2.5.1", "2.7.0"]
    (again,) = export_documents(store, specs=SPECS)
    assert without_exported_at(document_to_json(again)) == without_exported_at(text)
    # and once more, from a file the round trip wrote
    path = tmp_path / again.file_name()
    path.write_text(document_to_json(again))
    last = other_url(tmp_path, "last.db")
    import_(last, [read_document(path, specs=SPECS)])
    (final,) = export(last)
    assert without_exported_at(document_to_json(final)) == without_exported_at(text)


SHIPPED = Path(flashtune.__file__).parent / "configs" / config_file_name(H100.name,
                                                                         "attn_fwd")


def test_the_shipped_h100_file_round_trips(tmp_path: Path, store: TuningStore) -> None:
    """Imported into a fresh database of each backend and exported, the shipped file comes
    back as it is (but for exported_at), and so does that export's own round trip."""
    shipped = SHIPPED.read_text()
    import_documents(store, [(str(SHIPPED), parse_document(shipped, specs=SPECS))],
                     specs=SPECS)
    (doc,) = export_documents(store, specs=SPECS)
    first = document_to_json(doc)
    assert without_exported_at(first) == without_exported_at(shipped)
    assert json.loads(first)["schema_version"] == 1
    software = json.loads(shipped)["software"]
    assert {b.software.as_dict() == software for b in store.list_best()} == {True}
    second = other_url(tmp_path, "second.db")
    import_(second, [parse_document(first, specs=SPECS)])
    (again,) = export(second)
    assert without_exported_at(document_to_json(again)) == without_exported_at(first)


def test_an_entry_without_known_software_is_written_with_empty_versions(url: str) -> None:
    """A best config whose software was never recorded (imported before schema 0004)
    exports empty versions: never another entry's or another run's."""
    populate(url, H100, {0: 1.0, 1: 2.0})
    with open_store(url) as store:
        assert store.import_best([_imported_entry(2)]) == ["added"]
        [best] = [b for b in store.list_best() if b.problem.key == PROBLEMS[2].key()]
        assert best.software == SoftwareVersions()
    (doc,) = export(url)
    data = json.loads(document_to_json(doc))
    blank = {k: "" for k in data["software"]}
    [entry] = [e for e in data["entries"] if e["problem"] == PROBLEMS[2].key()]
    assert data["schema_version"] == 2 and entry["software"] == blank
    assert data["software"]["torch"] == "2.5.1"  # the most recently tuned entry's


def _imported_entry(i: int) -> ImportedBest:
    """``PROBLEMS[i]`` on the H100, tuned long ago and imported without any software."""
    return ImportedBest(*H100.hardware_key(), template_name="attn_fwd", source_hash=SOURCE,
                        problem_key=PROBLEMS[i].key(), bucket=PROBLEMS[i].bucket(),
                        config=dict(CONFIGS[0]), median_ms=1.0, tflops=None,
                        trials_count=1, tuned_at=T0)


def test_export_filters(url: str) -> None:
    populate(url, H100, {0: 1.0})
    populate(url, A100, {1: 1.0})
    assert [d.device.name for d in export(url, device_name=A100.name)] == [A100.name]
    assert [d.template for d in export(url, template_name="attn_fwd")] == ["attn_fwd"] * 2
    assert export(url, device_name="NVIDIA_B200") == []
    with pytest.raises(UnknownTemplateError, match="unknown template 'attn_nope'"):
        export(url, template_name="attn_nope")


def test_export_merges_rows_that_differ_only_in_total_memory(url: str) -> None:
    populate(url, H100, {0: 2.0, 1: 1.0})
    populate(url, replace(H100, total_memory=H100.total_memory - (4 << 20)), {0: 1.0, 2: 3.0})
    (doc,) = export(url)
    assert doc.device.total_memory == H100.total_memory - (4 << 20)  # the newest row
    assert sorted(e.median_ms for e in doc.entries) == [1.0, 1.0, 3.0]
    populate(url, replace(H100, sm_count=114), {3: 1.0})
    with pytest.raises(ValueError, match="several hardware keys"):
        export(url)


def test_an_import_that_would_give_a_device_name_two_gpus_changes_nothing(url: str) -> None:
    """One name, other hardware (the audit: cc and SMs edited in a file): the import is
    refused before its transaction, so export keeps working; a file that differs only in
    total memory (drivers move it by a few MiB) still imports."""
    populate(url, H100, {0: 2.0})
    before = dump(url)
    stored = DeviceInfo(H100.name, H100.compute_capability, H100.sm_count,
                        H100.shared_mem_per_block, H100.total_memory)
    other = make_document(replace(stored, compute_capability="8.0", sm_count=108))
    with pytest.raises(ImportRejected, match="is stored in .* with other hardware"):
        import_(url, [other])
    assert dump(url) == before
    (doc,) = export(url)  # still one file for the name
    # two files of one batch that disagree with each other: refused too
    fresh = DeviceInfo("NVIDIA_B200", "10.0", 148, 232448, 1 << 37)
    with pytest.raises(ImportRejected, match="'NVIDIA_B200' is in .* with other hardware"):
        import_(url, [make_document(fresh), make_document(replace(fresh, sm_count=132))])
    assert dump(url) == before
    report = import_(url, [make_document(replace(stored, total_memory=H100.total_memory - 1))])
    assert report.total("added") == 3  # a device row of its own, merged on export
    (doc,) = export(url)
    assert len(doc.entries) == 3


def test_merging_machines_with_keep_faster_keeps_the_fastest(tmp_path: Path) -> None:
    a, b, merged = (other_url(tmp_path, n) for n in ("a.db", "b.db", "m.db"))
    populate(a, H100, {0: 1.0, 1: 2.0, 2: 3.0})
    populate(b, H100, {1: 1.5, 2: 3.5, 3: 4.0}, config=1)
    (doc_a,), (doc_b,) = export(a), export(b)
    report = import_(merged, [doc_a, doc_b])
    assert [(f.added, f.replaced, f.kept) for f in report.files] == [(3, 0, 0), (1, 1, 1)]
    assert best_ms(merged) == {0: 1.0, 1: 1.5, 2: 3.0, 3: 4.0}
    reverse = other_url(tmp_path, "r.db")
    import_(reverse, [doc_b, doc_a])
    assert best_ms(reverse) == best_ms(merged)
    lines = report.lines()
    assert lines[0] == (f"{doc_a.file_name()}: {H100.name} attn_fwd: 3 added, 0 replaced, "
                        "0 kept, 0 skipped, 0 stale")
    assert lines[-1] == ("imported 2 files (policy keep-faster): 4 added, 1 replaced, 1 kept, "
                         "0 skipped, 0 stale")
    assert report.total("added") == 4


@pytest.mark.parametrize("policy, expected, counts", [
    ("overwrite", {0: 1.0, 1: 9.0, 2: 0.5, 3: 4.0}, (1, 2, 0, 0)),
    ("skip", {0: 1.0, 1: 2.0, 2: 3.0, 3: 4.0}, (1, 0, 0, 2)),
    ("keep-faster", {0: 1.0, 1: 2.0, 2: 0.5, 3: 4.0}, (1, 1, 1, 0)),
])
def test_policies(tmp_path: Path, policy: str, expected: dict, counts: tuple) -> None:
    a, b = other_url(tmp_path, "a.db"), other_url(tmp_path, "b.db")
    populate(a, H100, {0: 1.0, 1: 2.0, 2: 3.0})
    populate(b, H100, {1: 9.0, 2: 0.5, 3: 4.0})
    (doc_b,) = export(b)
    report = import_(a, [doc_b], policy=policy)
    f = report.files[0]
    assert (f.added, f.replaced, f.kept, f.skipped) == counts
    assert best_ms(a) == expected
    assert f"(policy {policy})" in report.lines()[-1]


def test_unknown_policy_is_a_value_error_naming_the_three(url: str) -> None:
    with open_store(url) as store, pytest.raises(ValueError, match="keep-faster, overwrite, skip"):
        import_documents(store, [], policy="fastest", specs=SPECS)


def test_stale_entries_are_counted_and_not_written(url: str) -> None:
    populate(url, A100, {0: 1.0})
    before = dump(url)
    stale = parse_document(document_to_json(make_document(source=OLD_SOURCE)), specs=SPECS)
    report = import_(url, [stale])
    assert [(f.added, f.stale) for f in report.files] == [(0, 3)]
    assert "not imported" in report.lines()[-1]
    assert dump(url) == before


def test_a_read_only_store_refuses_an_import(url: str) -> None:
    populate(url, H100, {0: 1.0})
    with open_store(url, read_only=True) as store, pytest.raises(StoreError, match="read-only"):
        import_documents(store, [("x", make_document())], specs=SPECS)


# -- all or nothing -------------------------------------------------------------------------

def test_a_bad_document_in_a_batch_writes_nothing(url: str) -> None:
    populate(url, H100, {0: 1.0, 1: 1.0})
    before = dump(url)
    good = make_document(DeviceInfo("NVIDIA_B200", "10.0", 148, 232448, 1 << 37), ms=0.1)
    nan = replace(good, entries=(replace(good.entries[0], median_ms=math.nan),))
    unknown = replace(good, template="attn_nope")
    for bad, error in ((nan, ValueError), (unknown, UnknownTemplateError)):
        with pytest.raises(error):
            import_(url, [good, bad])
        assert dump(url) == before


def test_a_failure_midway_through_the_transaction_writes_nothing(
        url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    populate(url, H100, {0: 1.0, 1: 1.0})
    before = dump(url)
    real, calls = rows.best_row, []

    def failing(*args: object) -> object:
        calls.append(args)
        if len(calls) == 4:
            raise OperationalError("UPDATE ft_best_configs", {}, Exception("disk I/O error"))
        return real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(rows, "best_row", failing)
    docs = [make_document(ms=0.1),
            make_document(DeviceInfo("NVIDIA_B200", "10.0", 148, 232448, 1 << 37))]
    with pytest.raises(StoreError, match="disk I/O error"):
        import_(url, docs)
    assert len(calls) == 4  # three entries applied, then the failure
    assert dump(url) == before
    monkeypatch.undo()
    report = import_(url, docs)
    assert [report.total(c) for c in ("added", "replaced", "kept")] == [4, 1, 1]


def test_device_fingerprints_and_device_info_share_the_key_order() -> None:
    fp = DeviceFingerprint("X", "8.9", 1, 2, 3, torch_version="2.5")
    assert DeviceInfo(*fp.hardware_key()).hardware_key() == fp.hardware_key()


# -- score modifications --------------------------------------------------------------------

def test_a_problem_with_score_modifications_round_trips(tmp_path: Path, url: str) -> None:
    """Window, softcap and ALiBi are part of the key (issue 29): exported with the entry,
    read back equal; a plain problem's key has none of them (older files stay valid)."""
    mods = AttentionProblem(1, 8, 2, 4096, 4096, 128, True, "bf16", 1023, -1, 30.0, True)
    with open_store(url) as store:
        d = store.ensure_device(H100)
        t = store.ensure_template("attn_fwd", SOURCE)
        for problem, ms in ((mods, 2.0), (PROBLEMS[0], 1.0)):
            p = store.ensure_problem("attn_fwd", problem.key(), problem.bucket())
            run = store.create_run(d.id, t.id, p.id, study_name=problem.bucket(),
                                   sampler="tpe", **VERSIONS)
            trial = store.record_trial(run.id, CONFIGS[0], TrialState.COMPLETE, median_ms=ms,
                                       tflops=1.0)
            store.offer_best(d.id, t.id, p.id, config=CONFIGS[0], median_ms=ms, tflops=1.0,
                             trial_id=trial.id, trials_count=1)
    docs = export(url)
    text = document_to_json(docs[0])
    entries = json.loads(text)["entries"]
    keys = sorted((e["problem"] for e in entries), key=len)
    assert "window_left" not in keys[0] and keys[1]["window_left"] == 1023
    assert keys[1]["softcap"] == 30.0 and keys[1]["alibi"] is True
    fresh = other_url(tmp_path, "b.db")
    import_(fresh, [parse_document(text, specs=SPECS)])
    with open_store(fresh, read_only=True) as store:
        got = {AttentionProblem.from_key(b.problem.key) for b in store.list_best()}
    assert got == {mods, PROBLEMS[0]}
    bad = text.replace('"window_left": 1023', '"window_left": -5')
    with pytest.raises(ImportRejected, match="window_left is the integer -5; expected an integer from -1"):
        parse_document(bad, specs=SPECS)

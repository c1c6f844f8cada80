"""Op choice files (flashtune.db.exchange_choices, routed by flashtune.db.exchange): naming,
round trips, stale winners, every rejection, all-or-nothing imports beside per-template
files."""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from pathlib import Path

import pytest
from sqlalchemy.exc import OperationalError

from flashtune.core.errors import ImportRejected, InputError, StoreError, UnknownTemplateError
from flashtune.db import open_store, rows
from flashtune.db.exchange import (
    ChoiceDocument,
    ConfigDocument,
    ImportReport,
    choice_document_to_json,
    choice_file_name,
    document_to_json,
    export_choice_documents,
    import_documents,
    parse_document,
    read_document,
)
from flashtune.db.exchange_choices import parse_choice_document, read_choice_document
from flashtune.db.jsonutil import canonical_json
from tests.db_tests.choice_support import (
    DECODE,
    DECODE_CFG,
    DECODE_PROBLEMS,
    EXTERN,
    EXTERN_HASH,
    FWD,
    FWD_CFG,
    FWD_PROBLEMS,
    OLD,
    SPECS,
    UNDER,
    choice_document,
    decide,
    entry,
    extern_spec,
    fill,
)
from tests.db_tests.exchange_support import dump, make_document, without_exported_at
from tests.db_tests.support import A100, H100


@pytest.fixture
def url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'a.db'}"


def export(url: str, **filters: str) -> list[ChoiceDocument]:
    with open_store(url, read_only=True) as store:
        return export_choice_documents(store, specs=SPECS, **filters)


def import_(url: str, docs: list, policy: str = "keep-faster") -> ImportReport:
    with open_store(url) as store:
        return import_documents(store, [(d.file_name(), d) for d in docs], specs=SPECS,
                                policy=policy)


def stored(url: str, **filters: str) -> dict[tuple[str, str, int], tuple]:
    """{(device, op, problem index): (implementation, median_ms)} of the store."""
    problems = {"fwd": [p.key() for p in FWD_PROBLEMS],
                "decode": [p.key() for p in DECODE_PROBLEMS]}
    with open_store(url, read_only=True) as store:
        return {(c.device.name, c.op, problems[c.op].index(c.problem_key)):
                (c.implementation, c.median_ms) for c in store.list_choices(**filters)}


def parse(doc_or_text: ChoiceDocument | str | dict) -> ChoiceDocument:
    text = doc_or_text if isinstance(doc_or_text, str) else \
        json.dumps(doc_or_text) if isinstance(doc_or_text, dict) else \
        choice_document_to_json(doc_or_text)
    doc = parse_document(text, specs=SPECS, origin="f.json")
    assert isinstance(doc, ChoiceDocument)
    return doc


def data(*entries, **kwargs) -> dict:
    return json.loads(choice_document_to_json(choice_document(*entries, **kwargs)))


# -- the naming function --------------------------------------------------------------------

@pytest.mark.parametrize("device", ["NVIDIA_H100_80GB_HBM3", "NVIDIA_A100-SXM4-80GB",
                                    "cpu-interpreter", "a" * 200])
def test_choice_file_name(device: str) -> None:
    assert choice_file_name(device, "fwd") == f"device_name={device},op=fwd.json"
    assert choice_file_name(device, "decode") == f"device_name={device},op=decode.json"


@pytest.mark.parametrize("device", ["..", "../etc", "a/b", "", "a,b", "a=b", "x\x00"])
def test_choice_file_name_refuses_unsafe_names(device: str) -> None:
    with pytest.raises(ValueError, match="cannot be part of a config file name"):
        choice_file_name(device, "fwd")


@pytest.mark.parametrize("op", ["bwd", "FWD", "", "fwd/..", None])
def test_choice_file_name_refuses_what_is_not_a_user_op(op: object) -> None:
    with pytest.raises(ValueError, match="not a user op; expected one of fwd, train, decode"):
        choice_file_name("H100", op)  # type: ignore[arg-type]


# -- documents ------------------------------------------------------------------------------

def test_a_document_is_deterministic_json_that_parses_back() -> None:
    doc = choice_document(entry(FWD_PROBLEMS[2]), entry(FWD_PROBLEMS[0]),
                          entry(FWD_PROBLEMS[1], implementation=EXTERN, config={},
                                runner_up="attn_fwd", runner_up_ms=1.1, median_ms=1.0))
    text = choice_document_to_json(doc)
    assert text == choice_document_to_json(replace(doc, entries=doc.entries[::-1]))
    d = json.loads(text)
    assert list(d) == sorted(d) and text.endswith("}\n")
    assert (d["format"], d["schema_version"], d["op"]) == ("flashtune-choices", 1, "fwd")
    with_candidates = replace(doc, entries=(replace(doc.entries[0], candidates=(
        {"implementation": "attn_fwd", "config": dict(FWD_CFG), "median_ms": 1.0},)),
        *doc.entries[1:]))
    d2 = json.loads(choice_document_to_json(with_candidates))  # an entry with candidates
    assert d2["schema_version"] == 2
    back = parse_choice_document(choice_document_to_json(with_candidates), specs=SPECS)
    assert [e.candidates for e in back.entries if e.candidates] == \
        [with_candidates.entries[0].candidates]
    assert d["implementations"] == {"attn_fwd": FWD, EXTERN: EXTERN_HASH}
    assert set(d["entries"][0]) == {"problem", "implementation", "config", "median_ms",
                                    "tflops", "runner_up", "runner_up_ms", "extern",
                                    "extern_ms", "decided_at"}
    parsed = parse(text)
    assert parsed.file_name() == "device_name=NVIDIA_H100_80GB_HBM3,op=fwd.json"
    # configs come back validated: attn_fwd's optional knobs filled in
    assert {e.implementation: e.config for e in parsed.entries}[EXTERN] == {}
    assert all(set(e.config) >= {"USE_TMA", "REVERSE_M"} for e in parsed.entries
               if e.implementation == "attn_fwd")
    assert all(e.software == UNDER.as_dict() for e in parsed.entries)
    assert choice_document_to_json(parsed) == choice_document_to_json(parse(parsed))


def test_read_document_routes_by_format(tmp_path: Path) -> None:
    choice = tmp_path / "c.json"
    choice.write_text(choice_document_to_json(choice_document()))
    template = tmp_path / "t.json"
    template.write_text(document_to_json(make_document()))
    assert isinstance(read_document(choice, specs=SPECS), ChoiceDocument)
    assert isinstance(read_document(template, specs=SPECS), ConfigDocument)
    assert read_choice_document(choice, specs=SPECS) == read_document(choice, specs=SPECS)
    with pytest.raises(ImportRejected, match="format is the string 'flashtune-configs'; "
                                             "expected 'flashtune-choices'"):
        read_choice_document(template, specs=SPECS)
    with pytest.raises(ImportRejected, match="not a regular file"):
        read_choice_document(tmp_path, specs=SPECS)


def test_an_entry_has_its_own_software_only_where_it_differs() -> None:
    other = {**UNDER.as_dict(), "torch": "2.7.0"}
    doc = choice_document(entry(FWD_PROBLEMS[0], software=other),
                          entry(FWD_PROBLEMS[1], software=UNDER.as_dict()))
    d = json.loads(choice_document_to_json(doc))
    assert [e.get("software") for e in d["entries"]] == [None, other]  # sorted by key
    assert [e.software for e in parse(d).entries] == [UNDER.as_dict(), other]


# -- rejections: one line, naming what is wrong -------------------------------------------------

def without(d: dict, key: str) -> dict:
    return {k: v for k, v in d.items() if k != key}


def with_entry(d: dict, **changes) -> dict:
    return {**d, "entries": [{**d["entries"][0], **changes}, *d["entries"][1:]]}


def with_candidates(d: dict, candidates) -> dict:
    """``d`` with its first entry's candidates, as schema version 2."""
    return {**with_entry(d, candidates=candidates), "schema_version": 2}


GOOD = data()
BAD = [
    ("unknown-implementation",
     {**GOOD, "implementations": {**GOOD["implementations"], "no_such_impl": FWD}},
     "implementations names 'no_such_impl', an unknown implementation; expected one of "
     f"attn_fwd, .*{EXTERN} \\(the implementations of op fwd\\)"),
    ("not-serving-the-op",
     {**GOOD, "implementations": {**GOOD["implementations"], "attn_decode": DECODE}},
     "implementations names 'attn_decode', which does not serve op 'fwd' \\(it serves "
     "decode\\)"),
    ("bwd-serves-nothing",
     {**GOOD, "implementations": {**GOOD["implementations"], "attn_bwd": FWD}},
     "'attn_bwd', which does not serve op 'fwd' \\(it serves no user op\\)"),
    ("bad-op", {**GOOD, "op": "bwd"}, "op is the string 'bwd'; expected one of 'fwd', "
                                     "'train', 'decode' \\(a user op\\)"),
    ("op-not-string", {**GOOD, "op": 1}, "op is the integer 1"),
    ("config-outside-the-space", with_entry(GOOD, config={**FWD_CFG, "BLOCK_M": 7}),
     "entries\\[0\\].config.BLOCK_M is the integer 7, outside the search space"),
    ("config-unknown-knob", with_entry(GOOD, config={**FWD_CFG, "NUM_SPLITS": 2}),
     "entries\\[0\\].config has the unknown key 'NUM_SPLITS'"),
    ("config-missing-knob", with_entry(GOOD, config={"BLOCK_M": 64}),
     "missing keys \\['BLOCK_N', 'num_stages', 'num_warps'\\]"),
    ("extern-with-a-config",
     with_entry(GOOD, implementation=EXTERN, config={"BLOCK_M": 64}, runner_up="attn_fwd"),
     f"has the unknown key 'BLOCK_M'; expected {{}}: {EXTERN} has no parameters"),
    ("unlisted-implementation", {**GOOD, "implementations": {"attn_fwd": FWD}},
     f"entries\\[0\\].runner_up is '{EXTERN}', which implementations does not list"),
    ("unused-implementation",
     with_entry(GOOD, runner_up=None, runner_up_ms=None, extern=None, extern_ms=None),
     f"implementations lists '{EXTERN}', which no entry names"),
    ("runner-up-is-the-winner", with_entry(GOOD, runner_up="attn_fwd"),
     "runner_up is 'attn_fwd', the winner itself"),
    ("runner-up-without-time", with_entry(GOOD, runner_up_ms=None),
     "runner_up is the string 'sdpa_toy' and entries\\[0\\].runner_up_ms null; expected "
     "both null or both given"),
    ("extern-not-extern", with_entry(GOOD, extern="attn_fwd"),
     "extern is 'attn_fwd', a triton implementation; expected an extern one"),
    ("bad-hash", {**GOOD, "implementations": {**GOOD["implementations"], "attn_fwd": "XYZ"}},
     "implementations.attn_fwd is 'XYZ'; expected 16 lowercase hex digits"),
    ("bad-median", with_entry(GOOD, median_ms=0), "median_ms is the integer 0"),
    ("bad-decided-at", with_entry(GOOD, decided_at="2027-01-10T12:00:00"), "without a "
                                                                          "timezone"),
    ("unknown-top-key", {**GOOD, "candidates": []}, "the document has the unknown key "
                                                    "'candidates'"),
    ("missing-top-key", without(GOOD, "implementations"), "lacks the key 'implementations'"),
    ("unknown-entry-key", with_entry(GOOD, bucket="x"), "entries\\[0\\] has the unknown key "
                                                       "'bucket'"),
    ("problem-extra-key", with_entry(GOOD, problem={**FWD_PROBLEMS[0].key(), "page": 1}),
     "entries\\[0\\].problem has the unknown key 'page'"),
    ("duplicate-problem", {**GOOD, "entries": GOOD["entries"] * 2},
     "entries\\[1\\].problem repeats the problem of an earlier entry"),
    ("newer-schema", {**GOOD, "schema_version": 3}, "schema_version is 3: written by a newer "
                                                    "flashtune"),
    ("candidates-in-version-1", {**with_entry(GOOD, candidates=[]), "schema_version": 1},
     "schema_version is 1 but an entry has candidates; expected schema_version 2"),
    ("candidates-not-a-list", with_candidates(GOOD, {"attn_fwd": 1.0}),
     "entries\\[0\\].candidates is an object; expected a list"),
    ("candidate-unknown", with_candidates(GOOD, [
        {"implementation": "no_such_impl", "config": {}, "median_ms": 1.0}]),
     "entries\\[0\\].candidates\\[0\\].implementation is 'no_such_impl', an unknown "
     "implementation"),
    ("candidate-bad-time", with_candidates(GOOD, [
        {"implementation": "attn_fwd", "config": {}, "median_ms": -1}]),
     "entries\\[0\\].candidates\\[0\\].median_ms is the integer -1; expected a finite number"),
    ("candidate-bad-hash", with_candidates(GOOD, [
        {"implementation": "attn_fwd", "config": {}, "median_ms": None, "source_hash": "x"}]),
     "entries\\[0\\].candidates\\[0\\].source_hash is 'x'"),
    ("candidate-extra-key", with_candidates(GOOD, [
        {"implementation": "attn_fwd", "config": {}, "median_ms": 1.0, "rank": 1}]),
     "entries\\[0\\].candidates\\[0\\] has the unknown key 'rank'"),
    ("implementations-not-object", {**GOOD, "implementations": ["attn_fwd"]},
     "implementations is a list; expected an object"),
]


@pytest.mark.parametrize("bad, match", [(b, m) for _, b, m in BAD], ids=[i for i, _, _ in BAD])
def test_every_rejection_is_one_line_naming_the_file(bad: dict, match: str) -> None:
    with pytest.raises(ImportRejected, match=f"^f.json: .*{match}") as info:
        parse(bad)
    assert "\n" not in str(info.value)


def test_a_decode_file_takes_the_implementations_of_decode() -> None:
    doc = choice_document(
        entry(DECODE_PROBLEMS[0], implementation="attn_decode", config=DECODE_CFG,
              runner_up="attn_fwd", runner_up_ms=0.09),
        entry(DECODE_PROBLEMS[1], implementation="attn_fwd", config=FWD_CFG,
              runner_up="attn_decode", runner_up_ms=0.05, extern=None, extern_ms=None),
        op="decode")
    parsed = parse(doc)
    assert parsed.implementations == {"attn_decode": DECODE, "attn_fwd": FWD, EXTERN: EXTERN_HASH}
    with pytest.raises(ImportRejected, match="'attn_decode', which does not serve op 'fwd'"):
        parse(replace(doc, op="fwd"))


def test_a_stale_winner_is_accepted_with_only_its_configs_shape_checked() -> None:
    """A winner decided at another source hash is accepted (as a per-template file of an
    old source is): its space may have changed since, so its config is not checked
    against today's; a non-object config is still refused."""
    d = data(implementations={"attn_fwd": OLD, EXTERN: EXTERN_HASH})
    d = with_entry(d, config={"BLOCK_M": 7, "GONE_KNOB": 1})
    parsed = parse(d)
    assert parsed.entries[0].config == {"BLOCK_M": 7, "GONE_KNOB": 1}
    assert not parsed.is_current(parsed.entries[0], {"attn_fwd": FWD})
    assert parsed.is_current(parsed.entries[0], {"attn_fwd": OLD})
    with pytest.raises(ImportRejected, match="config is the integer 3"):
        parse(with_entry(d, config=3))


def test_lenient_parsing_accepts_an_unknown_implementation_as_stale() -> None:
    d = data(entry(implementation="no_such_impl", config={"BLOCK_M": 64}),
             implementations={"no_such_impl": FWD, EXTERN: EXTERN_HASH})
    text = json.dumps(d)
    with pytest.raises(ImportRejected, match="'no_such_impl', an unknown implementation"):
        parse_choice_document(text, specs=SPECS)
    doc = parse_choice_document(text, specs=SPECS, strict=False)
    assert doc.entries[0].config == {"BLOCK_M": 64}
    assert not doc.is_current(doc.entries[0], {n: s.source_hash for n, s in SPECS.items()})


# -- export and import ----------------------------------------------------------------------

def test_export_import_export_round_trip(tmp_path: Path, url: str) -> None:
    fill(url, H100)
    fill(url, A100, scale=2.0)
    docs = export(url)
    assert [d.file_name() for d in docs] == [
        "device_name=NVIDIA_A100-SXM4-80GB,op=decode.json",
        "device_name=NVIDIA_A100-SXM4-80GB,op=fwd.json",
        "device_name=NVIDIA_H100_80GB_HBM3,op=decode.json",
        "device_name=NVIDIA_H100_80GB_HBM3,op=fwd.json"]
    h100_fwd = docs[3]
    # the stale attn_fwd decision (old source) is not exported
    assert sorted(canonical_json(e.problem) for e in h100_fwd.entries) == \
        sorted(canonical_json(p.key()) for p in FWD_PROBLEMS[:2])
    assert h100_fwd.implementations == {"attn_fwd": FWD, EXTERN: EXTERN_HASH}
    assert h100_fwd.software == UNDER.as_dict()
    h100_decode = docs[2]
    assert {e.implementation: e.software["torch"] for e in h100_decode.entries} == \
        {"attn_decode": "2.7.0", "attn_fwd": UNDER.torch}
    fresh = f"sqlite:///{tmp_path / 'fresh.db'}"
    report = import_(fresh, docs)
    assert report.total("added") == 8 and report.total("stale") == 0
    assert report.lines()[0] == (f"{docs[0].file_name()}: {A100.name} op decode: 2 added, "
                                 "0 replaced, 0 kept, 0 skipped, 0 stale")
    again = export(fresh)
    assert [without_exported_at(choice_document_to_json(d)) for d in again] == \
        [without_exported_at(choice_document_to_json(d)) for d in docs]
    with open_store(fresh, read_only=True) as store:
        imported = {c.implementation: c for c in store.list_choices(device_name=H100.name,
                                                                    op="fwd")}
    assert imported[EXTERN].extern_margin == 1.0
    assert imported["attn_fwd"].margin == pytest.approx(1.3)
    # the candidates travel with the file (schema version 2)
    assert imported["attn_fwd"].candidates == (
        {"implementation": "attn_fwd", "config": FWD_CFG, "median_ms": 1.0},
        {"implementation": EXTERN, "config": {}, "median_ms": 1.3})
    assert imported[EXTERN].candidates == ()  # decided without any recorded
    assert imported["attn_fwd"].software == UNDER


def test_export_filters(url: str) -> None:
    fill(url, H100)
    fill(url, A100)
    assert [d.file_name() for d in export(url, device_name=A100.name, op="fwd")] == \
        ["device_name=NVIDIA_A100-SXM4-80GB,op=fwd.json"]
    assert [d.op for d in export(url, op="decode")] == ["decode", "decode"]
    assert export(url, device_name="nope") == []
    with pytest.raises(InputError, match="not a user op"):
        export(url, op="bwd")


def test_export_leaves_out_a_rival_this_flashtune_does_not_know(
        url: str, caplog: pytest.LogCaptureFixture) -> None:
    decide(url, H100, "fwd", FWD_PROBLEMS[0], implementation="attn_fwd", source_hash=FWD,
           config=FWD_CFG, median_ms=1.0, tflops=None, runner_up="no_such_impl",
           runner_up_ms=1.05, extern=EXTERN, extern_ms=1.2)
    decide(url, H100, "fwd", FWD_PROBLEMS[1], implementation="no_such_impl",
           source_hash=FWD, config={}, median_ms=1.0, tflops=None)  # unknown winner
    with caplog.at_level(logging.WARNING, logger="flashtune.db.exchange_choices"):
        [doc] = export(url)
    [e] = doc.entries
    assert (e.runner_up, e.runner_up_ms, e.extern) == (None, None, EXTERN)
    assert "its runner_up 'no_such_impl' is not a registered implementation" in caplog.text


def test_an_externs_choices_export_with_the_torch_they_were_timed_with(url: str) -> None:
    """An SDPA backend's hash is the torch and cuDNN of the GPU box that timed it: a
    database exports whole from any machine (here the extern is registered with another
    hash, as on a laptop with another torch), each choice with the hash it was decided at;
    where an extern's choices span two hashes the latest's are kept. An own kernel's
    stale choice is still left out."""
    timed_later, timed_before = "a" * 16, "b" * 16
    decide(url, H100, "fwd", FWD_PROBLEMS[1], implementation=EXTERN,
           source_hash=timed_before, config={}, median_ms=0.5, tflops=None)
    decide(url, H100, "fwd", FWD_PROBLEMS[0], implementation=EXTERN, source_hash=timed_later,
           config={}, median_ms=1.0, tflops=None, runner_up="attn_fwd", runner_up_ms=1.1)
    decide(url, H100, "fwd", FWD_PROBLEMS[2], implementation="attn_fwd", source_hash=OLD,
           config=FWD_CFG, median_ms=3.0, tflops=400.0)
    [doc] = export(url)
    assert [e.problem for e in doc.entries] == [FWD_PROBLEMS[0].key()]
    assert doc.implementations == {EXTERN: timed_later, "attn_fwd": FWD}
    # where the extern's hash is the reader's, the choice imports; elsewhere it is stale
    specs = {**SPECS, EXTERN: extern_spec(source_hash=timed_later)}
    with open_store(url.replace("a.db", "b.db")) as store:
        report = import_documents(store, [("x", doc)], specs=specs)
    assert report.total("added") == 1 and report.total("stale") == 0
    assert import_(url.replace("a.db", "c.db"), [doc]).total("stale") == 1


def test_a_torch_bound_own_implementation_exports_as_an_extern_does(url: str) -> None:
    """A pair with SDPA cuDNN's forward (``TemplateSpec.torch_bound``: its hash carries the
    torch and cuDNN that timed it) exports with the hash it was decided at, as an extern's
    choices do, though it is of flashtune's own kind; the same choice of an own kernel that
    is not torch-bound is stale and left out."""
    bound = replace(extern_spec(name="cudnn_pair", source_hash="c" * 16), kind="gluon")
    specs = {**SPECS, "cudnn_pair": bound}
    decide(url, H100, "fwd", FWD_PROBLEMS[0], implementation="cudnn_pair",
           source_hash="d" * 16, config={}, median_ms=1.0, tflops=None)
    with open_store(url, read_only=True) as store:
        [doc] = export_choice_documents(store, specs=specs)
        assert doc.implementations == {"cudnn_pair": "d" * 16}
        unbound = {**specs, "cudnn_pair": replace(bound, torch_bound=False)}
        assert export_choice_documents(store, specs=unbound) == []


def test_an_export_checks_what_it_writes(url: str) -> None:
    decide(url, H100, "fwd", FWD_PROBLEMS[0], implementation="attn_fwd", source_hash=FWD,
           config={"BLOCK_M": 7}, median_ms=1.0, tflops=None)
    with pytest.raises(ImportRejected, match="^export of device_name=NVIDIA_H100_80GB_HBM3,"
                                             "op=fwd.json: .*BLOCK_M"):
        export(url)


@pytest.mark.parametrize("policy, expected, counts", [
    ("keep-faster", {0: ("attn_fwd", 1.0), 1: (EXTERN, 0.01)}, (0, 1, 1, 0)),
    ("overwrite", {0: ("attn_fwd", 4.0), 1: (EXTERN, 0.01)}, (0, 2, 0, 0)),
    ("skip", {0: ("attn_fwd", 1.0), 1: (EXTERN, 0.02)}, (0, 0, 0, 2)),
])
def test_import_policies(tmp_path: Path, url: str, policy: str, expected: dict,
                         counts: tuple) -> None:
    fill(url, H100)
    other = f"sqlite:///{tmp_path / 'b.db'}"
    fill(other, H100, scale=4.0)
    decide(other, H100, "fwd", FWD_PROBLEMS[1], implementation=EXTERN,
           source_hash=EXTERN_HASH, config={}, median_ms=0.01, tflops=None)
    [doc] = export(other, op="fwd")
    report = import_(url, [doc], policy=policy)
    f = report.files[0]
    assert (f.added, f.replaced, f.kept, f.skipped, f.op, f.template) == \
        (*counts, "fwd", "")
    got = stored(url, op="fwd", device_name=H100.name)
    assert {i: got[(H100.name, "fwd", i)] for i in (0, 1)} == expected


def test_stale_choices_are_counted_and_not_written(url: str) -> None:
    doc = choice_document(entry(), entry(FWD_PROBLEMS[1], median_ms=2.0),
                          implementations={"attn_fwd": OLD, EXTERN: EXTERN_HASH})
    report = import_(url, [parse(doc)])
    assert [(f.added, f.stale) for f in report.files] == [(0, 2)]
    assert report.lines()[-1] == ("stale op choices were decided for another version of their "
                                  "implementation's source and were not imported")
    assert stored(url) == {}


def test_an_unknown_implementation_writes_nothing(url: str) -> None:
    """Documents built in memory are checked too: one naming an implementation the specs
    do not know is refused, naming it, and nothing of the batch is written."""
    fill(url, H100)
    before = dump(url)
    good = make_document()  # a per-template document
    unknown = choice_document(entry(implementation="no_such_impl"),
                              implementations={"no_such_impl": FWD, EXTERN: EXTERN_HASH})
    with pytest.raises(UnknownTemplateError, match="unknown implementation 'no_such_impl'; "
                                                   "known implementations: attn_bwd"):
        import_(url, [good, choice_document(), unknown])
    assert dump(url) == before


def test_both_kinds_import_in_one_transaction(url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    fill(url, A100)
    before = dump(url)
    docs = [make_document(), choice_document(entry(), entry(FWD_PROBLEMS[1]))]
    real, calls = rows.choice_row, []

    def failing(*args: object) -> object:
        calls.append(args)
        if len(calls) == 2:
            raise OperationalError("UPDATE ft_choices", {}, Exception("disk I/O error"))
        return real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(rows, "choice_row", failing)
    with pytest.raises(StoreError, match="disk I/O error"):
        import_(url, docs)
    assert dump(url) == before  # the best configs written first were rolled back too
    monkeypatch.undo()
    report = import_(url, docs)
    assert [(f.what, f.added) for f in report.files] == [("attn_fwd", 3), ("op fwd", 2)]
    assert report.lines()[-1].startswith("imported 2 files (policy keep-faster): 5 added")


def test_one_device_name_means_one_gpu_in_choice_files_too(url: str) -> None:
    fill(url, H100)
    before = dump(url)
    other = replace(choice_document().device, sm_count=114)
    with pytest.raises(ImportRejected, match="other hardware"):
        import_(url, [choice_document(device=other)])
    assert dump(url) == before


def test_an_extern_registered_with_another_hash_makes_its_wins_stale(url: str) -> None:
    doc = parse(choice_document(entry(implementation=EXTERN, config={}, runner_up="attn_fwd")))
    specs = {**SPECS, EXTERN: extern_spec(source_hash="f" * 16)}
    with open_store(url) as store:
        report = import_documents(store, [("x", doc)], specs=specs)
    assert report.total("stale") == 1 and stored(url) == {}

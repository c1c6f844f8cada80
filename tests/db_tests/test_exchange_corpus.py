"""A corpus of hostile and malformed config files: each must be refused with a specific
one-line ImportRejected, by parse_document, by read_document, and by ``flashtune import``
(exit 1, one ``Error:`` line, no traceback, the database untouched).
"""

from __future__ import annotations

import copy
import json
import random
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from flashtune.cli.main import cli
from flashtune.core.errors import ImportRejected
from flashtune.db import exchange
from flashtune.db.exchange import MAX_FILE_BYTES, parse_document, read_document
from flashtune.kernel_templates import catalog  # noqa: E402
from tests.db_tests.exchange_support import dump, populate, valid_json
from tests.db_tests.support import A100, H100

SPECS = catalog()

VALID = valid_json(3)


@dataclass(frozen=True)
class Case:
    id: str
    data: Callable[[], bytes]
    pattern: str  # searched in the message after "<origin>: "
    max_entries: int | None = None
    sparse_size: int | None = None  # written as a sparse file of this size instead


def doc() -> dict[str, Any]:
    return json.loads(VALID)


def edit(path: str, value: Any = None, *, delete: bool = False,
         base: dict[str, Any] | None = None) -> Callable[[], bytes]:
    """The valid document (or ``base``) with the value at ``path`` (dots; ints index
    lists) replaced."""
    def make() -> bytes:
        data = copy.deepcopy(base) if base is not None else doc()
        *parents, last = [int(p) if p.isdigit() else p for p in path.split(".")]
        node = data
        for p in parents:
            node = node[p]
        if delete:
            del node[last]
        else:
            node[last] = value
        return json.dumps(data, allow_nan=True).encode()
    return make


SOFTWARE = {"cuda": "12.8", "driver": "570.86.10", "flashtune": "0.9.0", "torch": "2.7.0",
            "triton": "3.3.0"}


def v2(path: str, value: Any = None, *, delete: bool = False) -> Callable[[], bytes]:
    """:func:`edit` of the valid document made schema_version 2, each entry with its own
    software block (``SOFTWARE``)."""
    def make() -> bytes:
        data = doc()
        data["schema_version"] = 2
        for e in data["entries"]:
            e["software"] = dict(SOFTWARE)
        return edit(path, value, delete=delete, base=data)()
    return make


def raw(data: bytes | str) -> Callable[[], bytes]:
    return lambda: data.encode() if isinstance(data, str) else data


def text_edit(old: str, new: str) -> Callable[[], bytes]:
    def make() -> bytes:
        assert old in VALID
        return VALID.replace(old, new, 1).encode()
    return make


BUCKET0 = doc()["entries"][0]["bucket"]
NAME_RULE = r"expected 1-200 characters of 0-9 A-Z a-z \. _ \+ -"
INT = r"expected an integer from"

CASES = [
    # bytes, text and JSON syntax
    Case("empty-file", raw(b""), r"^is empty; expected a JSON object"),
    Case("whitespace-only", raw(b" \n\t"), r"^is empty"),
    Case("truncated-json", raw(VALID[: len(VALID) // 2]),
         r"^is not valid JSON \(.+ at line \d+ column \d+\); expected one complete JSON"),
    Case("trailing-garbage", raw(VALID + "}"), r"^is not valid JSON \(Extra data"),
    Case("non-utf8-bytes", raw(b'{"format": "\xff\xfe"}'), r"^is not UTF-8 \(byte 12 is 0xff\)"),
    Case("utf16-bom", raw(VALID.encode("utf-16")), r"^is not UTF-8 \(byte 0 is 0xff\)"),
    Case("utf8-bom", raw(b"\xef\xbb\xbf" + VALID.encode()),
         r"^is not valid JSON \(Unexpected UTF-8 BOM"),
    Case("top-level-array", raw(b"[]"), r"^the top level is a list; expected a JSON object"),
    Case("top-level-string", raw(b'"flashtune-configs"'), r"^the top level is the string"),
    Case("top-level-null", raw(b"null"), r"^the top level is null"),
    Case("nesting-100000-deep", raw("[" * 100_000 + "]" * 100_000),
         r"^nests arrays/objects deeper than 16 levels; expected at most 16 \(MAX_DEPTH\)"),
    Case("nesting-17-deep-inside-software", edit("software.torch", json.loads("[" * 16 + "]" * 16)),
         r"^nests arrays/objects deeper than 16"),
    Case("oversized-file", raw(b" " * (MAX_FILE_BYTES + 1)),
         rf"^is {MAX_FILE_BYTES + 1} bytes; expected at most {MAX_FILE_BYTES} bytes",
         sparse_size=MAX_FILE_BYTES + 1),
    Case("nan", edit("entries.0.median_ms", float("nan")), r"^holds NaN, which is not JSON"),
    Case("infinity", edit("entries.0.tflops", float("inf")), r"^holds Infinity, which is not"),
    Case("minus-infinity", edit("entries.1.median_ms", float("-inf")), r"^holds -Infinity"),
    Case("float-overflow-1e400", text_edit('"median_ms": 1.0', '"median_ms": 1e400'),
         r"^holds the number '1e400', beyond the float range"),
    Case("int-of-5000-digits", text_edit('"trials": 20', '"trials": ' + "9" * 5000),
         r"^holds an integer of 5000 digits; expected at most 100"),
    Case("duplicate-top-level-key", text_edit('"format": "flashtune-configs"',
                                              '"format": "flashtune-configs", "format": "x"'),
         r"^repeats the key 'format' in one object; expected each key once"),
    Case("duplicate-config-key", text_edit('"BLOCK_M": 64', '"BLOCK_M": 64, "BLOCK_M": 256'),
         r"^repeats the key 'BLOCK_M'"),
    # the header
    Case("wrong-format", edit("format", "flashtune-config"),
         r"^format is the string 'flashtune-config'; expected 'flashtune-configs'"),
    Case("missing-format", edit("format", delete=True), r"^format is missing; expected"),
    Case("schema-version-3", edit("schema_version", 3),
         r"^schema_version is 3: written by a newer flashtune \(this is .*, which reads "
         r"schema_version 1 to 2\); expected at most 2: upgrade flashtune"),
    Case("schema-version-0", edit("schema_version", 0),
         rf"^schema_version is the integer 0; {INT} 1 to 2"),
    Case("schema-version-string", edit("schema_version", "1"),
         r"^schema_version is the string '1'"),
    Case("schema-version-bool", edit("schema_version", True), r"^schema_version is the bool true"),
    Case("unknown-top-level-key", edit("comment", "hi"),
         r"^the document has the unknown key 'comment'; expected an object with exactly the keys"),
    Case("missing-top-level-key", edit("entries", delete=True),
         r"^the document lacks the key 'entries'"),
    # device
    Case("device-is-a-list", edit("device", []), r"^device is a list; expected an object"),
    Case("unknown-device-key", edit("device.uuid", "GPU-1234"),
         r"^device has the unknown key 'uuid'"),
    Case("missing-device-key", edit("device.total_memory", delete=True),
         r"^device lacks the key 'total_memory'"),
    Case("device-name-parent-path", edit("device.name", "../../etc/passwd"),
         rf"^device\.name is '\.\./\.\./etc/passwd'; {NAME_RULE}"),
    Case("device-name-slash", edit("device.name", "a/b"), rf"^device\.name is 'a/b'; {NAME_RULE}"),
    Case("device-name-windows", edit("device.name", "C:\\x"),
         rf"^device\.name is 'C:\\\\x'; {NAME_RULE}"),
    Case("device-name-nul", edit("device.name", "H100\x00.json"),
         rf"^device\.name is 'H100\\x00\.json'; {NAME_RULE}"),
    Case("device-name-dotdot-inside", edit("device.name", "H100..x"),
         rf"^device\.name is 'H100\.\.x'; {NAME_RULE}"),
    Case("device-name-empty", edit("device.name", ""), rf"^device\.name is ''; {NAME_RULE}"),
    Case("device-name-too-long", edit("device.name", "H" * 201),
         r"^device\.name is a string of 201 characters; expected at most 200"),
    Case("device-name-int", edit("device.name", 7),
         r"^device\.name is the integer 7; expected a string"),
    Case("compute-capability-bad", edit("device.compute_capability", "9"),
         r"^device\.compute_capability is '9'; expected a compute capability like '9\.0'"),
    Case("sm-count-huge-1e30", edit("device.sm_count", 10**30),
         rf"^device\.sm_count is the integer 1000000000000000000000000000000; {INT} 1 to 100000"),
    Case("sm-count-float", edit("device.sm_count", 132.0),
         rf"^device\.sm_count is the number 132\.0; {INT}"),
    Case("sm-count-bool", edit("device.sm_count", True),
         rf"^device\.sm_count is the bool true; {INT}"),
    Case("total-memory-negative", edit("device.total_memory", -1),
         r"^device\.total_memory is the integer -1"),
    # software and template
    Case("software-unknown-key", edit("software.python", "3.11"),
         r"^software has the unknown key 'python'"),
    Case("software-value-int", edit("software.torch", 2),
         r"^software\.torch is the integer 2; expected a string"),
    Case("software-missing-key", edit("software.driver", delete=True),
         r"^software lacks the key 'driver'"),
    # an entry's own software: schema_version 2 only, the document's keys and types
    Case("entry-software-in-version-1", edit("entries.0.software", SOFTWARE),
         r"^entries\[0\] has the key 'software', which schema_version 1 does not allow; "
         r"expected schema_version 2 for an entry's own software"),
    Case("entry-software-unknown-key", v2("entries.1.software.python", "3.11"),
         r"^entries\[1\]\.software has the unknown key 'python'; expected an object with "
         r"exactly the keys cuda, driver, flashtune, torch, triton"),
    Case("entry-software-missing-key", v2("entries.1.software.torch", delete=True),
         r"^entries\[1\]\.software lacks the key 'torch'"),
    Case("entry-software-value-int", v2("entries.0.software.triton", 3),
         r"^entries\[0\]\.software\.triton is the integer 3; expected a string"),
    Case("entry-software-too-long", v2("entries.0.software.torch", "2" * 201),
         r"^entries\[0\]\.software\.torch is a string of 201 characters; expected at most"),
    Case("entry-software-null", v2("entries.2.software", None),
         r"^entries\[2\]\.software is null; expected an object with exactly the keys"),
    Case("entry-software-string", v2("entries.2.software", "2.5.1"),
         r"^entries\[2\]\.software is the string '2\.5\.1'; expected an object"),
    Case("entry-unknown-key-in-version-2", v2("entries.1.note", "fast"),
         r"^entries\[1\] has the unknown key 'note'; expected an object with exactly the "
         r"keys .*tuned_at \(and optionally software\)"),
    Case("unknown-template", edit("template.name", "attn_nope"),
         r"^template\.name is 'attn_nope', an unknown template; expected one of (attn_\w+, )*attn_fwd\b"),
    Case("template-name-path", edit("template.name", "../attn_fwd"),
         rf"^template\.name is '\.\./attn_fwd'; {NAME_RULE}"),
    Case("unknown-template-key", edit("template.version", 2),
         r"^template has the unknown key 'version'"),
    Case("source-hash-not-hex", edit("template.source_hash", "not-a-hash-at-al"),
         r"^template\.source_hash is 'not-a-hash-at-al'; expected 16 lowercase hex digits"),
    Case("source-hash-upper", edit("template.source_hash", "ABCDEF0123456789"),
         r"^template\.source_hash is 'ABCDEF"),
    Case("exported-at-number", edit("exported_at", 5),
         r"^exported_at is the integer 5; expected a string of an ISO 8601"),
    # entries
    Case("entries-is-an-object", edit("entries", {}),
         r"^entries is an object; expected a list of entries"),
    Case("entry-is-a-string", edit("entries.0", "x"),
         r"^entries\[0\] is the string 'x'; expected an object"),
    Case("unknown-entry-key", edit("entries.1.note", "fast"),
         r"^entries\[1\] has the unknown key 'note'"),
    Case("missing-entry-key", edit("entries.2.tuned_at", delete=True),
         r"^entries\[2\] lacks the key 'tuned_at'"),
    Case("trials-bool", edit("entries.0.trials", True),
         rf"^entries\[0\]\.trials is the bool true; {INT} 0 to 1000000000"),
    Case("trials-float", edit("entries.0.trials", 20.0),
         rf"^entries\[0\]\.trials is the number 20\.0; {INT}"),
    Case("trials-huge", edit("entries.0.trials", 10**10),
         rf"^entries\[0\]\.trials is the integer 10000000000; {INT}"),
    Case("median-zero", edit("entries.0.median_ms", 0),
         r"^entries\[0\]\.median_ms is the integer 0;"
         r" expected a finite number of milliseconds > 0 and < 1e7"),
    Case("median-negative", edit("entries.0.median_ms", -1.5),
         r"^entries\[0\]\.median_ms is the number -1\.5; expected a finite"),
    Case("median-too-big", edit("entries.0.median_ms", 1e7),
         r"^entries\[0\]\.median_ms is the number 10000000\.0"),
    Case("median-string", edit("entries.0.median_ms", "1.0"),
         r"^entries\[0\]\.median_ms is the string '1\.0'"),
    Case("median-bool", edit("entries.0.median_ms", True),
         r"^entries\[0\]\.median_ms is the bool true"),
    Case("tflops-negative", edit("entries.0.tflops", -1),
         r"^entries\[0\]\.tflops is the integer -1;"
         r" expected null or a finite number from 0 to 1e5"),
    Case("tflops-huge", edit("entries.0.tflops", 1e6),
         r"^entries\[0\]\.tflops is the number 1000000\.0"),
    Case("problem-unknown-key", edit("entries.0.problem.window", 128),
         r"^entries\[0\]\.problem has the unknown key 'window'"),
    Case("problem-missing-key", edit("entries.0.problem.dtype", delete=True),
         r"^entries\[0\]\.problem lacks the key 'dtype'"),
    Case("problem-float-int", edit("entries.0.problem.batch", 2.0),
         rf"^entries\[0\]\.problem\.batch is the number 2\.0; {INT} 1 to 2147483648"),
    Case("problem-zero", edit("entries.0.problem.seqlen_q", 0),
         r"^entries\[0\]\.problem\.seqlen_q is the integer 0"),
    Case("problem-causal-string", edit("entries.0.problem.causal", "yes"),
         r"^entries\[0\]\.problem\.causal is the string 'yes'; expected true or false"),
    Case("problem-causal-int", edit("entries.0.problem.causal", 1),
         r"^entries\[0\]\.problem\.causal is the integer 1; expected true or false"),
    Case("problem-invalid-gqa", edit("entries.0.problem.heads_kv", 3),
         r"^entries\[0\]\.problem is not a valid problem \(heads_q \(4\) must be a "
         r"multiple of heads_kv \(3\)\); expected the key of a valid AttentionProblem"),
    Case("problem-bad-dtype", edit("entries.0.problem.dtype", "fp32"),
         r"^entries\[0\]\.problem is not a valid problem \(dtype must be one of"),
    Case("bucket-mismatch", edit("entries.0.bucket", "fp16-d64"),
         rf"^entries\[0\]\.bucket is 'fp16-d64'; expected '{BUCKET0}' \(the problem's bucket\)"),
    Case("config-is-a-list", edit("entries.0.config", [64]),
         r"^entries\[0\]\.config is a list; expected an object"),
    Case("config-unknown-key", edit("entries.0.config.BLOCK_K", 64),
         r"^entries\[0\]\.config has the unknown key 'BLOCK_K'; expected keys among BLOCK_M"),
    Case("config-missing-key", edit("entries.0.config.BLOCK_N", delete=True),
         r"^entries\[0\]\.config has missing keys \['BLOCK_N'\]"),
    Case("config-block-m-48", edit("entries.0.config.BLOCK_M", 48),
         r"^entries\[0\]\.config\.BLOCK_M is the integer 48, outside the search space;"
         r" expected one of 16, 32, 64, 128, 256"),
    Case("config-float", edit("entries.0.config.BLOCK_M", 64.0),
         r"^entries\[0\]\.config\.BLOCK_M is the number 64\.0, outside"),
    Case("config-bool-knob", edit("entries.0.config.USE_TMA", True),
         r"^entries\[0\]\.config\.USE_TMA is the bool true, outside the search space;"
         r" expected one of 0, 1"),
    Case("tuned-at-garbage", edit("entries.0.tuned_at", "yesterday"),
         r"^entries\[0\]\.tuned_at is 'yesterday'; expected an ISO 8601 time with a timezone"),
    Case("tuned-at-naive", edit("entries.0.tuned_at", "2025-01-31T12:00:00"),
         r"^entries\[0\]\.tuned_at is '2025-01-31T12:00:00', without a timezone"),
    Case("tuned-at-impossible-date", edit("entries.0.tuned_at", "2025-13-45T00:00:00+00:00"),
         r"^entries\[0\]\.tuned_at is '2025-13-45T00:00:00\+00:00' \(month must be in 1\.\.12\)"),
    Case("tuned-at-before-year-1-in-utc", edit("entries.0.tuned_at", "0001-01-01T00:00:00+01:00"),
         r"^entries\[0\]\.tuned_at is '0001-01-01T00:00:00\+01:00' \(date value out of range\)"),
    Case("duplicate-problem", edit("entries.2", doc()["entries"][0]),
         r"^entries\[2\]\.problem repeats the problem of an earlier entry;"
         r" expected each problem once"),
    Case("too-many-entries", raw(VALID),
         r"^entries holds 3 entries; expected at most 2 \(MAX_ENTRIES\)",
         max_entries=2),
]


def limit(case: Case, monkeypatch: pytest.MonkeyPatch) -> None:
    if case.max_entries is not None:
        monkeypatch.setattr(exchange, "MAX_ENTRIES", case.max_entries)


def write(case: Case, folder: Path) -> Path:
    path = folder / f"{case.id}.json"
    if case.sparse_size is not None:
        with open(path, "wb") as f:
            f.truncate(case.sparse_size)
    else:
        path.write_bytes(case.data())
    return path


def check_message(message: str, origin: str, case: Case) -> None:
    assert "\n" not in message and "\r" not in message
    assert message.startswith(f"{origin}: "), message
    assert re.search(case.pattern, message[len(origin) + 2:]), message
    assert "expected" in message


def test_the_corpus_is_large_and_the_valid_document_passes() -> None:
    assert len(CASES) >= 25 and len({c.id for c in CASES}) == len(CASES)
    assert len(parse_document(VALID, specs=SPECS).entries) == 3
    own = parse_document(v2("entries.0.tuned_at", "2025-01-31T12:00:00+00:00")(), specs=SPECS)
    assert [e.software for e in own.entries] == [SOFTWARE] * 3


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_parse_document_rejects(case: Case, monkeypatch: pytest.MonkeyPatch) -> None:
    limit(case, monkeypatch)
    with pytest.raises(ImportRejected) as info:
        parse_document(case.data(), origin="upload.json", specs=SPECS)
    check_message(str(info.value), "upload.json", case)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_read_document_rejects(case: Case, tmp_path: Path,
                               monkeypatch: pytest.MonkeyPatch) -> None:
    limit(case, monkeypatch)
    path = write(case, tmp_path)
    with pytest.raises(ImportRejected) as info:
        read_document(path, specs=SPECS)
    check_message(str(info.value), str(path), case)


@pytest.fixture(scope="module")
def populated(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict]:
    url = f"sqlite:///{tmp_path_factory.mktemp('db') / 'populated.db'}"
    populate(url, H100, {0: 1.0, 1: 2.0})
    populate(url, A100, {2: 3.0})
    return url, dump(url)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_flashtune_import_rejects_and_writes_nothing(case: Case, tmp_path: Path,
                                                     populated: tuple[str, dict],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    limit(case, monkeypatch)
    url, before = populated
    good = tmp_path / "good.json"
    good.write_text(valid_json(2))  # a valid file first: the batch must still write nothing
    bad = write(case, tmp_path)
    result = CliRunner().invoke(cli, ["--db", url, "import", str(good), str(bad)])
    assert result.exit_code == 1, result.output
    assert isinstance(result.exception, SystemExit)
    assert "Traceback" not in result.output
    lines = result.output.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"Error: {bad}: "), result.output
    assert re.search(case.pattern, lines[0][len(f"Error: {bad}: "):]), lines[0]
    assert dump(url) == before


# -- random damage: whatever a mutation does, the answer is a document or one ImportRejected --

FUZZ_VALUES = [None, True, False, 0, -1, 1.5, 10**40, 1e308, "", "x" * 300, "../x", "a/b", [],
               {}, [1], {"a": 1}, "2025-01-01T00:00:00Z", "fp16", 64]


def _paths(node: Any, prefix: tuple = ()) -> Iterator[tuple]:
    if prefix:
        yield prefix
    items = node.items() if isinstance(node, dict) else enumerate(node) \
        if isinstance(node, list) else ()
    for key, value in items:
        yield from _paths(value, (*prefix, key))


def _verdict(data: bytes) -> None:
    try:
        parse_document(data, origin="fuzz.json", specs=SPECS)
    except ImportRejected as exc:
        message = str(exc)
        assert message.startswith("fuzz.json: ") and "\n" not in message and "expected" in message


@pytest.mark.parametrize("version", [1, 2])
def test_random_value_damage_is_accepted_or_rejected_cleanly(version: int) -> None:
    valid = doc() if version == 1 else json.loads(v2("format", "flashtune-configs")())
    rng = random.Random(20250131)
    paths = list(_paths(valid))
    for _ in range(1500):
        data = copy.deepcopy(valid)
        for _ in range(rng.randint(1, 3)):
            *parents, last = rng.choice(paths)
            node: Any = data
            try:
                for key in parents:
                    node = node[key]
                if isinstance(node, dict) and rng.random() < 0.2:
                    del node[last]
                else:
                    node[last] = copy.deepcopy(rng.choice(FUZZ_VALUES))
            except (KeyError, IndexError, TypeError):
                pass  # an earlier mutation removed or replaced the parent
        _verdict(json.dumps(data).encode())


def test_random_byte_damage_is_accepted_or_rejected_cleanly() -> None:
    rng = random.Random(7)
    raw = VALID.encode()
    for _ in range(1500):
        data = bytearray(raw)
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        _verdict(bytes(data))

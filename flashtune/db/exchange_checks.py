"""The validation half of :mod:`flashtune.db.exchange`: strict JSON loading and field checks,
and what both kinds of exchanged files share (the device block, software blocks, times,
configs, problem keys, reading a file safely).

Every check raises :class:`Bad` with ``"<where> <what is wrong>; expected <what>"``, one
line (values are shown with ``repr``, clipped); ``exchange.parse_document`` prefixes the
origin and raises ``ImportRejected``. Nothing here trusts its input: sizes and nesting are
bounded before ``json.loads`` runs, NaN/Infinity, over-long integers and duplicate keys are
refused while it runs, and every key, type and range is checked afterwards.
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from itertools import accumulate
from typing import Any, Protocol, TypeVar

from flashtune._version import __version__
from flashtune.core.errors import ImportRejected
from flashtune.core.problem import OPTIONAL, AttentionProblem
from flashtune.core.spec import TemplateSpec

__all__ = ["ENTRY_SOFTWARE", "FORMAT", "NAME_RULE", "SCHEMA_VERSION", "SOFTWARE_KEYS", "Bad",
           "DeviceInfo", "config", "device", "dumps", "entry", "entry_list", "fields",
           "header", "integer", "is_name", "iso", "kind", "load", "number", "one_device",
           "printable", "problem", "read_file", "show", "software", "software_block",
           "string", "template", "timestamp"]

FORMAT = "flashtune-configs"
SCHEMA_VERSION = 2  # the newest this code reads; it writes 1 where 1 can hold a document
SOFTWARE_KEYS = ("cuda", "driver", "flashtune", "torch", "triton")
MAX_STRING = 200
NAME_RULE = ("1-200 characters of 0-9 A-Z a-z . _ + - starting with a letter or digit, "
             "without '..'")

TOP_KEYS = ("format", "schema_version", "device", "software", "template", "exported_at",
            "entries")
DEVICE_KEYS = ("name", "compute_capability", "sm_count", "shared_mem_per_block",
               "total_memory")
TEMPLATE_KEYS = ("name", "source_hash")
ENTRY_KEYS = ("problem", "bucket", "config", "median_ms", "tflops", "trials", "tuned_at")
ENTRY_SOFTWARE = "software"  # an entry's own software block: optional, schema_version 2

_NAME = re.compile(r"[0-9A-Za-z][0-9A-Za-z._+-]{0,199}")
_CC = re.compile(r"[0-9]{1,3}\.[0-9]{1,3}")
_HEX16 = re.compile(r"[0-9a-f]{16}")
_ISO = re.compile(r"[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}(?:\.[0-9]{1,6})?"
                  r"(Z|[+-][0-9]{2}:[0-9]{2})?")
# a JSON string (an unterminated one runs to the end, keeping the scan linear), or a bracket
_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"?', re.S)
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
_STEP = {"[": 1, "{": 1, "]": -1, "}": -1}
_MAX_INT_DIGITS = 100  # far past any valid field; int() of more is slow


class Bad(Exception):
    """One validation failure (the message, without the origin)."""


@dataclass(frozen=True)
class DeviceInfo:
    """The hardware key of the device a document's configs were tuned on."""

    name: str
    compute_capability: str
    sm_count: int
    shared_mem_per_block: int
    total_memory: int

    def hardware_key(self) -> tuple[str, str, int, int, int]:
        """Same fields, same order as ``DeviceFingerprint.hardware_key()``."""
        return (self.name, self.compute_capability, self.sm_count,
                self.shared_mem_per_block, self.total_memory)


def printable(text: object) -> str:
    """``text`` with control characters escaped, so a message stays one line."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in str(text))


def show(value: Any, limit: int = 60) -> str:
    """``repr(value)``, clipped to ``limit`` characters."""
    try:
        text = repr(value)
    except ValueError:  # an int past Python's str conversion limit
        return f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[:limit - 3] + "..."


def kind(value: Any) -> str:
    """What a JSON value is, for messages: ``"the integer 7"``, ``"a list"``, ``"null"``."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"the bool {str(value).lower()}"
    for t, name in ((int, "integer"), (float, "number"), (str, "string")):
        if isinstance(value, t):
            return f"the {name} {show(value)}"
    if isinstance(value, list):
        return "a list"
    return "an object" if isinstance(value, dict) else f"a {type(value).__name__}"


def is_name(text: object) -> bool:
    """Whether ``text`` is a safe device or template name (see ``NAME_RULE``)."""
    return isinstance(text, str) and _NAME.fullmatch(text) is not None and ".." not in text


def dumps(data: Any) -> str:
    return json.dumps(data, sort_keys=True, indent=1, allow_nan=False) + "\n"


def iso(when: datetime) -> str:
    """An aware datetime as ISO 8601 text in UTC; ``ValueError`` for a naive one."""
    if not isinstance(when, datetime) or when.tzinfo is None:
        raise ValueError(f"expected a timezone-aware datetime, got {when!r}")
    return when.astimezone(timezone.utc).isoformat()


def software_block(versions: Mapping[str, str]) -> dict[str, str]:
    """``versions`` with every key of ``SOFTWARE_KEYS`` (missing ones empty); ``ValueError``
    for an unknown key."""
    unknown = sorted(set(versions) - set(SOFTWARE_KEYS))
    if unknown:
        raise ValueError(f"unknown software keys {unknown}; expected some of {SOFTWARE_KEYS}")
    return {k: str(versions.get(k, "")) for k in SOFTWARE_KEYS}


class _Device(Protocol):
    """What :func:`one_device` reads of a device (a ``DeviceRecord``)."""

    @property
    def id(self) -> int: ...

    @property
    def name(self) -> str: ...

    def hardware_key(self) -> tuple[str, str, int, int, int]: ...


D = TypeVar("D", bound=_Device)


def one_device(devices: Sequence[D], url: str) -> D:
    """The device an exported file of one device name describes: of store rows that share
    that name and differ only in total memory (which moves by a few MiB between drivers),
    the most recently added; ``ValueError`` when they differ in more (one file holds one
    device)."""
    rows = {d.id: d for d in devices}
    if len({d.hardware_key()[:4] for d in rows.values()}) > 1:
        keys = ", ".join(str(d.hardware_key()) for d in rows.values())
        raise ValueError(f"device name {devices[0].name!r} has several hardware keys "
                         f"in {url} ({keys}); expected one per name, since one file "
                         "holds one device: export with --device from separate databases")
    return rows[max(rows)]


def read_file(path: str | os.PathLike[str], limit: int) -> bytes:
    """The bytes of the file at ``path``, refusing one that is not a regular file or is
    over ``limit`` bytes before reading it: ``ImportRejected`` naming the path."""
    shown = printable(os.fspath(path))
    try:
        info = os.stat(path)
        if not stat.S_ISREG(info.st_mode):
            raise ImportRejected(f"{shown}: is not a regular file; expected a JSON file")
        if info.st_size > limit:
            raise ImportRejected(f"{shown}: is {info.st_size} bytes; expected at most "
                                 f"{limit} bytes (MAX_FILE_BYTES)")
        with open(path, "rb") as f:
            return f.read(limit + 1)
    except OSError as exc:
        raise ImportRejected(f"{shown}: cannot be read ({exc.strerror or exc}); expected a "
                             "readable JSON file") from None


# -- loading --------------------------------------------------------------------------------

def load(data: str | bytes, *, max_bytes: int, max_depth: int) -> Any:
    """The JSON value of ``data``, refusing what is too big, not UTF-8, nested deeper than
    ``max_depth``, not JSON, or holding NaN/Infinity, over-long integers or repeated keys."""
    if isinstance(data, str):
        if len(data) > max_bytes:
            raise Bad(f"is over {max_bytes} bytes; expected at most {max_bytes} bytes "
                      "(MAX_FILE_BYTES)")
        try:
            data = data.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise Bad(f"is not valid Unicode ({exc.reason} at character {exc.start}); "
                      "expected UTF-8 text") from None
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(f"data must be str or bytes, got {type(data).__name__}")
    raw = bytes(data)
    if len(raw) > max_bytes:
        raise Bad(f"is {len(raw)} bytes; expected at most {max_bytes} bytes (MAX_FILE_BYTES)")
    if not raw.strip():
        raise Bad(f"is empty; expected a JSON object (a {FORMAT} document)")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise Bad(f"is not UTF-8 (byte {exc.start} is {raw[exc.start]:#04x}); expected "
                  "UTF-8 JSON text") from None
    _check_depth(text, max_depth)
    try:
        return json.loads(text, parse_constant=_constant, parse_int=_int_literal,
                          parse_float=_float_literal, object_pairs_hook=_object)
    except json.JSONDecodeError as exc:
        raise Bad(f"is not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno}); "
                  "expected one complete JSON document") from None
    except RecursionError:
        raise Bad(f"is nested too deeply; expected at most {max_depth} levels") from None


def _check_depth(text: str, max_depth: int) -> None:
    brackets = _NOT_BRACKET.sub("", _STRING.sub("", text))
    if len(brackets) > max_depth and max(accumulate(map(_STEP.__getitem__, brackets))) \
            > max_depth:
        raise Bad(f"nests arrays/objects deeper than {max_depth} levels; expected at most "
                  f"{max_depth} (MAX_DEPTH)")


def _constant(name: str) -> Any:
    raise Bad(f"holds {name}, which is not JSON; expected finite numbers")


def _int_literal(text: str) -> int:
    if len(text.lstrip("-")) > _MAX_INT_DIGITS:
        raise Bad(f"holds an integer of {len(text.lstrip('-'))} digits; expected at most "
                  f"{_MAX_INT_DIGITS}")
    return int(text)


def _float_literal(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise Bad(f"holds the number {show(text, 40)}, beyond the float range; expected "
                  "finite numbers")
    return value


def _object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise Bad(f"repeats the key {show(key)} in one object; expected each key once")
        out[key] = value
    return out


# -- fields ---------------------------------------------------------------------------------

def fields(value: Any, where: str, keys: tuple[str, ...],
           optional: tuple[str, ...] = ()) -> dict[str, Any]:
    """``value`` as an object with exactly ``keys``, and any of ``optional``."""
    label = where or "the document"
    expected = f"an object with exactly the keys {', '.join(keys)}"
    if optional:
        expected += f" (and optionally {', '.join(optional)})"
    keys = (*keys, *optional)
    if not isinstance(value, dict):
        raise Bad(f"{where or 'the top level'} is {kind(value)}; expected {expected}")
    unknown = [k for k in value if k not in keys]
    if unknown:
        more = f" (and {len(unknown) - 1} more)" if len(unknown) > 1 else ""
        raise Bad(f"{label} has the unknown key {show(unknown[0])}{more}; expected {expected}")
    missing = [k for k in keys if k not in value and k not in optional]
    if missing:
        raise Bad(f"{label} lacks the key {missing[0]!r}; expected {expected}")
    return value


def integer(value: Any, where: str, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise Bad(f"{where} is {kind(value)}; expected an integer from {low} to {high}")
    return value


def number(value: Any, where: str, ok: Callable[[float], bool], expected: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not math.isfinite(value) or not ok(value):
        raise Bad(f"{where} is {kind(value)}; expected {expected}")
    return float(value)


def string(value: Any, where: str, pattern: re.Pattern[str] | None = None,
           rule: str = "") -> str:
    if not isinstance(value, str):
        raise Bad(f"{where} is {kind(value)}; expected a string{rule and ' of ' + rule}")
    if len(value) > MAX_STRING:
        raise Bad(f"{where} is a string of {len(value)} characters; expected at most "
                  f"{MAX_STRING}")
    if pattern is not None and pattern.fullmatch(value) is None:
        raise Bad(f"{where} is {show(value)}; expected {rule}")
    return value


def timestamp(value: Any, where: str) -> datetime:
    """An ISO 8601 timestamp with a timezone, as aware UTC."""
    rule = "an ISO 8601 time with a timezone, like '2025-01-31T12:00:00+00:00'"
    text = string(value, where, rule=rule)
    match = _ISO.fullmatch(text)
    if match is None:
        raise Bad(f"{where} is {show(text)}; expected {rule}")
    if match.group(1) is None:
        raise Bad(f"{where} is {show(text)}, without a timezone; expected {rule}")
    try:
        return datetime.fromisoformat(text.replace("Z", "+00:00")).astimezone(timezone.utc)
    except (ValueError, OverflowError) as exc:  # no such date; past year 9999 in UTC
        raise Bad(f"{where} is {show(text)} ({exc}); expected {rule}") from None


# -- the document's parts -------------------------------------------------------------------

def header(obj: Any) -> int:
    """The top level: an object of this format and a schema version this code reads (1 to
    ``SCHEMA_VERSION``), with exactly its keys; returns the schema version."""
    if not isinstance(obj, dict):
        raise Bad(f"the top level is {kind(obj)}; expected a JSON object (a {FORMAT} "
                  "document)")
    if obj.get("format") != FORMAT:
        got = kind(obj["format"]) if "format" in obj else "missing"
        raise Bad(f"format is {got}; expected {FORMAT!r} (not a flashtune configs file)")
    version = obj.get("schema_version")
    if not isinstance(version, bool) and isinstance(version, int) and version > SCHEMA_VERSION:
        raise Bad(f"schema_version is {version}: written by a newer flashtune (this is "
                  f"{__version__}, which reads schema_version 1 to {SCHEMA_VERSION}); "
                  f"expected at most {SCHEMA_VERSION}: upgrade flashtune to import it")
    version = integer(version, "schema_version", 1, SCHEMA_VERSION)
    fields(obj, "", TOP_KEYS)
    return version


def device(value: Any) -> tuple[str, str, int, int, int]:
    d = fields(value, "device", DEVICE_KEYS)
    cc = string(d["compute_capability"], "device.compute_capability",
                rule="a compute capability like '9.0', or 'cpu'")
    if cc != "cpu" and _CC.fullmatch(cc) is None:
        raise Bad(f"device.compute_capability is {show(cc)}; expected a compute capability "
                  "like '9.0' (digits.digits), or 'cpu'")
    name = string(d["name"], "device.name", _NAME, NAME_RULE)
    if ".." in name:
        raise Bad(f"device.name is {show(name)}; expected {NAME_RULE}")
    return (name, cc, integer(d["sm_count"], "device.sm_count", 1, 100_000),
            integer(d["shared_mem_per_block"], "device.shared_mem_per_block", 1, 2**31),
            integer(d["total_memory"], "device.total_memory", 0, 2**52))


def software(value: Any, where: str = "software") -> dict[str, str]:
    """A software block (the document's, or an entry's at ``where``): every key of
    ``SOFTWARE_KEYS``, each a string."""
    s = fields(value, where, SOFTWARE_KEYS)
    return {k: string(s[k], f"{where}.{k}") for k in SOFTWARE_KEYS}


def template(value: Any, specs: Mapping[str, TemplateSpec]
             ) -> tuple[str, str, TemplateSpec, type[AttentionProblem]]:
    """``(name, source_hash, spec, problem type)`` of a template ``specs`` holds (the
    registry's catalog)."""
    t = fields(value, "template", TEMPLATE_KEYS)
    name = string(t["name"], "template.name", _NAME, NAME_RULE)
    spec = specs.get(name)
    if spec is None:
        raise Bad(f"template.name is {name!r}, an unknown template; expected one of "
                  f"{', '.join(sorted(specs)) or 'none'}")
    problem_type = spec.problem_type
    source_hash = string(t["source_hash"], "template.source_hash", _HEX16,
                         "16 lowercase hex digits")
    return name, source_hash, spec, problem_type


def entry_list(value: Any, max_entries: int) -> list[Any]:
    if not isinstance(value, list):
        raise Bad(f"entries is {kind(value)}; expected a list of entries")
    if len(value) > max_entries:
        raise Bad(f"entries holds {len(value)} entries; expected at most {max_entries} "
                  "(MAX_ENTRIES)")
    return value


def entry(value: Any, where: str, spec: TemplateSpec, problem_type: type[AttentionProblem],
          version: int = SCHEMA_VERSION) -> dict[str, Any]:
    """The ``ConfigEntry`` fields of one entry of a ``version`` document; the config
    validated by ``spec.space``; ``software`` only when the entry has its own."""
    if version < 2 and isinstance(value, dict) and ENTRY_SOFTWARE in value:
        raise Bad(f"{where} has the key {ENTRY_SOFTWARE!r}, which schema_version {version} "
                  "does not allow; expected schema_version 2 for an entry's own software")
    e = fields(value, where, ENTRY_KEYS, (ENTRY_SOFTWARE,) if version >= 2 else ())
    key = problem(e["problem"], f"{where}.problem", problem_type)
    bucket = string(e["bucket"], f"{where}.bucket")
    if bucket != key.bucket():
        raise Bad(f"{where}.bucket is {show(bucket)}; expected {key.bucket()!r} (the "
                  "problem's bucket)")
    tflops = e["tflops"]
    own = {} if ENTRY_SOFTWARE not in e else \
        {"software": software(e[ENTRY_SOFTWARE], f"{where}.{ENTRY_SOFTWARE}")}
    return dict(
        **own, problem=key.key(), bucket=bucket,
        config=config(e["config"], f"{where}.config", spec),
        median_ms=number(e["median_ms"], f"{where}.median_ms", lambda v: 0 < v < 1e7,
                         "a finite number of milliseconds > 0 and < 1e7"),
        tflops=None if tflops is None else number(
            tflops, f"{where}.tflops", lambda v: 0 <= v <= 1e5,
            "null or a finite number from 0 to 1e5"),
        trials=integer(e["trials"], f"{where}.trials", 0, 10**9),
        tuned_at=timestamp(e["tuned_at"], f"{where}.tuned_at"))


def config(value: Any, where: str, spec: TemplateSpec) -> dict[str, int]:
    """The config at ``where``, checked against ``spec.space`` (every key a parameter,
    every value an allowed int) and returned as ``space.validate`` gives it (optional
    knobs filled in); an extern implementation's empty space takes only ``{}``."""
    from flashtune.core.errors import ConfigError

    params = tuple(spec.space.params)
    expected = f"the keys {', '.join(params)}" if params else "no keys (an empty space)"
    if not isinstance(value, dict):
        raise Bad(f"{where} is {kind(value)}; expected an object with {expected}")
    unknown = [k for k in value if k not in params]
    if unknown:
        raise Bad(f"{where} has the unknown key {show(unknown[0])}; expected "
                  + (f"keys among {', '.join(params)}" if params else
                     f"{{}}: {spec.name} has no parameters"))
    for name, v in value.items():
        allowed = spec.space.params[name]
        if isinstance(v, bool) or not isinstance(v, int) or v not in allowed:
            raise Bad(f"{where}.{name} is {kind(v)}, outside the search space; "
                      f"expected one of {', '.join(map(str, allowed))}")
    try:
        return spec.space.validate(value, argname=where)
    except ConfigError as exc:
        raise Bad(str(exc)) from None


def problem(value: Any, where: str,
            problem_type: type[AttentionProblem] = AttentionProblem) -> AttentionProblem:
    """The problem whose key is at ``where``: exactly ``problem_type``'s fields, each of
    its declared type, and a valid problem."""
    optional = tuple(n for n in problem_type.__dataclass_fields__ if n in OPTIONAL)
    names = tuple(n for n in problem_type.__dataclass_fields__ if n not in OPTIONAL)
    p = fields(value, where, names, optional)
    for name in ("window_left", "window_right"):
        if name in p:
            integer(p[name], f"{where}.{name}", -1, 2**31)
    if "softcap" in p:
        number(p["softcap"], f"{where}.softcap", lambda x: x >= 0, "a number >= 0 (0: none)")
    if "alibi" in p and not isinstance(p["alibi"], bool):
        raise Bad(f"{where}.alibi is {kind(p['alibi'])}; expected true or false")
    if "dropout" in p:
        number(p["dropout"], f"{where}.dropout", lambda x: 0 <= x < 1,
               "a probability in [0, 1) (0: none)")
    for name in ("tokens_q", "tokens_k"):
        if name in p:
            integer(p[name], f"{where}.{name}", 0, 2**31)
    for name, f in problem_type.__dataclass_fields__.items():
        if name in OPTIONAL:
            continue
        declared = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", "")
        if declared == "int":
            integer(p[name], f"{where}.{name}", 1, 2**31)
        elif declared == "bool" and not isinstance(p[name], bool):
            raise Bad(f"{where}.{name} is {kind(p[name])}; expected true or false")
        elif declared == "str":
            string(p[name], f"{where}.{name}")
    try:
        return problem_type.from_key(p)
    except ValueError as exc:
        raise Bad(f"{where} is not a valid problem ({exc}); expected the key of a valid "
                  f"{problem_type.__name__}") from None

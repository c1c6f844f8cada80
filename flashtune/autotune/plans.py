"""Tuning plans: a TOML file listing the shapes ``flashtune tune --plan FILE`` tunes.

Format::

    [[shape]]
    batch = 4
    heads = 32          # query heads
    kv_heads = 8        # optional, default: heads (MHA)
    seqlen = 4096       # query length
    kv_seqlen = 4096    # optional, default: seqlen
    head_dim = 128
    causal = true       # optional, default: false
    dtype = "bf16"      # optional, default: "bf16"; "fp16" or "bf16"
    window = [4095, 0]  # optional: FlashAttention-2's window_size (left, right), -1 unbounded
    softcap = 50.0      # optional: logit softcap (Gemma-2)
    alibi = true        # optional: ALiBi slopes (random ones when tuning)
    dropout = 0.1       # optional: attention dropout probability (FA2's dropout_p)

    [[shape]]           # a packed batch (flashtune.attention_varlen): no batch
    heads = 32
    kv_heads = 8
    head_dim = 128
    causal = true
    seqlen = 16384      # with "random:SEED": the tokens to fill
    varlen_lengths = "random:0"   # or [4096, 1000, ...], or "random:SEED:MIN-MAX"

A packed batch's lengths (``varlen_lengths``, ``flashtune tune --varlen-lengths``) are a
list of token counts, a file of them, or ``random:SEED[:MIN-MAX]``: documents of uniformly
drawn lengths in MIN-MAX (default 128-4096, the issue's packed-training mix) until they
fill ``seqlen`` tokens, the last one cut to fit (:func:`varlen_lengths`). The problem keeps
their count, longest and total (:meth:`AttentionProblem.from_lengths`).

A plan may also say which op it is for and what it is (top-level keys), and hold
``[[grid]]`` tables: the same fields, any of them a list, standing for every combination
(the product, in the order the fields are written). Three derived fields, in a grid or a
shape, keep a plan short and tied to one source of truth::

    op = "fwd"            # optional: the user op it is for; `tune --op` must agree
    description = "..."   # optional

    [[grid]]
    model = "llama3-8b"   # heads, kv_heads, head_dim of a preset model (presets.MODELS)
    tokens = 16384        # batch = max(1, tokens // seqlen), instead of batch
    seqlen = [512, 2048, 8192, 16384]
    causal = true

    [[grid]]
    hidden = 2048         # heads = hidden // head_dim (MHA unless kv_heads), instead of heads
    tokens = 16384
    head_dim = [64, 128]
    seqlen = [512, 1024]
    causal = [false, true]
    window = [[-1, -1], [255, 0]]   # in a grid, a list of [left, right] pairs (or one pair)

A problem listed twice (a grid overlapping a shape) is tuned once, where it first appears.

Plans ship in the package too (``flashtune/plans/*.toml``, :func:`packaged_plans`):
``flashtune tune --plan NAME`` takes one by name (:func:`resolve_plan`), as well as a path.
:func:`tune_command` writes the ``flashtune tune`` command that tunes one problem.

Every error is a :class:`PlanError` naming the file, the entry (``shape[2]``, ``grid[1]``,
1-based) and the field. Light to import: no torch or triton.
"""

from __future__ import annotations

import itertools
import re
import shlex
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flashtune.core.errors import FlashtuneError
from flashtune.core.problem import DTYPES, AttentionProblem
from flashtune.core.spec import USER_OPS

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

__all__ = ["PACKAGED_DIR", "RANDOM_LENGTHS", "SHIPPED_PLANS", "Plan", "PlanError", "load_plan",
           "packaged_plans", "parse_plan", "read_lengths", "read_plan", "resolve_plan",
           "shipped_plan", "tune_command", "varlen_lengths"]

_INT_FIELDS = ("batch", "heads", "kv_heads", "seqlen", "kv_seqlen", "head_dim")
_REQUIRED = ("batch", "heads", "seqlen", "head_dim")
_FIELDS = (*_INT_FIELDS, "causal", "dtype", "window", "softcap", "alibi", "dropout",
           "varlen_lengths")
# fields that stand for others: a preset model's geometry, a token budget, a hidden size
_DERIVED = ("model", "tokens", "hidden")
_TOP_KEYS = ("op", "description", "shape", "grid")
# random:SEED's document lengths when no MIN-MAX is given
RANDOM_LENGTHS = (128, 4096)
# the plans shipped in the package, by file stem
PACKAGED_DIR = Path(__file__).resolve().parent.parent / "plans"
_LENGTH_LIST = re.compile(r"\d+(,\d+)*")


class PlanError(FlashtuneError, ValueError):
    """A plan file that cannot be read or has an invalid entry."""


@dataclass(frozen=True)
class Plan:
    """A plan file's problems (in order, each once) and what it says of itself."""

    source: str
    problems: tuple[AttentionProblem, ...]
    op: str | None = None
    description: str = ""


def _positive(where: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise PlanError(f"{where}: expected a positive integer, got {value!r}")
    return value


def _derive(where: str, entry: Mapping[str, Any]) -> dict[str, Any]:
    """``entry`` with ``model``, ``tokens`` and ``hidden`` replaced by the fields they
    stand for."""
    out = dict(entry)
    if "model" in out:
        from flashtune.autotune.presets import MODELS

        name = out.pop("model")
        if not isinstance(name, str) or name.strip().lower() not in MODELS:
            raise PlanError(f"{where}.model: expected one of {', '.join(MODELS)}, got "
                            f"{name!r}")
        taken = [f for f in ("heads", "kv_heads", "head_dim", "hidden") if f in out]
        if taken:
            raise PlanError(f"{where}: model gives heads, kv_heads and head_dim; drop "
                            f"{', '.join(taken)}")
        geo = MODELS[name.strip().lower()]
        out.update(heads=geo.heads_q, kv_heads=geo.heads_kv, head_dim=geo.head_dim)
    if "hidden" in out:
        hidden = _positive(f"{where}.hidden", out.pop("hidden"))
        if "heads" in out:
            raise PlanError(f"{where}: hidden gives heads (hidden // head_dim); drop heads")
        if "head_dim" not in out:
            raise PlanError(f"{where}: hidden needs head_dim (heads = hidden // head_dim)")
        head_dim = _positive(f"{where}.head_dim", out["head_dim"])
        if hidden % head_dim:
            raise PlanError(f"{where}.hidden: {hidden} is not a multiple of head_dim "
                            f"{head_dim}")
        out["heads"] = hidden // head_dim
    if "tokens" in out:
        tokens = _positive(f"{where}.tokens", out.pop("tokens"))
        if "batch" in out or "varlen_lengths" in out:
            raise PlanError(f"{where}: tokens gives the batch (tokens // seqlen); drop "
                            f"batch (a packed batch takes seqlen as its tokens)")
        if "seqlen" not in out:
            raise PlanError(f"{where}: tokens needs seqlen (batch = tokens // seqlen)")
        out["batch"] = max(1, tokens // _positive(f"{where}.seqlen", out["seqlen"]))
    return out


def _shape(where: str, entry: Any, base: Path | None = None) -> AttentionProblem:
    if not isinstance(entry, Mapping):
        raise PlanError(f"{where}: expected a table, got {type(entry).__name__}")
    unknown = sorted(set(entry) - set(_FIELDS) - set(_DERIVED))
    if unknown:
        raise PlanError(f"{where}: unknown field(s) {', '.join(unknown)}; "
                        f"allowed: {', '.join((*_FIELDS, *_DERIVED))}")
    entry = _derive(where, entry)
    packed = "varlen_lengths" in entry
    for name in _REQUIRED:
        if name not in entry and not (packed and name in ("batch", "seqlen")):
            raise PlanError(f"{where}: missing required field '{name}'")
    if packed and ("batch" in entry or "kv_seqlen" in entry):
        raise PlanError(f"{where}: a packed batch (varlen_lengths) takes no batch or "
                        f"kv_seqlen: its lengths give them")
    for name in _INT_FIELDS:
        if name in entry:
            value = entry[name]
            if isinstance(value, bool) or not isinstance(value, int):
                raise PlanError(f"{where}.{name}: expected an integer, got {value!r}")
            if value < 1:
                raise PlanError(f"{where}.{name}: must be positive, got {value}")
    causal = entry.get("causal", False)
    if not isinstance(causal, bool):
        raise PlanError(f"{where}.causal: expected true or false, got {causal!r}")
    dtype = entry.get("dtype", "bf16")
    if dtype not in DTYPES:
        raise PlanError(f"{where}.dtype: expected one of {', '.join(DTYPES)}, got {dtype!r}")
    window = entry.get("window", [-1, -1])
    if not isinstance(window, list) or len(window) != 2 or any(
            isinstance(w, bool) or not isinstance(w, int) or w < -1 for w in window):
        raise PlanError(f"{where}.window: expected [left, right], integers >= -1 (-1: "
                        f"unbounded), got {window!r}")
    softcap = entry.get("softcap", 0.0)
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or softcap < 0:
        raise PlanError(f"{where}.softcap: expected a number >= 0, got {softcap!r}")
    alibi = entry.get("alibi", False)
    if not isinstance(alibi, bool):
        raise PlanError(f"{where}.alibi: expected true or false, got {alibi!r}")
    dropout = entry.get("dropout", 0.0)
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) \
            or not 0 <= dropout < 1:
        raise PlanError(f"{where}.dropout: expected a probability in [0, 1), got {dropout!r}")
    heads = entry["heads"]
    if packed:
        spec = entry["varlen_lengths"]
        if isinstance(spec, str) and not spec.startswith("random:") and base is not None \
                and not _LENGTH_LIST.fullmatch(spec):
            spec = str(base / spec)  # a lengths file beside the plan
        lengths = varlen_lengths(spec, entry.get("seqlen"), f"{where}.varlen_lengths")
        try:
            return AttentionProblem.from_lengths(
                lengths, None, heads_q=heads, heads_kv=entry.get("kv_heads", heads),
                head_dim=entry["head_dim"], causal=causal, dtype=dtype,
                window_left=window[0], window_right=-1 if causal else window[1],
                softcap=float(softcap), alibi=alibi, dropout=float(dropout))
        except ValueError as exc:
            raise PlanError(f"{where}: {exc}") from exc
    try:
        return AttentionProblem(entry["batch"], heads, entry.get("kv_heads", heads),
                                entry["seqlen"], entry.get("kv_seqlen", entry["seqlen"]),
                                entry["head_dim"], causal, dtype, window[0],
                                -1 if causal else window[1], float(softcap), alibi,
                                dropout=float(dropout))
    except ValueError as exc:
        raise PlanError(f"{where}: {exc}") from exc


def _grid(where: str, grid: Any) -> list[tuple[str, dict[str, Any]]]:
    """The shapes a ``[[grid]]`` table stands for, each with where it came from."""
    if not isinstance(grid, Mapping):
        raise PlanError(f"{where}: expected a table, got {type(grid).__name__}")
    if not grid:
        raise PlanError(f"{where}: an empty grid; give the shape's fields")
    axes: list[tuple[str, list[Any]]] = []
    for name, value in grid.items():
        if name == "window":  # one [left, right] pair, or a list of them
            values = value if isinstance(value, list) and value \
                and all(isinstance(v, list) for v in value) else [value]
        elif name == "varlen_lengths":  # a list of token counts is one value
            values = [value]
        else:
            values = value if isinstance(value, list) else [value]
        if not values:
            raise PlanError(f"{where}.{name}: an empty list; give at least one value")
        axes.append((name, values))
    out = []
    for combo in itertools.product(*(values for _, values in axes)):
        entry = {name: value for (name, _), value in zip(axes, combo)}
        label = ", ".join(f"{k}={v}" for (k, vs), v in zip(axes, combo) if len(vs) > 1)
        out.append((f"{where}{f' ({label})' if label else ''}", entry))
    return out


def parse_plan(text: str, source: str = "<plan>",
               base: Path | None = None) -> list[AttentionProblem]:
    """The problems of the plan ``text``; ``source`` names it in error messages; a
    lengths file it names is read relative to ``base`` (the plan's folder)."""
    return list(_parse(text, source, base).problems)


def _parse(text: str, source: str, base: Path | None) -> Plan:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise PlanError(f"{source}: not valid TOML: {exc}") from exc
    extra = sorted(set(data) - set(_TOP_KEYS))
    if extra:
        raise PlanError(f"{source}: unknown top-level key(s) {', '.join(extra)}; "
                        f"expected op, description, [[shape]] and [[grid]] tables")
    op = data.get("op")
    if op is not None and op not in USER_OPS:
        raise PlanError(f"{source}: op: expected one of {', '.join(USER_OPS)}, got {op!r}")
    description = data.get("description", "")
    if not isinstance(description, str):
        raise PlanError(f"{source}: description: expected a string, got {description!r}")
    entries: list[tuple[str, Any]] = []
    for key in ("shape", "grid"):
        tables = data.get(key, [])
        if not isinstance(tables, list):
            raise PlanError(f"{source}: no [[{key}]] tables: {key} = {tables!r} is not a "
                            f"list of tables")
        for i, table in enumerate(tables, 1):
            where = f"{source}: {key}[{i}]"
            entries.extend(_grid(where, table) if key == "grid" else [(where, table)])
    if not entries:
        raise PlanError(f"{source}: no [[shape]] tables (nor [[grid]] tables); add at "
                        f"least one")
    problems = dict.fromkeys(_shape(where, entry, base) for where, entry in entries)
    return Plan(source, tuple(problems), op, description)


def load_plan(path: str | Path) -> list[AttentionProblem]:
    """The problems of the plan file at ``path``."""
    return list(read_plan(path).problems)


def read_plan(path: str | Path) -> Plan:
    """The plan file at ``path`` (a path, or a packaged plan's name: :func:`resolve_plan`)."""
    path = resolve_plan(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise PlanError(f"cannot read plan {path}: {exc}") from exc
    return _parse(text, str(path), path.parent)


def packaged_plans() -> list[str]:
    """The names of the plans shipped in the package (``flashtune/plans/NAME.toml``)."""
    if not PACKAGED_DIR.is_dir():
        return []
    return sorted(p.stem for p in PACKAGED_DIR.glob("*.toml") if p.is_file())


def resolve_plan(name_or_path: str | Path) -> Path:
    """The plan file ``name_or_path`` names: an existing file, else the packaged plan of
    that name (``shipped-fwd``, or ``shipped-fwd.toml``). ``PlanError`` listing the
    packaged plans for anything else."""
    path = Path(name_or_path)
    if path.is_file():
        return path
    text = str(name_or_path)
    stem = text[:-len(".toml")] if text.endswith(".toml") else text
    if "/" not in text and "\\" not in text and stem in packaged_plans():
        return PACKAGED_DIR / f"{stem}.toml"
    names = ", ".join(packaged_plans()) or "none"
    what = "is not a file" if path.exists() else "does not exist"
    raise PlanError(f"cannot read plan {text!r}: it {what} and is not a packaged plan; "
                    f"packaged plans: {names} (or give a TOML file's path)")


# the packaged plan that holds each op's shapes (a backward template's: the training step's)
SHIPPED_PLANS = {"fwd": "shipped-fwd", "train": "shipped-train", "bwd": "shipped-train",
                 "decode": "shipped-decode"}


def shipped_plan(op: str) -> str | None:
    """The packaged plan (:data:`SHIPPED_PLANS`) whose shapes the shipped tables of ``op``
    (a user op, or a template's op such as ``bwd``) are tuned on; None for another op."""
    return SHIPPED_PLANS.get(op)


def tune_command(problem: AttentionProblem | None, *, op: str | None = None,
                 template: str | None = None, plan: str | None = None) -> str:
    """The ``flashtune tune`` command that tunes ``problem`` (``op``: across the op's
    implementations; ``template``: that template's configs; ``plan``: instead of the
    shape, the plan holding it). ``ValueError`` for a packed batch whose key and value
    lengths differ (no shape option says that: put it in a plan)."""
    if (op is None) == (template is None):
        raise ValueError("give exactly one of op and template")
    args = ["flashtune", "tune", *(("--op", op) if op else ("--template", str(template)))]
    if plan is not None:
        return " ".join([*args, "--plan", shlex.quote(plan)])
    if problem is None:
        raise ValueError("give the problem, or the plan holding it")
    p = problem
    if p.packed:
        lengths_q, lengths_k = p.packed_lengths()
        if lengths_q != lengths_k:
            raise ValueError(f"{p.describe()}: a packed batch with other key lengths than "
                             f"query lengths has no shape options; tune it from a plan")
        args += ["--varlen-lengths", ",".join(str(n) for n in lengths_q)]
    else:
        args += ["--batch", str(p.batch)]
    args += ["--heads", str(p.heads_q)]
    if p.heads_kv != p.heads_q:
        args += ["--kv-heads", str(p.heads_kv)]
    if not p.packed:
        args += ["--seqlen", str(p.seqlen_q)]
        if p.seqlen_k != p.seqlen_q:
            args += ["--kv-seqlen", str(p.seqlen_k)]
    args += ["--head-dim", str(p.head_dim), *(["--causal"] if p.causal else []),
             "--dtype", p.dtype]
    if (p.window_left, p.window_right) != (-1, -1):
        args += ["--window", f"{p.window_left},{p.window_right}"]
    if p.softcap:
        args += ["--softcap", f"{p.softcap:g}"]
    if p.alibi:
        args.append("--alibi")
    if p.dropout:
        args += ["--dropout", f"{p.dropout:g}"]
    return " ".join(args)


def varlen_lengths(spec: Any, total: int | None, where: str = "varlen_lengths") -> list[int]:
    """A packed batch's sequence lengths from ``spec``: a list of token counts (or a
    string of them, comma-separated: ``"4096,1000,2048"``),
    ``"random:SEED[:MIN-MAX]"`` (documents of uniform random lengths in MIN-MAX, default
    :data:`RANDOM_LENGTHS`, drawn with ``random.Random(SEED)`` until they fill ``total``
    tokens, the last cut to fit), or a file's path (:func:`read_lengths`). ``PlanError``
    naming ``where`` for anything else."""
    import random

    if isinstance(spec, list):
        if not spec or any(isinstance(n, bool) or not isinstance(n, int) or n < 1
                           for n in spec):
            raise PlanError(f"{where}: expected a non-empty list of positive token counts, "
                            f"got {spec!r}")
        return list(spec)
    if not isinstance(spec, str) or not spec:
        raise PlanError(f"{where}: expected a list of token counts, a file or "
                        f"'random:SEED[:MIN-MAX]', got {spec!r}")
    if _LENGTH_LIST.fullmatch(spec) and not Path(spec).exists():  # "4096,1000,..."
        return varlen_lengths([int(n) for n in spec.split(",")], None, where)
    if not spec.startswith("random:"):
        return read_lengths(spec, where)
    parts = spec.split(":")
    try:
        seed = int(parts[1])
        low, high = (int(x) for x in parts[2].split("-")) if len(parts) == 3 \
            else RANDOM_LENGTHS
        if len(parts) > 3 or not 1 <= low <= high:
            raise ValueError
    except (ValueError, IndexError):
        raise PlanError(f"{where}: expected 'random:SEED' or 'random:SEED:MIN-MAX' "
                        f"(integers, 1 <= MIN <= MAX), got {spec!r}") from None
    if total is None or isinstance(total, bool) or not isinstance(total, int) or total < 1:
        raise PlanError(f"{where}: {spec!r} needs the tokens to fill (--seqlen, or seqlen "
                        f"in a plan), got {total!r}")
    rng = random.Random(seed)
    lengths: list[int] = []
    while sum(lengths) < total:
        lengths.append(min(rng.randint(low, high), total - sum(lengths)))
    return lengths


def read_lengths(path: str | Path, where: str = "varlen_lengths") -> list[int]:
    """The token counts in the file at ``path``: integers separated by whitespace or
    commas (a JSON list reads too), ``#`` starting a comment."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise PlanError(f"{where}: cannot read lengths file {path}: {exc}") from exc
    body = " ".join(line.split("#", 1)[0] for line in text.splitlines())
    words = body.replace(",", " ").replace("[", " ").replace("]", " ").split()
    try:
        lengths = [int(w) for w in words]
    except ValueError:
        raise PlanError(f"{where}: {path} must hold integers (token counts), separated by "
                        f"whitespace or commas") from None
    return varlen_lengths(lengths, None, f"{where} ({path})")

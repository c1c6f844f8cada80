"""FlashAttention-2's own test file, unchanged, against :mod:`flashtune.flash_attn_interface`
(GPU only, marker ``gpu``).

``test_flash_attn.py`` is ``tests/test_flash_attn.py`` of Dao-AILab/flash-attention at commit
``0251105a2fb19d2957484b7f023cd8c115286ced`` (BSD 3-Clause: ``LICENSE.flash-attention``), byte
for byte. It imports ``flash_attn``: during collection ``shim/`` goes first on ``sys.path``,
whose ``flash_attn`` package is flashtune's interface plus FlashAttention-2's helpers the file
imports (``bert_padding``, ``layers.rotary`` with its Triton kernel), vendored; ``einops``, if
missing, is :mod:`tests.fa2_suite.einops_lite`. Both leave ``sys.path``/``sys.modules`` when
collection ends, so no other test sees a ``flash_attn`` package.

The file has 508,777 cases (days on one GPU). A run takes a fixed-seed sample of
``$FLASHTUNE_FA2_CASES`` per test function (default 40: 513 cases; ``all`` for every case),
seed ``$FLASHTUNE_FA2_SEED`` (default 0), optionally part ``i/n`` of it
(``$FLASHTUNE_FA2_SHARD``, every n-th case, so each function spreads over the shards). The
sample is drawn in ``pytest_generate_tests`` from the product of each function's parametrize
marks, before pytest makes an item of every case (which took 2.5 minutes on a CPU); the ids
are pytest's own. :data:`TABLE`, applied before sampling for ``deselect`` and to the
sample for ``skip``/``xfail``, is the one list of cases not run as they stand and why; the
terminal summary (and the JUnit XML's properties) count each row. ``xfail`` rows are strict
and expect flashtune's ``InputError``: a case marked for a missing feature must be refused with
a clear error, and one that passes fails the run (the row is stale). Features are probed, not
assumed: the rows follow ``flashtune.attention``'s and ``attention_with_kvcache``'s
signatures and the head dims their checks accept.

Run (GPU machine): ``FLASHTUNE_TEST_DEVICE=cuda python -m pytest tests/fa2_suite -p
no:cacheprovider -q --junitxml=fa2.xml`` then ``python benchmarks/fa2_suite_report.py
fa2.xml``. On CPU the file is not even imported (it reads the CUDA device at import): one
skipped placeholder. ``FLASHTUNE_FA2_DRY=1`` collects it on CPU against a pretend H100 to see
the sample (``--collect-only``; running skips every case).
"""

from __future__ import annotations

import functools
import importlib.util
import itertools
import os
import signal
import sys
import types
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import DEVICE
from tests.fa2_suite import sampling

HERE = Path(__file__).resolve().parent
SUITE = HERE / "test_flash_attn.py"
SHIM = HERE / "shim"
DRY = os.environ.get("FLASHTUNE_FA2_DRY", "") == "1"
ACTIVE = DEVICE == "cuda" or DRY

Params = dict[str, Any]


# -- what flashtune serves today (probed, so the table follows the code) -----------------------


@functools.cache
def accepts(op: str, name: str) -> bool:
    """Whether flashtune's ``op`` (``attention``, ``attention_with_kvcache``) takes ``name``."""
    import flashtune
    from flashtune.integrations.flash_attn import accepts as takes

    return takes(getattr(flashtune, op), name)


@functools.cache
def serves_head_dim(d: int, decode: bool) -> bool:
    """Whether flashtune's checks accept head dim ``d`` (metadata only: nothing launches)."""
    from flashtune.core.errors import InputError
    from flashtune.runtime import checks, kvcache

    t = torch.empty(1, 1, 1, d, dtype=torch.float16, device=DEVICE)
    try:
        if decode:
            lens = torch.ones(1, dtype=torch.int32, device=DEVICE)
            kvcache.check_kvcache_inputs(t, t, t, lens, None, None)
        else:
            checks.check_attention_inputs(t, t, t, None)
    except InputError as exc:
        return "head_dim" not in str(exc)
    return True


def _decode_route(test: str, p: Params) -> bool:
    """The case's flashtune op is attention_with_kvcache (the KV-cache call, varlen over a
    paged cache)."""
    return test == "test_flash_attn_kvcache" or p.get("paged_kv_block_size") is not None


# -- THE TABLE: every case not run as it stands, and why ---------------------------------------


@dataclass(frozen=True)
class Rule:
    """One row: ``action`` (``deselect``: not collected; ``skip``; ``xfail``: expected to be
    refused with flashtune's InputError) for the cases of ``tests`` (None: every function)
    whose parameters match ``when``."""

    action: str
    tests: frozenset[str] | None
    when: Callable[[str, Params], bool]
    reason: str

    def applies(self, test: str, p: Params) -> bool:
        return (self.tests is None or test in self.tests) and self.when(test, p)


S_DMASK = frozenset({"test_flash_attn_qkvpacked", "test_flash_attn_varlen_qkvpacked",
                     "test_flash_attn_output", "test_flash_attn_varlen_output"})
KVCACHE = frozenset({"test_flash_attn_kvcache"})


def _always(test: str, p: Params) -> bool:
    return True


TABLE: tuple[Rule, ...] = (
    Rule("deselect", S_DMASK, lambda t, p: p["dropout_p"] > 0,
         "reads FlashAttention-2's internal dropout-mask encoding (the sign bits of S_dmask, "
         "convert_flash_attn_S_to_softmax); flashtune returns None in that slot"),
    Rule("deselect", KVCACHE, lambda t, p: p["seqlen_q"] > p["seqlen_k"] and p["new_kv"],
         "skipped by the test itself (seqlen_q > seqlen_k with new_kv)"),
    Rule("deselect", KVCACHE, lambda t, p: not p["new_kv"] and p["rotary_fraction"] > 0,
         "skipped by the test itself (rotary without new_kv)"),
    Rule("deselect", KVCACHE,
         lambda t, p: (p["has_leftpad"] or p["has_batch_idx"])
         and p["paged_kv_block_size"] is not None,
         "skipped by the test itself (leftpad or batch_idx with a paged cache)"),
    Rule("skip", frozenset({"test_flash_attn_varlen_paged_kv_num_splits"}), _always,
         "calls FlashAttention-2's private _flash_attn_varlen_forward (seqused_k, the C++ "
         "error for num_splits > 1), not its public API"),
    Rule("skip", frozenset({"test_flash_attn_generator_arg_must_be_none"}), _always,
         "calls FlashAttention-2's compiled extension (flash_attn_gpu.fwd/bwd/varlen_*) "
         "directly, not its public API"),
    Rule("xfail", None,
         lambda t, p: p.get("dropout_p", 0.0) > 0 and not accepts("attention", "dropout_p"),
         "dropout: not in flashtune yet (issue 31, item 2)"),
    Rule("xfail", None,
         lambda t, p: "d" in p and not serves_head_dim(p["d"], _decode_route(t, p)),
         "head dim not served by flashtune yet (issue 31, item 1)"),
    Rule("xfail", KVCACHE,
         lambda t, p: p["new_kv"] and not accepts("attention_with_kvcache", "k"),
         "KV-cache call: in-place append of new k/v not in flashtune yet (issue 31, item 4)"),
    Rule("xfail", KVCACHE,
         lambda t, p: p["rotary_fraction"] > 0
         and not accepts("attention_with_kvcache", "rotary_cos"),
         "KV-cache call: rotary embedding not in flashtune yet (issue 31, item 4)"),
    Rule("xfail", KVCACHE,
         lambda t, p: p["has_leftpad"] and not accepts("attention_with_kvcache", "cache_leftpad"),
         "KV-cache call: cache_leftpad not in flashtune yet (issue 31, item 4)"),
    Rule("xfail", KVCACHE,
         lambda t, p: p["has_batch_idx"]
         and not accepts("attention_with_kvcache", "cache_batch_idx"),
         "KV-cache call: cache_batch_idx not in flashtune yet (issue 31, item 4)"),
)


# -- collection ----------------------------------------------------------------------------


def _pretend_h100() -> None:
    """``FLASHTUNE_FA2_DRY=1`` on a CPU machine: the test file's module-level device queries
    answer as an H100 would, so it collects."""
    torch.cuda.get_device_capability = lambda *a, **k: (9, 0)  # type: ignore[assignment]
    torch.cuda.get_device_properties = (  # type: ignore[assignment]
        lambda *a, **k: types.SimpleNamespace(total_memory=80 * 2**30, name="dry run"))


_INSTALLED: list[str] = []


def _install_shim() -> None:
    for name in [n for n in sys.modules if n == "flash_attn" or n.startswith("flash_attn.")]:
        del sys.modules[name]
    sys.path.insert(0, str(SHIM))
    if importlib.util.find_spec("einops") is None:
        from tests.fa2_suite import einops_lite

        sys.modules["einops"] = einops_lite
        _INSTALLED.append("einops")


def _remove_shim() -> None:
    if str(SHIM) in sys.path:
        sys.path.remove(str(SHIM))
    for name in [n for n in sys.modules if n == "flash_attn" or n.startswith("flash_attn.")]:
        del sys.modules[name]
    for name in _INSTALLED:
        sys.modules.pop(name, None)
    _INSTALLED.clear()


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


if ACTIVE:
    if DRY and DEVICE != "cuda":
        _pretend_h100()
    _install_shim()
    # a `timeout` (SIGTERM) ends a long GPU run as Ctrl-C does: pytest stops (the case in
    # progress not counted) and still writes the JUnit XML of the cases done
    signal.signal(signal.SIGTERM, _interrupt)


class _NoGpuSuite(pytest.File):
    """FlashAttention-2's file on a machine without the GPU run: not imported (it queries
    the CUDA device at import), one skipped placeholder instead."""

    def collect(self) -> Iterator[pytest.Item]:
        yield _NoGpuItem.from_parent(self, name="test_flash_attn")


class _NoGpuItem(pytest.Item):
    def runtest(self) -> None:
        pytest.skip("FlashAttention-2's test suite needs a CUDA GPU: run with "
                    "FLASHTUNE_TEST_DEVICE=cuda (tests/fa2_suite/conftest.py)")

    def reportinfo(self) -> tuple[Path, int | None, str]:
        return self.path, None, "FlashAttention-2's test suite (GPU only)"


def pytest_pycollect_makemodule(module_path: Path, parent: pytest.Collector) -> Any:
    if module_path == SUITE and not ACTIVE:
        return _NoGpuSuite.from_parent(parent, path=module_path)
    return None


# counts for the summary: (action, reason) -> cases; test -> [cases, eligible, sampled]
_ROWS: Counter[tuple[str, str]] = Counter()
_FUNCTIONS: dict[str, list[int]] = {}


def _value_id(argname: str, value: Any, index: int) -> str:
    """pytest's id of one parameter value: the value for str/int/float/bool/None, else
    ``<argname><index>`` (``dtype0``)."""
    if value is None or isinstance(value, (str, int, float, bool)):
        return str(value)
    return f"{argname}{index}"


def _cases(marks: list[Any]) -> tuple[list[str], Iterator[tuple[str, tuple[Any, ...]]]]:
    """The function's argnames and its ``(id, values)`` cases: the product of its
    parametrize marks, ids as pytest writes them (the bottom decorator's first)."""
    argnames: list[str] = []
    axes: list[list[tuple[str, tuple[Any, ...]]]] = []
    for mark in marks:
        names = mark.args[0]
        names = [n.strip() for n in names.split(",")] if isinstance(names, str) else list(names)
        values = []
        for index, value in enumerate(mark.args[1]):
            value = tuple(value) if len(names) > 1 else (value,)
            ident = "-".join(_value_id(n, v, index) for n, v in zip(names, value))
            values.append((ident, value))
        argnames += names
        axes.append(values)

    def product() -> Iterator[tuple[str, tuple[Any, ...]]]:
        for combo in itertools.product(*axes):
            yield "-".join(c[0] for c in combo), tuple(v for c in combo for v in c[1])
    return argnames, product()


@pytest.hookimpl(tryfirst=True)
def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Sample FlashAttention-2's cases before pytest makes an item of each (making all
    ~5 x 10^5 took minutes): the function's parametrize marks are replaced by one
    parametrization of its sampled cases, deselect rows applied first."""
    if not ACTIVE or Path(str(metafunc.definition.path)) != SUITE:
        return
    test = metafunc.function.__name__
    marks = [m for m in metafunc.definition.own_markers if m.name == "parametrize"]
    if not marks:
        _FUNCTIONS[test] = [1, 1, 0]
        return
    metafunc.definition.own_markers[:] = [m for m in metafunc.definition.own_markers
                                          if m.name != "parametrize"]
    argnames, cases = _cases(marks)
    deselect = [r for r in TABLE if r.action == "deselect" and r.tests is not None
                and test in r.tests]
    total, eligible = 0, []
    for ident, values in cases:
        total += 1
        if deselect:
            params = dict(zip(argnames, values))
            row = next((r for r in deselect if r.when(test, params)), None)
            if row is not None:
                _ROWS[(row.action, row.reason)] += 1
                continue
        eligible.append((ident, (ident, values)))
    chosen = sampling.sample({test: eligible}, _settings()[0], _settings()[1])[test]
    _FUNCTIONS[test] = [total, len(eligible), 0]
    metafunc.parametrize(argnames, [values for _, values in chosen],
                         ids=[ident for ident, _ in chosen])


@functools.cache
def _settings() -> tuple[int | None, int, tuple[int, int] | None]:
    """(cases per function, seed, shard) from the environment."""
    return (sampling.parse_cases(os.environ.get("FLASHTUNE_FA2_CASES")),
            int(os.environ.get("FLASHTUNE_FA2_SEED", sampling.DEFAULT_SEED)),
            sampling.parse_shard(os.environ.get("FLASHTUNE_FA2_SHARD")))


@pytest.hookimpl(tryfirst=True)  # before `-m gpu` reads the marks
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Shard the sample, mark it ``gpu``, and apply the table's skip and xfail rows."""
    if not ACTIVE:
        return
    suite = [it for it in items if Path(str(it.path)) == SUITE]
    if not suite:
        return
    n, seed, part = _settings()
    keep = sampling.shard(suite, part)
    from flashtune.core.errors import InputError

    for item in keep:
        test = getattr(item, "originalname", item.name)
        params = dict(item.callspec.params) if hasattr(item, "callspec") else {}
        _FUNCTIONS.setdefault(test, [1, 1, 0])[2] += 1
        item.add_marker(pytest.mark.gpu)
        if DRY and DEVICE != "cuda":
            item.add_marker(pytest.mark.skip(reason="FLASHTUNE_FA2_DRY: collection only"))
        rows = [r for r in TABLE if r.action != "deselect" and r.applies(test, params)]
        for r in rows:
            _ROWS[(r.action, r.reason)] += 1
        skips = [r.reason for r in rows if r.action == "skip"]
        xfails = [r.reason for r in rows if r.action == "xfail"]
        if skips:
            item.add_marker(pytest.mark.skip(reason="; ".join(skips)))
        elif xfails:
            item.add_marker(pytest.mark.xfail(reason="; ".join(xfails), raises=InputError,
                                              strict=True))
    if len(keep) != len(suite):
        kept = set(map(id, keep))
        config.hook.pytest_deselected(items=[it for it in suite if id(it) not in kept])
        items[:] = [it for it in items if Path(str(it.path)) != SUITE or id(it) in kept]
    _record(config, n, seed, part)


def _record(config: pytest.Config, n: int | None, seed: int,
            part: tuple[int, int] | None) -> None:
    """The selection into the JUnit XML's properties (benchmarks/fa2_suite_report.py)."""
    try:
        from _pytest.junitxml import xml_key
    except ImportError:  # pragma: no cover - pytest moved it
        return
    xml = config.stash.get(xml_key, None)
    if xml is None:
        return
    xml.add_global_property("fa2_commit", "0251105a2fb19d2957484b7f023cd8c115286ced")
    xml.add_global_property("fa2_cases_per_function", "all" if n is None else str(n))
    xml.add_global_property("fa2_seed", str(seed))
    xml.add_global_property("fa2_shard", "" if part is None else f"{part[0]}/{part[1]}")
    for test, (collected, eligible, sampled) in sorted(_FUNCTIONS.items()):
        xml.add_global_property(f"fa2_function {test}", f"{collected} {eligible} {sampled}")
    for (action, reason), count in sorted(_ROWS.items()):
        xml.add_global_property(f"fa2_{action} {reason}", str(count))


def pytest_collection_finish(session: pytest.Session) -> None:
    if ACTIVE:
        _remove_shim()


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not _FUNCTIONS:
        return
    tr = terminalreporter
    tr.section("FlashAttention-2 suite: selection (tests/fa2_suite/conftest.py TABLE)")
    tr.write_line(f"{'test function':44} {'cases':>7} {'eligible':>8} {'this run':>8}")
    for test, (collected, eligible, sampled) in sorted(_FUNCTIONS.items()):
        tr.write_line(f"{test:44} {collected:7} {eligible:8} {sampled:8}")
    total = [sum(c[i] for c in _FUNCTIONS.values()) for i in range(3)]
    tr.write_line(f"{'total':44} {total[0]:7} {total[1]:8} {total[2]:8}")
    for (action, reason), count in sorted(_ROWS.items()):
        where = "of all cases" if action == "deselect" else "of the sample"
        tr.write_line(f"{action:8} {count:6} {where}: {reason}")

"""The configs shipped in ``flashtune/configs/``: valid, current, and what an H100 or an
H200 gets with no tuning database and no config folder (a fresh install)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

import flashtune
from flashtune.autotune.presets import preset
from flashtune.core.device import DeviceFingerprint
from flashtune.core.problem import AttentionProblem
from flashtune.core.spec import op_implementations
from flashtune.db.exchange import choice_file_name, config_file_name, parse_document
from flashtune.db.exchange_choices import read_choice_document
from flashtune.kernel_templates import (
    catalog,  # noqa: E402
    get_template,
)
from flashtune.runtime import sources
from flashtune.runtime.lookup import Dispatcher

SPECS = catalog()

PACKAGE = Path(flashtune.__file__).parent / "configs"
FILES = sorted(p for p in PACKAGE.glob("*.json") if ",template=" in p.name)
OP_FILES = sorted(p for p in PACKAGE.glob("*.json") if ",op=" in p.name)
SPEC = get_template("attn_fwd")
H100 = DeviceFingerprint("NVIDIA_H100_80GB_HBM3", "9.0", 132, 232448, 85 << 30)


def test_an_h100_config_file_is_shipped():
    assert PACKAGE / config_file_name(H100.name, "attn_fwd") in FILES


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_shipped_files_are_valid_current_and_named_by_the_loader(path):
    doc = parse_document(path.read_text(), specs=SPECS)  # the importer's strict validation
    assert path.name == config_file_name(doc.device.name, doc.template)
    spec = get_template(doc.template)
    assert doc.source_hash == spec.source_hash, (
        f"{path.name} was tuned for {doc.template}@{doc.source_hash}, the template is now "
        f"@{spec.source_hash}: re-tune on the GPU (see flashtune/configs/README.md)")
    assert doc.software["triton"] and doc.software["torch"]
    device = _fingerprint(doc.device)
    for entry in doc.entries:
        problem = AttentionProblem.from_key(entry.problem)
        assert spec.space.check(spec.space.validate(entry.config), problem, device) is None


def _fingerprint(info) -> DeviceFingerprint:
    return DeviceFingerprint(info.name, info.compute_capability, info.sm_count,
                             info.shared_mem_per_block, info.total_memory)


def test_every_shipped_file_is_of_one_kind_or_the_other():
    assert sorted(PACKAGE.glob("*.json")) == sorted(FILES + OP_FILES)


@pytest.mark.parametrize("path", OP_FILES, ids=lambda p: p.name)
def test_shipped_op_choices_are_valid_and_current_for_flashtunes_kernels(path):
    """Own kernels' choices must be current (a kernel change re-tunes them); an SDPA
    backend's, and a pair's with its forward (``torch_bound``), carry the torch and cuDNN of
    the GPU that timed them, which a reader with another torch treats as stale (its calls
    there take the default)."""
    doc = read_choice_document(path, specs=SPECS)  # the importer's strict validation
    assert path.name == choice_file_name(doc.device.name, doc.op)
    serving = op_implementations(SPECS, doc.op)
    winners = {e.implementation for e in doc.entries}
    for name in winners:
        if not serving[name].torch_bound:
            assert doc.implementations[name] == serving[name].source_hash, (
                f"{path.name}: {name} was tuned at {doc.implementations[name]}, it is now "
                f"@{serving[name].source_hash}: re-tune on the GPU (flashtune/configs/README.md)")
    assert doc.software["triton"] and doc.software["torch"]
    device = _fingerprint(doc.device)
    for entry in doc.entries:
        if doc.is_current(entry, {n: s.source_hash for n, s in serving.items()}):
            spec = serving[entry.implementation]
            problem = AttentionProblem.from_key(entry.problem)
            assert spec.space.check(spec.space.validate(entry.config), problem, device) is None


@pytest.fixture
def fresh_install(tmp_path, monkeypatch):
    """No database file, no config folder: only the package's configs."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # the default database: not there
    monkeypatch.delenv("FLASHTUNE_DB", raising=False)
    monkeypatch.delenv("FLASHTUNE_CONFIG_DIR", raising=False)
    monkeypatch.delenv("FLASHTUNE_DEVICE_ALIAS", raising=False)


@pytest.mark.parametrize("model", ["llama3-8b", "mistral-7b", "qwen2.5-7b", "llama3-70b",
                                   "gemma2-9b"])
def test_a_fresh_h100_serves_the_model_presets_tuned(fresh_install, model):
    dispatch = Dispatcher(SPEC)
    shipped = json.loads((PACKAGE / config_file_name(H100.name, "attn_fwd")).read_text())
    by_key = {json.dumps(e["problem"], sort_keys=True): e for e in shipped["entries"]}
    for problem in preset(model):
        choice = dispatch.choose(problem, H100)
        assert choice.source == "exact", (model, problem.describe())
        entry = by_key[json.dumps(problem.key(), sort_keys=True)]
        assert choice.config == entry["config"] and choice.tflops == entry["tflops"]
        assert choice.origin.startswith("package")


def test_other_shapes_on_an_h100_get_the_nearest_shipped_config(fresh_install):
    problem = preset("llama3-8b")[1]
    off_grid = AttentionProblem(3, problem.heads_q, problem.heads_kv, 3000, 3000,
                             problem.head_dim, True, "bf16")
    assert Dispatcher(SPEC).choose(off_grid, H100).source in ("bucket", "nearest")


def test_the_loader_finds_the_package_folder():
    assert ("package", PACKAGE) in [(k, p.resolve()) for k, p in sources.source_dirs()]


# -- a shipped table, current or stale, whatever the state of the real file ------------------

def _ship(folder: Path, source_hash: str) -> Path:
    """The real H100 attn_fwd file, keyed to ``source_hash``, as the only package file."""
    real = json.loads((PACKAGE / config_file_name(H100.name, "attn_fwd")).read_text())
    real["template"]["source_hash"] = source_hash
    folder.mkdir(exist_ok=True)
    path = folder / config_file_name(H100.name, "attn_fwd")
    path.write_text(json.dumps(real))
    return path


@pytest.fixture
def package(tmp_path, monkeypatch, fresh_install):
    """An empty stand-in for flashtune/configs (the loader's package folder)."""
    folder = tmp_path / "package"
    folder.mkdir()
    monkeypatch.setattr(sources, "source_dirs", lambda: [("package", folder)])
    return folder


def test_a_current_shipped_table_loads_validates_and_routes(package, caplog):
    path = _ship(package, SPEC.source_hash)
    doc = parse_document(path.read_text(), specs=SPECS)
    assert sources.stale_tables() == ([], [])
    dispatch = Dispatcher(SPEC)
    with caplog.at_level("WARNING", logger="flashtune"):
        for entry in doc.entries:
            problem = AttentionProblem.from_key(entry.problem)
            choice = dispatch.choose(problem, H100)
            assert (choice.source, choice.config) == ("exact", entry.config)
            assert choice.origin == f"package {path}"
            off_grid = replace(problem, batch=problem.batch + 1)
            assert dispatch.choose(off_grid, H100).source in ("bucket", "nearest")
    assert not caplog.records


def test_a_stale_shipped_table_is_reported_once_and_not_served(package, caplog):
    path = _ship(package, "0123456789abcdef")
    dispatch = Dispatcher(SPEC)
    with caplog.at_level("WARNING", logger="flashtune"):
        for problem in preset("llama3-8b"):
            for _ in range(3):
                assert dispatch.choose(problem, H100).source == "default"
    stale = [r.getMessage() for r in caplog.records if "is stale" in r.getMessage()]
    assert len(stale) == 1, stale  # once per process, not per call nor per shape
    assert path.name in stale[0] and "0123456789abcdef" in stale[0]
    assert SPEC.source_hash in stale[0]
    assert "flashtune tune --template attn_fwd --plan shipped-fwd" in stale[0]
    assert f"flashtune export -o {package} --device {H100.name} --template attn_fwd" \
        in stale[0]
    # no file read per call: the table is loaded once per device
    reads = []
    real = sources.load_entries
    import flashtune.runtime.lookup as lookup
    lookup_load = lookup.load_entries
    try:
        lookup.load_entries = lambda *a, **k: reads.append(a) or real(*a, **k)
        dispatch.choose(preset("llama3-8b")[0], H100)
        dispatch.choose(AttentionProblem(3, 32, 8, 3000, 3000, 128, True, "bf16"), H100)
    finally:
        lookup.load_entries = lookup_load
    assert reads == []
    # `flashtune show`, `db info` and `db verify` list it
    (table,), problems = sources.stale_tables()
    shipped = len(json.loads(path.read_text())["entries"])
    assert problems == [] and (table.path, table.device, table.stale) == (path, H100.name, shipped)
    assert table.line() == stale[0].removeprefix("flashtune: ").split(
        "; serving what")[0]
    assert sources.stale_tables(device_name="other") == ([], [])


def test_a_stale_table_of_another_device_is_not_warned_about(package, caplog):
    _ship(package, "0123456789abcdef")
    other = replace(H100, name="NVIDIA_H200")
    with caplog.at_level("WARNING", logger="flashtune"):
        Dispatcher(SPEC).reload(device_alias=True)
        dispatch = Dispatcher(SPEC)
        dispatch.reload(device_alias=True)
        assert dispatch.choose(preset("llama3-8b")[0], other).source == "default"
    assert not [r for r in caplog.records if "is stale" in r.getMessage()]


@pytest.mark.parametrize("path", OP_FILES, ids=lambda p: p.name)
def test_a_fresh_gpu_routes_by_the_shipped_op_choices(fresh_install, path):
    """Each shipped shape is served by its winner where the winner is current here (an SDPA
    backend: only under the torch and cuDNN that timed it); a stale winner's shape takes the
    default, as do the shapes nearest it; and no call reads a file."""
    from flashtune.runtime.choices import OpRouter

    doc = read_choice_document(path, specs=SPECS)
    device = _fingerprint(doc.device)
    serving = op_implementations(SPECS, doc.op)
    router = OpRouter(doc.op, serving)
    hashes = {n: s.source_hash for n, s in serving.items()}
    own = stale = 0
    for entry in doc.entries:
        problem = AttentionProblem.from_key(entry.problem)
        got = router.choose(problem, device)
        if not doc.is_current(entry, hashes):
            stale += 1
            assert got is None, (problem.describe(), got)
        elif serving[entry.implementation].refuse(problem, device) is None:
            own += serving[entry.implementation].kind != "extern"
            assert got is not None and (got.template, got.source, got.config) == \
                (entry.implementation, "exact", entry.config)
    # own-kernel wins this machine checked; a table that cuDNN won throughout (the H100's
    # decode) is stale under any other torch, and each shape was checked to take the default
    externs = {n for n, s in serving.items() if s.kind == "extern"}
    assert own > 0 or (stale == len(doc.entries) and
                       {e.implementation for e in doc.entries} <= externs)
    if stale:  # then near a stale cuDNN win is the default too, not a far own-kernel win
        first = next(AttentionProblem.from_key(e.problem) for e in doc.entries
                     if not doc.is_current(e, hashes))
        assert router.choose(replace(first, batch=first.batch + 1), device) is None


@pytest.mark.parametrize("device_name", ["NVIDIA_H100_80GB_HBM3", "NVIDIA_H200"])
def test_a_fresh_gpu_tunes_the_kv_cache_path_by_its_shipped_attn_decode_table(fresh_install,
                                                                             device_name):
    """``attention_with_kvcache`` (the static caches, FlashAttention-2's
    ``flash_attn_with_kvcache``) looks attn_decode up by template: each shipped shape gets
    its entry, a held-out GQA step and a held-out Gemma 2 step (D256, softcap) the nearest
    ones of its table, and a head dim the table never saw (D64) the template default."""
    from flashtune.runtime import kvcache

    spec = get_template("attn_decode")
    path = PACKAGE / config_file_name(device_name, "attn_decode")
    doc = parse_document(path.read_text(), specs=SPECS)
    device = _fingerprint(doc.device)
    dispatch = Dispatcher(spec)
    for e in doc.entries:
        got = dispatch.choose(AttentionProblem.from_key(e.problem), device)
        assert (got.source, got.config) == ("exact", e.config)
        assert got.origin.startswith("package")
    held_out = AttentionProblem(8, 32, 8, 1, 12000, 128, True, "bf16")
    assert dispatch.peek(held_out, device).source in ("bucket", "nearest")
    assert kvcache.DISPATCH.spec is spec  # the KV-cache path's lookup is this template's
    gemma2 = AttentionProblem(8, 16, 8, 1, 2111, 256, True, "bf16", softcap=50.0)
    assert dispatch.peek(gemma2, device).source in ("bucket", "nearest")
    d64 = AttentionProblem(8, 32, 8, 1, 4096, 64, True, "bf16")
    assert dispatch.peek(d64, device).source == "default"

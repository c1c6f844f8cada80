"""The dispatcher: every step of the lookup chain, every source, failures, threads, the hot
path, opt-in autotuning, torch.compile (CPU: the interpreter device)."""

from __future__ import annotations

import logging
import re
import threading
from datetime import datetime, timezone
from pathlib import Path

import pytest
import torch

import flashtune
from flashtune.core.device import DeviceFingerprint, interpreter_device
from flashtune.core.problem import AttentionProblem
from flashtune.db import open_store
from flashtune.db.exchange import (
    ConfigDocument,
    ConfigEntry,
    DeviceInfo,
    config_file_name,
    document_to_json,
)
from flashtune.kernel_templates import get_template
from flashtune.runtime import lookup as lookup_mod
from flashtune.runtime import routing, sources
from tests.conftest import DEVICE

pytestmark = pytest.mark.skipif(DEVICE != "cpu", reason="the interpreter device's own tables")

SPEC = get_template("attn_fwd")
HERE = interpreter_device()
# another device of the same compute capability and shared memory: a candidate alias
TWIN = DeviceFingerprint("cpu-twin", HERE.compute_capability, HERE.sm_count + 1,
                         HERE.shared_mem_per_block, 0)
BASE = {"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 2, "num_stages": 1, "USE_TMA": 0,
        "REVERSE_M": 0, "SPLIT_D": 0}


def cfg(bm: int = 16, bn: int = 16) -> dict[str, int]:
    return {**BASE, "BLOCK_M": bm, "BLOCK_N": bn}


def prob(nq: int = 64, nk: int | None = None, b: int = 1, d: int = 32, causal: bool = False,
         hq: int = 2, hkv: int = 2) -> AttentionProblem:
    return AttentionProblem(b, hq, hkv, nq, nk or nq, d, causal, "fp16")


def tensors(p: AttentionProblem):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(p.batch, p.heads_q, p.seqlen_q, p.head_dim, generator=g).half()
    k = torch.randn(p.batch, p.heads_kv, p.seqlen_k, p.head_dim, generator=g).half()
    return q, k, torch.randn_like(k)


def populate(url: str, entries: list[tuple[DeviceFingerprint, AttentionProblem, dict, float]],
             source_hash: str = SPEC.source_hash, template: str = "attn_fwd") -> None:
    if template != "attn_fwd" and source_hash == SPEC.source_hash:
        source_hash = get_template(template).source_hash
    with open_store(url) as store:
        for dev, p, config, ms in entries:
            d = store.ensure_device(dev)
            t = store.ensure_template(template, source_hash)
            pr = store.ensure_problem(template, p.key(), p.bucket())
            store.offer_best(d.id, t.id, pr.id, config=config, median_ms=ms, tflops=1.0,
                             trial_id=None, trials_count=1)


def write_doc(folder: Path, dev: DeviceFingerprint,
              entries: list[tuple[AttentionProblem, dict, float]],
              source_hash: str = SPEC.source_hash) -> Path:
    now = datetime.now(timezone.utc)
    doc = ConfigDocument(
        device=DeviceInfo(dev.name, dev.compute_capability, dev.sm_count,
                          dev.shared_mem_per_block, dev.total_memory),
        software={}, template="attn_fwd", source_hash=source_hash,
        entries=tuple(ConfigEntry(p.key(), p.bucket(), SPEC.space.validate(c), ms, 2.0, 5, now)
                      for p, c, ms in entries),
        exported_at=now)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / config_file_name(dev.name, "attn_fwd")
    path.write_text(document_to_json(doc))
    return path


@pytest.fixture
def env(tmp_path, monkeypatch):
    """Isolated sources: the default database (not there until populated: silent), an
    empty config dir, a package dir; fresh dispatchers."""
    cache = tmp_path / "cache"
    (cache / "flashtune").mkdir(parents=True)
    db = f"sqlite:///{cache / 'flashtune' / 'flashtune.db'}"
    cdir, pdir = tmp_path / "configs", tmp_path / "package"
    cdir.mkdir()
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))
    monkeypatch.delenv("FLASHTUNE_DB", raising=False)
    monkeypatch.setenv("FLASHTUNE_CONFIG_DIR", str(cdir))
    monkeypatch.delenv("FLASHTUNE_DEVICE_ALIAS", raising=False)
    monkeypatch.delenv("FLASHTUNE_AUTOTUNE", raising=False)
    real_dirs = sources.source_dirs
    monkeypatch.setattr(sources, "source_dirs",
                        lambda: [d for d in real_dirs() if d[0] == "dir"] + [("package", pdir)])
    flashtune.reload_configs()
    yield {"db": db, "dir": cdir, "package": pdir}
    flashtune.reload_configs()


def choice(p: AttentionProblem) -> flashtune.ConfigChoice:
    q, k, v = tensors(p)
    return flashtune.lookup_config(q, k, v, causal=p.causal)


# -- the chain ----------------------------------------------------------------------------------


def test_exact_bucket_nearest_default(env):
    tuned = prob(64)
    populate(env["db"], [(HERE, tuned, cfg(32, 16), 1.0)])
    exact = choice(tuned)
    assert (exact.source, exact.config, exact.tuned_problem) == ("exact", cfg(32, 16), tuned)
    assert exact.tflops == 1.0 and exact.origin.startswith("db ")
    assert choice(prob(60)).source == "bucket"  # 60 and 64 share the power-of-two bucket
    near = choice(prob(200))
    assert near.source == "nearest" and near.config == cfg(32, 16)
    assert near.tuned_problem == tuned
    other_d = choice(prob(64, d=64))  # another head_dim never borrows a config
    assert other_d.source == "default" and other_d.tflops is None
    assert other_d.config == SPEC.default_config(prob(64, d=64), HERE)


def test_nearest_prefers_the_closest_then_the_faster(env):
    populate(env["db"], [(HERE, prob(64), cfg(32, 16), 1.0), (HERE, prob(512), cfg(64, 16), 1.0),
                         (HERE, prob(1024), cfg(16, 32), 1.0)])
    assert choice(prob(400)).config == cfg(64, 16)   # log2 distance: 512 is closest
    assert choice(prob(100)).config == cfg(32, 16)


def test_another_gqa_group_serves_only_when_none_of_the_calls_is_near(env):
    """A group no table holds (4:1 here, where only 2:1 was tuned) takes the nearest entry of
    another group, not the default; an entry of the call's own group wins over another
    group's nearby; one six doublings away loses to another group's at the call's shape."""
    two = prob(64, hq=4, hkv=2)  # group 2
    populate(env["db"], [(HERE, two, cfg(32, 16), 1.0)])
    four = prob(64, hq=4, hkv=1)  # group 4
    lent = choice(four)
    assert (lent.source, lent.config, lent.tuned_problem) == ("nearest", cfg(32, 16), two)
    populate(env["db"], [(HERE, prob(128, hq=4, hkv=1), cfg(64, 16), 1.0),
                         (HERE, prob(4096, hq=4, hkv=1), cfg(16, 32), 1.0)])
    flashtune.reload_configs()
    assert choice(four).config == cfg(64, 16)  # its own group, one doubling away (2 < 3)
    assert choice(prob(128, hq=4, hkv=2)).config == cfg(32, 16)  # its own group (2 < 3)
    assert choice(prob(4096, hq=4, hkv=2)).config == cfg(16, 32)  # 12 against 3


def test_a_backward_config_is_never_lent_across_gqa_groups(env):
    """attn_bwd's dK/dV programs split the GQA group: a config of another group is not lent
    (the template default runs), one of the call's group is."""
    bwd = get_template("attn_bwd")
    two = prob(64, hq=4, hkv=2)
    populate(env["db"], [(HERE, two, dict(bwd.default_config(two, HERE)), 1.0)],
             template="attn_bwd")
    flashtune.reload_configs()
    dispatcher = lookup_mod.Dispatcher(bwd)
    assert dispatcher.choose(two, HERE).source == "exact"
    assert dispatcher.choose(prob(200, hq=4, hkv=2), HERE).source == "nearest"
    assert dispatcher.choose(prob(64, hq=4, hkv=1), HERE).source == "default"
    assert dispatcher.choose(prob(64, hq=2, hkv=2), HERE).source == "default"


def test_gqa_group_distance_is_a_penalty_across_groups_and_a_wall_otherwise():
    from flashtune.core.problem import GROUP_DISTANCE
    gqa, mqa = prob(512, hq=8, hkv=2), prob(512, hq=8, hkv=1)
    assert gqa.distance(mqa) == mqa.distance(gqa) == float("inf")
    assert gqa.distance(mqa, across_groups=True) == GROUP_DISTANCE + 1.0  # 4 against 8
    assert gqa.distance(prob(512, hq=16, hkv=4)) == 0.5  # the same group, twice the heads
    assert gqa.distance(prob(512, hq=8, hkv=2, d=64), across_groups=True) == float("inf")


def test_a_config_that_cannot_run_the_problem_is_skipped(env):
    # REVERSE_M is pruned for non-causal problems: the causal entry cannot serve them
    populate(env["db"], [(HERE, prob(64, causal=True), {**cfg(), "REVERSE_M": 1}, 1.0)])
    assert choice(prob(64, causal=True)).source == "exact"
    assert choice(prob(64, causal=False)).source == "default"


def test_device_alias_is_opt_in(env, tmp_path):
    populate(env["db"], [(TWIN, prob(64), cfg(32, 32), 1.0)])
    assert choice(prob(64)).source == "default"
    flashtune.reload_configs(device_alias=True)
    alias = choice(prob(64))
    assert alias.source == "device-alias" and alias.config == cfg(32, 32)


def test_device_alias_from_files_of_other_devices(env, monkeypatch):
    write_doc(env["dir"], TWIN, [(prob(64), cfg(16, 32), 1.0)])
    assert choice(prob(64)).source == "default"  # other devices' files are not even read
    monkeypatch.setenv("FLASHTUNE_DEVICE_ALIAS", "1")
    flashtune.reload_configs()
    assert choice(prob(64)).source == "device-alias"


# -- sources ------------------------------------------------------------------------------------


def test_each_source_alone(env):
    write_doc(env["package"], HERE, [(prob(64), cfg(16, 32), 1.0)])
    got = choice(prob(64))
    assert got.source == "exact" and got.origin.startswith("package ")
    write_doc(env["dir"], HERE, [(prob(64), cfg(32, 32), 1.0)])
    flashtune.reload_configs()
    got = choice(prob(64))
    assert got.config == cfg(32, 32) and got.origin.startswith("dir ")
    populate(env["db"], [(HERE, prob(64), cfg(64, 16), 1.0)])
    flashtune.reload_configs()
    assert choice(prob(64)).config == cfg(64, 16)  # database > config dir > package


def test_an_earlier_source_holds_its_shapes_at_every_step_of_the_chain(env):
    """The config folder overrides the shipped table for the shapes it holds, whichever
    step serves them: exact, and as the neighbour of a shape nobody tuned, even where the
    shipped table's entry for the same shape was measured faster (a nearest lookup used to
    rank both and take the faster)."""
    write_doc(env["package"], HERE, [(prob(512), cfg(16, 32), 0.5)])
    write_doc(env["dir"], HERE, [(prob(512), cfg(32, 32), 2.0)])
    flashtune.reload_configs()
    exact, bucket, near = choice(prob(512)), choice(prob(400)), choice(prob(200))
    assert (exact.source, exact.config) == ("exact", cfg(32, 32))
    assert (bucket.source, bucket.config) == ("bucket", cfg(32, 32))
    assert (near.source, near.config) == ("nearest", cfg(32, 32))
    assert near.origin.startswith("dir ")
    # the shipped table still serves the shapes the folder does not hold
    write_doc(env["package"], HERE, [(prob(512), cfg(16, 32), 0.5), (prob(64), cfg(16, 16), 1.0)])
    flashtune.reload_configs()
    assert choice(prob(100)).config == cfg(16, 16)
    assert choice(prob(100)).origin.startswith("package ")


def test_the_file_name_is_the_exporters(env):
    path = write_doc(env["dir"], HERE, [(prob(64), cfg(16, 32), 1.0)])
    assert path.name == f"device_name={HERE.name},template=attn_fwd.json"
    path.rename(path.with_name("renamed.json"))
    flashtune.reload_configs()
    assert choice(prob(64)).source == "default"


def test_stale_configs_are_never_served(env):
    populate(env["db"], [(HERE, prob(64), cfg(32, 16), 1.0)], source_hash="0" * 16)
    write_doc(env["dir"], HERE, [(prob(64), cfg(16, 32), 1.0)], source_hash="1" * 16)
    assert choice(prob(64)).source == "default"


@pytest.mark.parametrize("damage", ["garbage-db", "newer-schema-db", "corrupt-json",
                                    "hostile-json", "dir-is-a-file", "dir-missing",
                                    "db-named-but-missing"])
def test_a_bad_source_serves_defaults_with_one_warning(env, damage, caplog, monkeypatch):
    db_path = Path(env["db"].removeprefix("sqlite:///"))
    good = prob(128, d=16)  # another head_dim: never "nearest" for prob(64)
    write_doc(env["package"], HERE, [(good, cfg(32, 32), 1.0)])  # a good source too
    if damage == "garbage-db":
        db_path.write_bytes(b"this is not a database" * 100)
    elif damage == "newer-schema-db":
        populate(env["db"], [(HERE, prob(64), cfg(), 1.0)])
        import sqlite3

        from flashtune.db.schema import VERSION_TABLE
        with sqlite3.connect(db_path) as conn:
            conn.execute(f"UPDATE {VERSION_TABLE} SET version_num = '9999'")
    elif damage == "corrupt-json":
        path = write_doc(env["dir"], HERE, [(prob(64), cfg(), 1.0)])
        path.write_text(path.read_text()[:-40])
    elif damage == "hostile-json":
        path = write_doc(env["dir"], HERE, [(prob(64), cfg(), 1.0)])
        path.write_text(path.read_text().replace('"median_ms": 1.0', '"median_ms": NaN'))
    elif damage == "dir-is-a-file":
        env["dir"].rmdir()
        env["dir"].write_text("a file where a folder should be")
    elif damage == "dir-missing":  # a typo in $FLASHTUNE_CONFIG_DIR
        env["dir"].rmdir()
    else:  # a typo in $FLASHTUNE_DB
        monkeypatch.setenv("FLASHTUNE_DB", f"sqlite:///{db_path.parent / 'typo.db'}")
    with caplog.at_level(logging.WARNING, logger="flashtune"):
        for _ in range(3):
            got = choice(prob(64))
            assert got.source == "default"
        assert choice(good).source == "exact"  # the good source still serves
        q, k, v = tensors(prob(64))
        flashtune.attention(q, k, v)  # and calls run
    skipped = [r for r in caplog.records if "skipped" in r.getMessage()]
    assert len(skipped) == 1, caplog.text
    why = {"dir-is-a-file": "FLASHTUNE_CONFIG_DIR .*configs skipped: it is not a folder",
           "dir-missing": "FLASHTUNE_CONFIG_DIR .*configs skipped: it does not exist",
           "db-named-but-missing": "tuning database skipped: .*typo.db does not exist; "
                                   "check the path"}.get(damage)
    assert why is None or re.search(why, skipped[0].getMessage()), skipped[0].getMessage()
    assert not (db_path.parent / "typo.db").exists()  # never created


def test_a_missing_default_database_is_silent(env, caplog):
    with caplog.at_level(logging.WARNING, logger="flashtune"):
        choice(prob(128))
    assert "skipped" not in caplog.text
    assert not Path(env["db"].removeprefix("sqlite:///")).exists()  # never created


def test_a_missing_source_asked_for_is_one_warning_for_every_template(env, caplog,
                                                                       monkeypatch):
    """attn_fwd, attn_bwd and attn_decode each read the sources: still one warning a
    source, until a reload."""
    missing = Path(env["db"].removeprefix("sqlite:///")).parent / "typo.db"
    flashtune.reload_configs(db_url=f"sqlite:///{missing}")
    monkeypatch.setenv("FLASHTUNE_CONFIG_DIR", str(env["dir"] / "typo"))
    with caplog.at_level(logging.WARNING, logger="flashtune"):
        q, k, v = (t.requires_grad_() for t in tensors(prob(16)))
        flashtune.attention(q, k, v).float().sum().backward()  # attn_fwd + attn_bwd
        flashtune.lookup_config(*tensors(prob(1, 64)))  # attn_decode's route
    skipped = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert len(skipped) == 2, skipped
    assert "typo.db does not exist; check the path" in skipped[0]
    assert "typo skipped: it does not exist" in skipped[1]
    assert not missing.exists()
    flashtune.reload_configs(db_url=f"sqlite:///{missing}")
    with caplog.at_level(logging.WARNING, logger="flashtune"):
        choice(prob(24))
    assert sum("skipped" in r.getMessage() for r in caplog.records) == 4


def test_default_fallback_is_logged_once_per_shape(env, caplog):
    with caplog.at_level(logging.WARNING, logger="flashtune"):
        for n in (64, 64, 64, 80, 80):
            q, k, v = tensors(prob(n))
            flashtune.attention(q, k, v)
    lines = [r.getMessage() for r in caplog.records if "template default" in r.getMessage()]
    assert len(lines) == 2 and "Nq=64" in lines[0] and "Nq=80" in lines[1]


# -- the hot path ---------------------------------------------------------------------------------


def test_sources_are_read_once_and_calls_do_one_dict_read(env, monkeypatch):
    populate(env["db"], [(HERE, prob(64), cfg(32, 16), 1.0)])
    loads, resolves = [], []
    real_load, real_resolve = lookup_mod.load_entries, routing._resolve
    monkeypatch.setattr(lookup_mod, "load_entries", lambda *a, **k: (loads.append(a),
                                                                     real_load(*a, **k))[1])
    monkeypatch.setattr(routing, "_resolve", lambda *a: (resolves.append(a), real_resolve(*a))[1])
    q, k, v = tensors(prob(64))
    for _ in range(5):
        flashtune.attention(q, k, v)
    q2, k2, v2 = tensors(prob(40))
    flashtune.attention(q2, k2, v2)
    assert len(loads) == 1 and len(resolves) == 2
    flashtune.reload_configs()
    flashtune.attention(q, k, v)
    assert len(loads) == 2


def test_concurrent_lookups_from_threads(env, monkeypatch):
    populate(env["db"], [(HERE, prob(64), cfg(32, 16), 1.0), (HERE, prob(256), cfg(64, 16), 1.0)])
    loads = []
    real_load = lookup_mod.load_entries
    monkeypatch.setattr(lookup_mod, "load_entries", lambda *a, **k: (loads.append(a),
                                                                     real_load(*a, **k))[1])
    shapes = [prob(n) for n in (64, 60, 256, 200, 1000, 48)]
    expected = {}
    errors = []
    barrier = threading.Barrier(8)

    def worker(i: int) -> None:
        try:
            barrier.wait()
            for j in range(30):
                p = shapes[(i + j) % len(shapes)]
                got = choice(p)
                prior = expected.setdefault(p, got)
                assert got == prior
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(loads) == 1
    assert expected[prob(64)].source == "exact" and expected[prob(1000)].source == "nearest"


def test_explicit_config_still_wins(env):
    populate(env["db"], [(HERE, prob(64), cfg(32, 16), 1.0)])
    q, k, v = tensors(prob(64))
    out = flashtune.attention(q, k, v, config=cfg(16, 32))
    assert torch.equal(out, SPEC.launcher(q, k, v, cfg(16, 32)))


def test_warmup_resolves_every_tuned_problem(env):
    populate(env["db"], [(HERE, prob(64), cfg(32, 16), 1.0), (HERE, prob(96), cfg(16, 16), 1.0)])
    done = flashtune.warmup()
    assert {p: c.source for p, c in done} == {prob(64): "exact", prob(96): "exact"}
    [(p, c)] = flashtune.warmup([prob(200)])
    assert c.source == "nearest"


def test_a_returned_choice_is_the_callers_to_change(env):
    """lookup_config and warmup hand out copies: changing one does not change the config
    later calls run with."""
    populate(env["db"], [(HERE, prob(64), cfg(32, 16), 1.0)])
    q, k, v = tensors(prob(64))
    before = flashtune.attention(q, k, v)
    choice_ = flashtune.lookup_config(q, k, v)
    choice_.config["BLOCK_M"] = 8
    [(_, warmed)] = flashtune.warmup([prob(64)])
    assert warmed.config == cfg(32, 16)
    warmed.config["BLOCK_N"] = 8
    assert flashtune.lookup_config(q, k, v).config == cfg(32, 16)
    assert all(c == cfg(32, 16) for _, c in routing._FAST.values())
    assert torch.equal(flashtune.attention(q, k, v), before)


# -- opt-in autotuning and torch.compile ----------------------------------------------------------


def test_autotune_is_opt_in_and_runs_once(env, monkeypatch):
    from flashtune.autotune import runners

    monkeypatch.setattr(runners, "INTERPRETER_REPS", 1)
    monkeypatch.setenv("FLASHTUNE_AUTOTUNE", "1")
    monkeypatch.setenv("FLASHTUNE_AUTOTUNE_TRIALS", "2")
    p = prob(48, causal=True)
    q, k, v = tensors(p)
    out = flashtune.attention(q, k, v, causal=True)
    assert choice(p).source == "exact"  # tuned into $FLASHTUNE_DB, then served
    with open_store(env["db"], read_only=True) as store:
        trials = store.list_trials()
    # two configs run (others the sampler proposed may be recorded as pruned: a knob the
    # head dim does not take, such as SPLIT_D at a power of two)
    assert sum(t.state.value != "PRUNED_STATIC" for t in trials) == 2
    flashtune.attention(q, k, v, causal=True)
    with open_store(env["db"], read_only=True) as store:
        assert len(store.list_trials()) == len(trials)  # not tuned again
    assert out.shape == q.shape


def test_lookup_config_never_tunes(env, monkeypatch):
    """Its docstring says nothing is launched: FLASHTUNE_AUTOTUNE=1 tunes at the first
    attention call (and in warmup), not in lookup_config."""
    from flashtune.autotune import jobs

    tuned = []
    monkeypatch.setattr(jobs, "tune", lambda problems, options, **kw: tuned.extend(problems))
    monkeypatch.setattr(routing, "_AUTOTUNED", set())
    monkeypatch.setenv("FLASHTUNE_AUTOTUNE", "1")
    p = prob(24)
    q, k, v = tensors(p)
    assert flashtune.lookup_config(q, k, v).source == "default"
    assert flashtune.lookup_config(*(t.requires_grad_() for t in (q, k, v))).source == "default"
    assert tuned == []
    flashtune.attention(q.detach(), k.detach(), v.detach())
    assert tuned == [p]
    flashtune.warmup([prob(40)])
    assert tuned == [p, prob(40)]


@pytest.mark.parametrize("value", ["abc", "0", "-3", "2.5"])
def test_a_bad_autotune_trials_value_is_warned_about_once(env, monkeypatch, caplog, value):
    """The first call on an untuned shape must not raise over the environment: the value is
    replaced by the default, with one warning however many shapes get tuned."""
    from flashtune.autotune import jobs

    asked = []
    monkeypatch.setattr(jobs, "tune", lambda problems, options, **kw: asked.append(options.trials))
    monkeypatch.setattr(routing, "_AUTOTUNED", set())
    monkeypatch.setattr(routing, "_BAD_TRIALS", set())
    monkeypatch.setenv("FLASHTUNE_AUTOTUNE", "1")
    monkeypatch.setenv("FLASHTUNE_AUTOTUNE_TRIALS", value)
    with caplog.at_level(logging.WARNING, logger="flashtune"):
        for n in (24, 40):
            q, k, v = tensors(prob(n))
            flashtune.attention(q, k, v)
    assert asked == [routing.AUTOTUNE_TRIALS] * 2
    bad = [r for r in caplog.records if "FLASHTUNE_AUTOTUNE_TRIALS" in r.getMessage()]
    assert len(bad) == 1 and repr(value) in bad[0].getMessage(), caplog.text


def test_torch_compile_without_graph_breaks(env):
    p = prob(40, causal=True)
    q, k, v = tensors(p)

    def block(q, k, v):
        out, lse = flashtune.attention(q * 1.0, k, v, causal=True, return_lse=True)
        return out.float().sum(-1) + lse

    compiled = torch.compile(block, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(q, k, v), block(q, k, v))
    explained = torch._dynamo.explain(block)(q, k, v)
    assert explained.graph_break_count == 0


def test_untuned_forwards_on_hopper_run_flashtunes_kernels_not_cudnn(env, monkeypatch):
    """With no op choice, an sm_90 forward runs attn_fwd (the user's tuned config, else the
    shipped table, else its default), not cuDNN's SDPA where cuDNN would serve it: cuDNN
    builds a plan for every new shape (40-68 ms on an H200) and inference meets a new shape
    with every prompt length. FLASHTUNE_AUTOTUNE=1 tunes attn_fwd for such a problem."""
    from dataclasses import replace

    h100 = DeviceFingerprint("NVIDIA_H100_80GB_HBM3", "9.0", 132, 232448, 80 * 2**30)
    spec = routing._ROUTERS["fwd"].specs["sdpa_cudnn"]  # as if cuDNN were loaded here
    monkeypatch.setitem(routing._ROUTERS["fwd"].specs, "sdpa_cudnn",
                        replace(spec, limits=replace(spec.limits, available=None)))
    shipped, untuned, mine = prob(40, causal=True), prob(80), prob(48, causal=True)
    write_doc(env["package"], h100, [(shipped, cfg(32, 16), 1.0)])
    populate(env["db"], [(h100, mine, cfg(16, 32), 1.0)])
    flashtune.reload_configs()
    for lse in (False, True):
        got = routing._route(shipped, h100, tune=False, return_lse=lse)
        assert (got.template, got.source, got.config) == ("attn_fwd", "exact", cfg(32, 16))
        assert got.origin.startswith("package ")
    own = routing._route(mine, h100, tune=False)
    assert (own.template, own.source, own.config) == ("attn_fwd", "exact", cfg(16, 32))
    near = routing._route(prob(96, causal=True), h100, tune=False)  # the user's, its group
    assert (near.template, near.source, near.config) == ("attn_fwd", "nearest", cfg(16, 32))
    assert routing._route(untuned, h100, tune=False).template == "attn_fwd"
    from flashtune.autotune import jobs

    tuned = []
    monkeypatch.setattr(jobs, "tune", lambda problems, options, **kw: tuned.extend(problems))
    monkeypatch.setattr(routing, "_AUTOTUNED", set())
    monkeypatch.setenv("FLASHTUNE_AUTOTUNE", "1")
    assert routing._route(untuned, h100).template == "attn_fwd"
    assert tuned == [untuned]


def test_untuned_decodes_on_hopper_run_attn_decode_not_cudnn(env, monkeypatch):
    """A short-query call attn_decode takes untuned runs attn_decode on sm_90 too, not
    cuDNN's SDPA: a decoding step over a growing cache is a new shape every token, and
    cuDNN plans every new shape; the user's own tuned config serves its shape."""
    from dataclasses import replace

    from flashtune.runtime import kvcache

    h100 = DeviceFingerprint("NVIDIA_H100_80GB_HBM3", "9.0", 132, 232448, 80 * 2**30)
    spec = routing._ROUTERS["decode"].specs["sdpa_cudnn"]  # as if cuDNN were loaded here
    monkeypatch.setitem(routing._ROUTERS["decode"].specs, "sdpa_cudnn",
                        replace(spec, limits=replace(spec.limits, available=None)))
    keys = kvcache.DECODE_MIN_KEYS + 7
    untuned, mine = prob(1, keys), prob(2, keys, hq=4)
    dec = dict(get_template("attn_decode").default_config(mine, h100))
    populate(env["db"], [(h100, mine, dec, 1.0)], template="attn_decode")
    flashtune.reload_configs()
    for step in range(3):  # a dynamic cache: one more key each step
        got = routing._route(prob(1, keys + step), h100, tune=False)
        assert got.template == "attn_decode"
    assert routing._route(untuned, h100, tune=False).template == "attn_decode"
    own = routing._route(mine, h100, tune=False)
    assert (own.template, own.source) == ("attn_decode", "exact")


def test_the_template_default_warning_is_once_per_bucket_on_hopper(env, monkeypatch, caplog):
    """"no tuned ... config, using the template default" is logged once per bucket where
    the template default runs, an sm_90 device's forward and decode as another's."""
    import logging
    from dataclasses import replace

    from flashtune.runtime import kvcache

    h100 = DeviceFingerprint("NVIDIA_H100_80GB_HBM3", "9.0", 132, 232448, 80 * 2**30)
    flashtune.reload_configs()
    forward, decode = prob(80), prob(1, kvcache.DECODE_MIN_KEYS + 9)
    with caplog.at_level(logging.WARNING, logger="flashtune"):
        for device in (h100, replace(h100, name="NVIDIA_A100_SXM4_80GB",
                                     compute_capability="8.0")):
            for _ in range(2):
                assert routing._route(forward, device, tune=False).template == "attn_fwd"
                assert routing._route(decode, device, tune=False).template == "attn_decode"
    warned = [r.getMessage() for r in caplog.records if "no tuned" in r.getMessage()]
    assert len(warned) == 4, warned
    assert ["attn_fwd" in w for w in warned] == [True, False, True, False], warned


def test_no_template_default_warning_for_a_template_without_knobs(env, caplog):
    """A template whose space has no knobs (cuDNN's backward, sdpa_cudnn_bwd) runs its one
    config untuned: nothing to tune, so no "run `flashtune tune`" line; a template with
    knobs still warns."""
    h100 = DeviceFingerprint("NVIDIA_H100_80GB_HBM3", "9.0", 132, 232448, 80 * 2**30)
    problem = AttentionProblem(2, 8, 2, 1000, 1000, 64, True, "bf16")
    with caplog.at_level(logging.WARNING, logger="flashtune"):
        quiet = lookup_mod.Dispatcher(get_template("sdpa_cudnn_bwd")).choose(problem, h100)
        assert (quiet.config, quiet.source) == ({}, "default")
        assert not [r for r in caplog.records if "no tuned" in r.getMessage()]
        lookup_mod.Dispatcher(get_template("attn_bwd_gluon")).choose(problem, h100)
    warned = [r.getMessage() for r in caplog.records if "no tuned" in r.getMessage()]
    assert len(warned) == 1 and "attn_bwd_gluon" in warned[0], warned


def _nearest_by_scan(entries, problem, same_bucket, usable, across_groups):
    """pick_nearest as it was written before its index: every entry measured, in order."""
    import math

    best, pick = None, None
    for i, e in enumerate(entries):
        if same_bucket and e.problem.bucket() != problem.bucket():
            continue
        dist = problem.distance(e.problem, across_groups=across_groups)
        if not math.isfinite(dist) or not usable(e):
            continue
        rank = (dist, e.median_ms / max(e.problem.flops(), 1.0), i)
        if best is None or rank < best:
            best, pick = rank, e
    return pick


def test_the_indexed_nearest_lookup_picks_what_a_scan_of_every_entry_picks():
    """:class:`lookup.Nearest` ranks only the entries that can be near a problem (its
    bucket, or its dtype, head dim and mask) and asks ``usable`` nearest first: over mixed
    tables, with ties and refusals, it picks the entry a scan of every entry picks."""
    import random

    from flashtune.runtime.sources import TunedEntry

    rng = random.Random(0)

    def shape():
        hkv = rng.choice([1, 2, 8])
        n = rng.choice([1, 128, 500, 1024, 2049, 4096])
        return AttentionProblem(rng.choice([1, 2, 8]), hkv * rng.choice([1, 4]), hkv,
                                n, rng.choice([n, 2 * n]), rng.choice([64, 128]),
                                rng.random() < 0.5, rng.choice(["fp16", "bf16"]))

    entries = [TunedEntry(("d",), shape(), {"i": i}, rng.choice([1.0, 2.0, 3.0]), 1.0, "")
               for i in range(300)]
    index = lookup_mod.Nearest(entries)
    assert list(index) == entries and len(index) == 300 and index[7] is entries[7]
    refused = {id(e) for e in entries if rng.random() < 0.3}

    def usable(e):
        return id(e) not in refused

    picked = 0
    for _ in range(200):
        problem = shape()
        for same_bucket in (True, False):
            for across in (True, False):
                want = _nearest_by_scan(entries, problem, same_bucket, usable, across)
                got = lookup_mod.pick_nearest(index, problem, same_bucket, usable,
                                              across_groups=across)
                assert got is want, (problem, same_bucket, across)
                assert lookup_mod.pick_nearest(entries, problem, same_bucket, usable,
                                               across_groups=across) is want
                picked += want is not None
    assert picked > 100  # the tables do serve most problems


def test_per_call_memos_are_bounded():
    """A decode loop over a dynamic cache meets a new key length every step: the route, the
    plan and the choice memos start again at :data:`lookup.MEMO_LIMIT` entries instead of
    growing for the life of the process, and answer as before."""
    memo: dict[int, int] = {}
    for i in range(10):
        assert lookup_mod.remember(memo, i, i * i, limit=4) == i * i
        assert len(memo) <= 4 and memo[i] == i * i
    dispatcher = lookup_mod.Dispatcher(SPEC)
    first = dispatcher.choose(AttentionProblem(1, 2, 2, 1, 64, 32, True, "fp16"), HERE)
    for n in range(65, 65 + lookup_mod.MEMO_LIMIT + 10):
        dispatcher.peek(AttentionProblem(1, 2, 2, 1, n, 32, True, "fp16"), HERE)
    assert len(dispatcher._memo) <= lookup_mod.MEMO_LIMIT
    assert dispatcher.choose(AttentionProblem(1, 2, 2, 1, 64, 32, True, "fp16"),
                             HERE) == first


def _distance_as_documented(a, b, across_groups):
    """AttentionProblem.distance as its docstring states it, term by term (the reference
    for the per-entry features the tables keep)."""
    import math

    from flashtune.core.problem import (
        DROPOUT_DISTANCE,
        GROUP_DISTANCE,
        MODS_DISTANCE,
        PACKED_DISTANCE,
    )

    def lg(x, y):
        return abs(math.log2(x) - math.log2(y))

    if (a.dtype, a.head_dim, a.causal) != (b.dtype, b.head_dim, b.causal):
        return math.inf
    ga, gb = a.heads_q // a.heads_kv, b.heads_q // b.heads_kv
    if ga != gb and not across_groups:
        return math.inf

    def rows(p):
        return p.tokens_q / p.seqlen_q if p.tokens_q else float(p.batch)

    def span(p):
        left = p.seqlen_k if p.window_left < 0 else p.window_left
        right = 0 if p.causal else (p.seqlen_k if p.window_right < 0 else p.window_right)
        return max(1, min(p.seqlen_k, left + right + 1))

    mods = 0.0 if a.mods() == b.mods() else MODS_DISTANCE
    if not mods and "window" in a.mods():
        mods = 0.5 * lg(span(a), span(b))
    return (lg(a.seqlen_q, b.seqlen_q) + lg(a.seqlen_k, b.seqlen_k)
            + 0.5 * lg(rows(a) * a.heads_q, rows(b) * b.heads_q) + mods
            + (0.0 if bool(a.tokens_q) == bool(b.tokens_q) else PACKED_DISTANCE)
            + (0.0 if bool(a.dropout) == bool(b.dropout) else DROPOUT_DISTANCE)
            + (0.0 if ga == gb else GROUP_DISTANCE + lg(ga, gb)))


def test_the_distance_from_kept_features_is_the_documented_one():
    """The nearest lookup ranks a table's entries by features each keeps
    (:meth:`AttentionProblem.near_features`); over problems with windows, softcaps, ALiBi,
    packed batches, dropout and GQA groups, that distance is the documented sum exactly."""
    import random

    from flashtune.core.problem import features_distance

    rng = random.Random(1)

    def shape():
        hkv, b = rng.choice([1, 2, 8]), rng.choice([1, 3, 8])
        nq = rng.choice([1, 77, 512, 2049])
        nk = rng.choice([nq, 2 * nq, 4096])
        causal = rng.random() < 0.5
        left = rng.choice([-1, -1, 63, 1000])
        right = -1 if causal else rng.choice([-1, 0, 31])
        packed = rng.random() < 0.2
        return AttentionProblem(
            b, hkv * rng.choice([1, 4]), hkv, nq, nk, 64, causal, "bf16",
            window_left=left, window_right=right,
            softcap=rng.choice([0.0, 0.0, 30.0]), alibi=rng.random() < 0.2,
            tokens_q=b * nq - (b - 1) if packed else 0,
            tokens_k=b * nk - (b - 1) if packed else 0,
            dropout=rng.choice([0.0, 0.0, 0.1]))

    problems = [shape() for _ in range(120)]
    finite = 0
    for a in problems:
        for b in problems[:40]:
            for across in (False, True):
                want = _distance_as_documented(a, b, across)
                assert a.distance(b, across_groups=across) == want, (a, b, across)
                if a.causal == b.causal:  # what the table's index compares
                    assert features_distance(a.near_features(), b.near_features(),
                                             across_groups=across) == want
                finite += want != float("inf")
    assert finite > 1000


def test_the_op_routers_read_an_implementations_config_tuned_for_exactly_a_shape(env):
    """``routing._tuned_at``, what the op routers compare a planning choice stored without
    candidates with: the implementation's own config tuned for exactly that problem on
    that device and its time, from its per-template table; nothing for a near problem or
    another device."""
    p = prob(128)
    populate(env["db"], [(HERE, p, cfg(32, 32), 0.7)])
    flashtune.reload_configs()
    config, ms = routing._tuned_at("attn_fwd", p, HERE)
    assert (config["BLOCK_M"], config["BLOCK_N"], ms) == (32, 32, 0.7)
    assert routing._tuned_at("attn_fwd", prob(127), HERE) is None  # near is not exact
    assert routing._tuned_at("attn_fwd", p, TWIN) is None
    assert routing._tuned_at("attn_decode", p, HERE) is None  # another implementation's table

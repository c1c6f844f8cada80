"""``flashtune.runtime.sources.load_choices``: op choices from the database, from
``$FLASHTUNE_CONFIG_DIR`` and from the package, in that order; stale or unknown winners
skipped; a bad source reported, never raised."""

from __future__ import annotations

import json
import logging
import sqlite3
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from flashtune.core.device import DeviceFingerprint
from flashtune.db import open_store
from flashtune.db.exchange import DeviceInfo, choice_document_to_json, choice_file_name
from flashtune.db.schema import VERSION_TABLE
from flashtune.kernel_templates import catalog, register_template, unregister_template
from flashtune.runtime import sources
from flashtune.runtime.sources import ChoiceEntry, load_choices
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
    choice_document,
    entry,
    extern_spec,
)

HERE = DeviceFingerprint("NVIDIA_H100_80GB_HBM3", "9.0", 132, 232448, 85520809984)
TWIN = DeviceFingerprint("NVIDIA_H100_PCIe", "9.0", 114, 232448, 85520809984)
KEY = ("NVIDIA_H100_80GB_HBM3", "9.0", 132, 232448)


@pytest.fixture
def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
    """Isolated sources (the default database absent until written, an empty config dir,
    a package dir) and the toy extern registered, so the registry's catalog knows it."""
    cache = tmp_path / "cache"
    (cache / "flashtune").mkdir(parents=True)
    cdir, pdir = tmp_path / "configs", tmp_path / "package"
    cdir.mkdir()
    pdir.mkdir()
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))
    monkeypatch.delenv("FLASHTUNE_DB", raising=False)
    monkeypatch.setenv("FLASHTUNE_CONFIG_DIR", str(cdir))
    real_dirs = sources.source_dirs
    monkeypatch.setattr(sources, "source_dirs",
                        lambda: [d for d in real_dirs() if d[0] == "dir"] + [("package", pdir)])
    register_template(extern_spec())
    hashes = {n: s.source_hash for n, s in catalog().items()}
    try:
        yield {"db": f"sqlite:///{cache / 'flashtune' / 'flashtune.db'}", "dir": cdir,
               "package": pdir, "hashes": hashes}
    finally:
        unregister_template(EXTERN)


def decide(url: str, op: str, i: int, implementation: str = "attn_fwd", *,
           device: DeviceFingerprint = HERE, **kwargs: Any) -> None:
    problem = (FWD_PROBLEMS if op == "fwd" else DECODE_PROBLEMS)[i]
    values: dict[str, Any] = dict(source_hash=FWD, config=FWD_CFG, median_ms=1.0,
                                  tflops=200.0)
    values.update(kwargs)
    with open_store(url) as store:
        d = store.ensure_device(device)
        store.put_choice(d.id, op, problem.key(), implementation=implementation, **values)


def write(folder: Path, *entries: Any, op: str = "fwd", device: DeviceFingerprint = HERE,
          **kwargs: Any) -> Path:
    doc = choice_document(*entries, op=op, device=DeviceInfo(*device.hardware_key()),
                          **kwargs)
    path = folder / choice_file_name(device.name, op)
    path.write_text(choice_document_to_json(doc))
    return path


def test_the_database_alone(env: dict) -> None:
    decide(env["db"], "fwd", 0, runner_up=EXTERN, runner_up_ms=1.25, extern=EXTERN,
           extern_ms=1.25)
    decide(env["db"], "fwd", 1, EXTERN, source_hash=EXTERN_HASH, config={}, median_ms=0.5,
           tflops=None)
    decide(env["db"], "decode", 0, "attn_decode", source_hash=DECODE, config=DECODE_CFG)
    entries, problems = load_choices("fwd", env["hashes"], HERE.name)
    assert problems == []
    assert [(e.implementation, e.config, e.margin) for e in entries] == [
        ("attn_fwd", FWD_CFG, 1.25), (EXTERN, {}, None)]  # sorted by bucket
    first = entries[0]
    assert isinstance(first, ChoiceEntry) and first.device == KEY
    assert first.problem == FWD_PROBLEMS[0] and first.origin == f"db {env['db']}"
    assert (first.median_ms, first.tflops) == (1.0, 200.0)
    [decode] = load_choices("decode", env["hashes"], HERE.name)[0]
    assert (decode.implementation, decode.problem) == ("attn_decode", DECODE_PROBLEMS[0])


def test_a_db_url_argument_wins_over_the_default(env: dict, tmp_path: Path) -> None:
    other = f"sqlite:///{tmp_path / 'other.db'}"
    decide(other, "fwd", 0)
    [e] = load_choices("fwd", env["hashes"], HERE.name, db_url=other)[0]
    assert e.origin == f"db {other}"
    assert load_choices("fwd", env["hashes"], HERE.name) == ([], [])  # default: not there


def test_stale_and_unknown_winners_are_marked_with_one_info_line(
        env: dict, caplog: pytest.LogCaptureFixture) -> None:
    decide(env["db"], "fwd", 0, source_hash=OLD)  # decided at an old attn_fwd source
    decide(env["db"], "fwd", 1, "no_such_impl", config={"BLOCK_M": 64})  # unknown here
    decide(env["db"], "fwd", 2)
    with caplog.at_level(logging.INFO, logger="flashtune.runtime.sources"):
        entries, problems = load_choices("fwd", env["hashes"], HERE.name)
    # the stale ones come back marked: the router serves them as "take the default"
    assert problems == [] and sorted((e.problem.seqlen_q, e.stale) for e in entries) == \
        sorted((p.seqlen_q, i < 2) for i, p in enumerate(FWD_PROBLEMS[:3]))
    [line] = [r.getMessage() for r in caplog.records if "not served" in r.getMessage()]
    assert line == (f"db {env['db']}: op choices not served (stale; calls near them take the "
                    "default): 1 of attn_fwd (decided at another source), 1 of no_such_impl "
                    "(unknown)")
    # the caller decides what is current: with the old hash, the old decision is served
    old = load_choices("fwd", {**env["hashes"], "attn_fwd": OLD}, HERE.name)[0]
    assert [e.problem for e in old if not e.stale] == [FWD_PROBLEMS[0]]


def test_files_of_the_config_dir_and_the_package(env: dict) -> None:
    write(env["package"], entry(FWD_PROBLEMS[0], median_ms=3.0))
    write(env["dir"], entry(FWD_PROBLEMS[0], median_ms=2.0),
          entry(FWD_PROBLEMS[1], implementation=EXTERN, config={}, runner_up="attn_fwd",
                runner_up_ms=1.5))
    decide(env["db"], "fwd", 0)
    entries, problems = load_choices("fwd", env["hashes"], HERE.name)
    assert problems == []
    # precedence order: the database, then $FLASHTUNE_CONFIG_DIR, then the package
    assert [(e.origin.split()[0], e.problem, e.median_ms) for e in entries] == [
        ("db", FWD_PROBLEMS[0], 1.0), ("dir", FWD_PROBLEMS[1], 1.0),
        ("dir", FWD_PROBLEMS[0], 2.0), ("package", FWD_PROBLEMS[0], 3.0)]
    dir_extern = entries[1]
    assert dir_extern.origin == f"dir {env['dir'] / choice_file_name(HERE.name, 'fwd')}"
    assert (dir_extern.implementation, dir_extern.config, dir_extern.margin) == \
        (EXTERN, {}, 1.5)
    assert dir_extern.device == KEY
    # configs come validated: attn_fwd's optional knobs are filled in
    assert entries[2].config == {**FWD_CFG, "USE_TMA": 0, "REVERSE_M": 0, "SPLIT_D": 0}
    assert load_choices("decode", env["hashes"], HERE.name) == ([], [])


def test_other_devices_files_are_read_only_for_aliases(env: dict) -> None:
    write(env["dir"], entry(), device=TWIN)
    assert load_choices("fwd", env["hashes"], HERE.name) == ([], [])
    [e] = load_choices("fwd", env["hashes"], HERE.name, aliases=True)[0]
    assert e.device[0] == TWIN.name


def test_the_file_name_is_the_exporters(env: dict) -> None:
    path = write(env["dir"], entry())
    assert path.name == f"device_name={HERE.name},op=fwd.json"
    path.rename(path.with_name("renamed.json"))
    assert load_choices("fwd", env["hashes"], HERE.name) == ([], [])
    # a decode file under the fwd name is refused, with the reason
    write(env["dir"], entry(DECODE_PROBLEMS[0], implementation="attn_decode",
                            config=DECODE_CFG, runner_up=None, runner_up_ms=None,
                            extern=None, extern_ms=None), op="decode")
    (env["dir"] / choice_file_name(HERE.name, "decode")).rename(
        env["dir"] / choice_file_name(HERE.name, "fwd"))
    entries, [problem] = load_choices("fwd", env["hashes"], HERE.name)
    assert entries == [] and "not what its name says" in problem


def test_a_file_naming_an_implementation_unknown_here_serves_the_rest(env: dict) -> None:
    """A file from a flashtune with more implementations is read leniently: the entries of
    the unknown one are stale (marking where it won), the others served (an import would
    refuse the file)."""
    write(env["dir"], entry(FWD_PROBLEMS[0], implementation="no_such_impl",
                            config={"BLOCK_M": 64}),
          entry(FWD_PROBLEMS[1]),
          implementations={"no_such_impl": "abcdefabcdefabcd", "attn_fwd": FWD,
                           EXTERN: EXTERN_HASH})
    entries, problems = load_choices("fwd", env["hashes"], HERE.name)
    assert problems == []
    assert [(e.problem, e.stale) for e in entries] == [(FWD_PROBLEMS[1], False),
                                                       (FWD_PROBLEMS[0], True)]


@pytest.mark.parametrize("damage", ["garbage-db", "newer-schema-db", "corrupt-json",
                                    "bad-config", "dir-is-a-file", "dir-missing",
                                    "db-named-but-missing", "not-a-user-op"])
def test_a_bad_source_is_reported_and_the_others_still_serve(
        env: dict, damage: str, monkeypatch: pytest.MonkeyPatch) -> None:
    db_path = Path(env["db"].removeprefix("sqlite:///"))
    write(env["package"], entry(FWD_PROBLEMS[2]))  # a good source
    op = "fwd"
    if damage == "garbage-db":
        db_path.write_bytes(b"this is not a database" * 100)
    elif damage == "newer-schema-db":
        decide(env["db"], "fwd", 0)
        with sqlite3.connect(db_path) as conn:
            conn.execute(f"UPDATE {VERSION_TABLE} SET version_num = '9999'")
    elif damage == "corrupt-json":
        path = write(env["dir"], entry())
        path.write_text(path.read_text()[:-40])
    elif damage == "bad-config":
        path = write(env["dir"], entry())
        data = json.loads(path.read_text())
        data["entries"][0]["config"]["BLOCK_M"] = 7
        path.write_text(json.dumps(data))
    elif damage == "dir-is-a-file":
        env["dir"].rmdir()
        env["dir"].write_text("a file where a folder should be")
    elif damage == "dir-missing":
        env["dir"].rmdir()
    elif damage == "db-named-but-missing":
        monkeypatch.setenv("FLASHTUNE_DB", f"sqlite:///{db_path.parent / 'typo.db'}")
    else:
        op = "bwd"
    entries, problems = load_choices(op, env["hashes"], HERE.name)
    assert len(problems) == 1, problems
    if op == "bwd":
        assert entries == [] and "not a user op" in problems[0]
        return
    assert [(e.origin.split()[0], e.problem) for e in entries] == \
        [("package", FWD_PROBLEMS[2])]
    assert not (db_path.parent / "typo.db").exists()  # never created


def test_a_stale_choice_sends_the_calls_near_it_to_the_default(env: dict) -> None:
    """A shipped table's cuDNN wins go stale with the torch version: the shapes near them
    must take the default (cuDNN on Hopper), not the nearest fresh choice, which was made
    for another shape (flashtune's kernel where it beat cuDNN)."""
    from flashtune.core.problem import AttentionProblem
    from flashtune.kernel_templates import implementations
    from flashtune.runtime.choices import OpRouter

    a = AttentionProblem(2, 8, 2, 2048, 2048, 64, True, "bf16")  # the extern won here
    b = AttentionProblem(2, 8, 2, 8192, 8192, 64, True, "bf16")  # attn_fwd won here
    write(env["package"],
          entry(a, implementation=EXTERN, config={}, runner_up="attn_fwd", runner_up_ms=1.3,
                extern=None, extern_ms=None),
          entry(b), implementations={EXTERN: OLD, "attn_fwd": FWD})  # the extern: stale
    router = OpRouter("fwd", {s.name: s for s in implementations("fwd")})

    def served(nq: int) -> tuple[str | None, str | None]:
        got = router.choose(replace(a, seqlen_q=nq, seqlen_k=nq), HERE)
        return (None, None) if got is None else (got.template, got.source)

    assert served(2048) == (None, None)  # its exact match is stale: the default
    assert served(2560) == (None, None)  # nearer the stale choice than the fresh one
    assert served(8192) == ("attn_fwd", "exact")
    assert served(7168)[0] == "attn_fwd"
    # a fresh choice of the same shape (here the user's database) replaces the stale one
    decide(env["db"], "fwd", 0, EXTERN, source_hash=EXTERN_HASH, config={}, median_ms=0.5,
           tflops=None)
    write(env["package"],
          entry(a, implementation=EXTERN, config={}, runner_up="attn_fwd", runner_up_ms=1.3,
                extern=None, extern_ms=None),
          entry(FWD_PROBLEMS[0], implementation=EXTERN, config={}, runner_up=None,
                runner_up_ms=None, extern=None, extern_ms=None),
          entry(b), implementations={EXTERN: OLD, "attn_fwd": FWD})
    router.reload()
    fresh = router.choose(FWD_PROBLEMS[0], HERE)
    assert fresh is not None and (fresh.template, fresh.origin.split()[0]) == (EXTERN, "db")
    assert served(2048) == (None, None)


def test_the_config_dirs_choice_holds_its_shape_against_the_shipped_one(env: dict) -> None:
    """A choice in $FLASHTUNE_CONFIG_DIR overrides the shipped choice of the same shape for
    its neighbours too, though the shipped one was measured faster (nearest lookups used to
    rank both and take the faster)."""
    from flashtune.core.problem import AttentionProblem
    from flashtune.kernel_templates import implementations
    from flashtune.runtime.choices import OpRouter

    a = AttentionProblem(2, 8, 2, 2048, 2048, 64, True, "bf16")
    write(env["package"], entry(a, implementation=EXTERN, config={}, median_ms=0.5,
                                runner_up="attn_fwd", runner_up_ms=1.3, extern=None,
                                extern_ms=None))
    write(env["dir"], entry(a, median_ms=2.0))
    router = OpRouter("fwd", {s.name: s for s in implementations("fwd")})
    for nq, source in ((2048, "exact"), (3000, "nearest")):
        got = router.choose(replace(a, seqlen_q=nq, seqlen_k=nq), HERE)
        assert got is not None and (got.template, got.origin.split()[0]) == ("attn_fwd", "dir")
        assert got.source == source


def test_a_shipped_file_is_warned_about_when_flashtunes_kernels_moved_not_torch(
        env: dict, caplog: pytest.LogCaptureFixture) -> None:
    """An SDPA backend's choices go stale with every torch or cuDNN other than the one
    that timed them: that is logged (their shapes take the default, as the choice would),
    not warned about in every process; a stale choice of flashtune's own kernel is (it
    changed since: re-tune)."""
    write(env["package"], entry(FWD_PROBLEMS[0], implementation=EXTERN, config={},
                                runner_up=None, runner_up_ms=None, extern=None,
                                extern_ms=None),
          entry(FWD_PROBLEMS[1]), implementations={EXTERN: OLD, "attn_fwd": FWD})
    with caplog.at_level(logging.INFO, logger="flashtune.runtime.sources"):
        entries, problems = load_choices("fwd", env["hashes"], HERE.name)
    assert problems == [] and sorted(e.stale for e in entries) == [False, True]
    assert any("not served" in r.getMessage() and EXTERN in r.getMessage()
               for r in caplog.records)
    # `flashtune show` and `db verify` still list it, saying what it means
    (table,), _ = sources.stale_tables(device_name=HERE.name)
    assert f"{EXTERN} timed under another torch or cuDNN" in table.reason
    assert "those shapes take the default" in table.line()
    path = write(env["package"], entry(FWD_PROBLEMS[0]), entry(FWD_PROBLEMS[1]),
                 implementations={"attn_fwd": OLD, EXTERN: EXTERN_HASH})
    entries, [problem] = load_choices("fwd", env["hashes"], HERE.name)
    assert all(e.stale for e in entries)
    assert problem.startswith(f"package {path.name} is stale: all 2 op fwd choices")
    assert "flashtune tune --op fwd" in problem


def test_an_extern_that_plans_every_shape_serves_inference_only_at_its_own_shapes(
        env: dict) -> None:
    """cuDNN builds a plan the first time it meets a shape (40-68 ms on an H200): a
    ``fwd`` or ``decode`` choice of it serves its exact shape, and a shape only near it
    (here with nothing else timed beside it) takes the default, as a stale choice's
    neighbours do, not a choice made further away. An extern without that cost serves near
    shapes, and so does a ``train`` choice (a training run meets its shapes every step)."""
    from flashtune.core.problem import AttentionProblem
    from flashtune.kernel_templates import implementations
    from flashtune.runtime.choices import OpRouter

    a = AttentionProblem(2, 8, 2, 2048, 2048, 64, True, "bf16")  # the extern won here
    b = AttentionProblem(2, 8, 2, 8192, 8192, 64, True, "bf16")  # attn_fwd won here
    write(env["package"],
          entry(a, implementation=EXTERN, config={}, runner_up="attn_fwd", runner_up_ms=1.3,
                extern=None, extern_ms=None),
          entry(b), implementations={EXTERN: EXTERN_HASH, "attn_fwd": FWD})

    def router(op: str, plans: bool) -> OpRouter:
        specs = {s.name: s for s in implementations(op)}
        specs[EXTERN] = replace(specs[EXTERN], plans_per_shape=plans)
        return OpRouter(op, specs)

    def served(r: OpRouter, nq: int) -> tuple[str | None, str | None]:
        got = r.choose(replace(a, seqlen_q=nq, seqlen_k=nq), HERE)
        return (None, None) if got is None else (got.template, got.source)

    planning = router("fwd", True)
    assert served(planning, 2048) == (EXTERN, "exact")
    assert served(planning, 2047) == (None, None)  # its bucket: a new shape to plan
    assert served(planning, 2560) == (None, None)  # nearer it than attn_fwd's choice
    assert served(planning, 7168) == ("attn_fwd", "bucket")
    plain = router("fwd", False)
    assert served(plain, 2047) == (EXTERN, "bucket")
    assert served(plain, 2560) == (EXTERN, "nearest")
    # the train op's table is another file: the same two choices there, the toy extern
    # differentiated by torch as SDPA's backends are
    unregister_template(EXTERN)
    register_template(replace(extern_spec(), serves=("fwd", "decode", "train")))
    write(env["package"],
          entry(a, implementation=EXTERN, config={}, runner_up="attn_fwd", runner_up_ms=1.3,
                extern=None, extern_ms=None),
          entry(b), op="train", implementations={EXTERN: EXTERN_HASH, "attn_fwd": FWD})
    training = router("train", True)
    assert served(training, 2560) == (EXTERN, "nearest")


def test_a_shape_near_a_planning_choice_takes_what_was_timed_beside_it(env: dict) -> None:
    """Where a ``fwd`` or ``decode`` choice of an implementation that plans every shape
    would serve a near shape, the router serves the fastest candidate timed beside it there
    that plans nothing, with the config it was timed with: from a file (its hash the
    document's, or the candidate's own) and from the database; a candidate timed at
    another source, one that failed, or one that cannot serve the call is passed over, and
    with none left the call takes the default."""
    from flashtune.core.problem import AttentionProblem
    from flashtune.kernel_templates import get_template, implementations
    from flashtune.runtime.choices import OpRouter

    a = AttentionProblem(2, 8, 2, 2048, 2048, 64, True, "bf16")
    timed = dict(FWD_CFG, num_warps=4)
    filled = get_template("attn_fwd").space.validate(timed)  # the knobs left out: defaults

    def candidates(fwd_hash: str | None) -> list[dict[str, Any]]:
        return [{"implementation": EXTERN, "config": {}, "median_ms": 1.0},
                {"implementation": "attn_decode", "config": DECODE_CFG, "median_ms": None},
                {"implementation": "attn_fwd", "config": timed, "median_ms": 1.3}
                | ({} if fwd_hash is None else {"source_hash": fwd_hash})]

    def router() -> OpRouter:
        specs = {s.name: s for s in implementations("fwd")}
        specs[EXTERN] = replace(specs[EXTERN], plans_per_shape=True)
        return OpRouter("fwd", specs)

    def served(nq: int, **kwargs: Any) -> tuple[Any, ...]:
        got = router().choose(replace(a, seqlen_q=nq, seqlen_k=nq), HERE, **kwargs)
        return (None,) if got is None else (got.template, got.source, got.config,
                                            got.median_ms)

    def ship(fwd_hash: str | None) -> None:
        write(env["package"], entry(a, implementation=EXTERN, config={}, runner_up="attn_fwd",
                                    runner_up_ms=1.3, extern=None, extern_ms=None,
                                    candidates=tuple(candidates(fwd_hash))),
              implementations={EXTERN: EXTERN_HASH, "attn_fwd": FWD})

    ship(None)  # the document's hash of attn_fwd
    [e] = load_choices("fwd", env["hashes"], HERE.name)[0]
    assert [(x.implementation, x.config, x.median_ms) for x in e.alternatives] == [
        ("attn_fwd", timed, 1.3)]  # not the winner, not the one that failed
    assert served(2048) == (EXTERN, "exact", {}, 1.0)
    assert served(2047) == ("attn_fwd", "bucket", filled, 1.3)
    assert served(2560)[:2] == ("attn_fwd", "nearest")
    ship(FWD)  # the candidate's own
    assert served(2047)[:2] == ("attn_fwd", "bucket")
    ship(OLD)  # timed at another attn_fwd source
    assert served(2047) == (None,)
    # the database's candidates, which win over the package's file
    ship(OLD)
    decide(env["db"], "fwd", 0, EXTERN, source_hash=EXTERN_HASH, config={}, median_ms=1.0,
           tflops=300.0, candidates=candidates(FWD))
    db_problem = FWD_PROBLEMS[0]
    got = router().choose(replace(db_problem, seqlen_q=db_problem.seqlen_q - 1,
                                  seqlen_k=db_problem.seqlen_k - 1), HERE)
    assert got is not None and (got.template, got.config) == ("attn_fwd", filled)
    assert got.tflops == pytest.approx(300.0 / 1.3)


def test_a_compiled_training_call_takes_the_own_pair_timed_beside_an_externs_choice(
        env: dict) -> None:
    """Under ``torch.compile`` (``paired``) a training call's backward is flashtune's, so an
    extern's training step (cuDNN's, differentiated by torch) cannot serve it: where one
    won, the router serves the fastest of flashtune's own pairs timed beside it, with its
    config and time as timed there, at that shape and near it. A call that is not paired
    gets the extern. Where no own pair was timed beside it, the walk goes on to the nearest
    own choice, as it did before choices carried their candidates."""
    from flashtune.core.problem import AttentionProblem
    from flashtune.kernel_templates import implementations
    from flashtune.runtime.choices import OpRouter

    unregister_template(EXTERN)
    register_template(replace(extern_spec(), serves=("fwd", "decode", "train")))
    specs = {s.name: s for s in implementations("train")}
    pair = specs["attn_fwd"]
    a = AttentionProblem(2, 8, 2, 2048, 2048, 64, True, "bf16")  # the extern won here
    b = AttentionProblem(2, 8, 2, 8192, 8192, 64, True, "bf16")  # attn_fwd's pair won here
    timed = pair.default_config(a, HERE)
    assert pair.space.check(timed, a, HERE) is None

    def ship(candidates: tuple[dict[str, Any], ...]) -> None:
        write(env["package"],
              entry(a, implementation=EXTERN, config={}, median_ms=1.0, runner_up="attn_fwd",
                    runner_up_ms=1.3, extern=None, extern_ms=None, candidates=candidates),
              entry(b, config=pair.default_config(b, HERE), median_ms=4.0, runner_up=None,
                    runner_up_ms=None, extern=None, extern_ms=None),
              op="train", implementations={EXTERN: EXTERN_HASH, "attn_fwd": pair.source_hash})

    def served(nq: int, **kwargs: Any) -> tuple[Any, ...]:
        got = OpRouter("train", specs).choose(replace(a, seqlen_q=nq, seqlen_k=nq), HERE,
                                              **kwargs)
        return (None,) if got is None else (got.template, got.source, got.median_ms)

    ship(({"implementation": EXTERN, "config": {}, "median_ms": 1.0},
          {"implementation": "attn_fwd", "config": timed, "median_ms": 1.3}))
    assert served(2048) == (EXTERN, "exact", 1.0)
    assert served(2048, paired=True) == ("attn_fwd", "exact", 1.3)
    got = OpRouter("train", specs).choose(a, HERE, paired=True)
    assert got is not None and got.config == pair.space.validate(timed)
    assert served(2040, paired=True) == ("attn_fwd", "bucket", 1.3)
    assert served(2560) == (EXTERN, "nearest", 1.0)
    assert served(2560, paired=True) == ("attn_fwd", "nearest", 1.3)
    ship(({"implementation": EXTERN, "config": {}, "median_ms": 1.0},))  # nothing of ours
    assert served(2048, paired=True) == ("attn_fwd", "nearest", 4.0)  # b's, further away
    assert served(2048) == (EXTERN, "exact", 1.0)
    # an extern that names a backward of flashtune's for its forward (cuDNN's own, as
    # sdpa_cudnn does; here attn_bwd stands in) serves the paired call itself, before
    # anything timed beside it; where that backward refuses the call, as before
    specs[EXTERN] = replace(specs[EXTERN], paired_backward="attn_bwd")
    assert served(2048, paired=True) == (EXTERN, "exact", 1.0)
    assert served(2560, paired=True) == (EXTERN, "nearest", 1.0)
    from flashtune.core.spec import Limits
    from flashtune.kernel_templates import get_template

    register_template(replace(get_template("attn_bwd"), name="bwd_toy",
                              limits=Limits(head_dims=(128,))))
    try:
        specs[EXTERN] = replace(specs[EXTERN], paired_backward="bwd_toy")  # not head dim 64
        assert served(2048, paired=True) == ("attn_fwd", "nearest", 4.0)
        assert served(2048) == (EXTERN, "exact", 1.0)
    finally:
        unregister_template("bwd_toy")


def test_only_cudnn_plans_every_shape() -> None:
    """Of torch's SDPA backends, cuDNN's builds a graph per shape; FLASH and EFFICIENT run
    a new shape at once (benchmarks/results/new_shape_h200.json)."""
    from flashtune.kernel_templates import get_template

    assert get_template("sdpa_cudnn").plans_per_shape
    assert not get_template("sdpa_flash").plans_per_shape
    assert not get_template("sdpa_efficient").plans_per_shape
    assert not get_template("attn_fwd").plans_per_shape


def test_a_planning_choice_stored_without_candidates_is_compared_with_the_tuned_tables(
        env: dict) -> None:
    """A planning choice from a table written before choices carried their candidates:
    a near shape takes the fastest implementation whose own config was tuned for exactly
    that choice's shape (the router's ``tuned_at``: the per-template tables), lent to the
    call; where none was, the default. Stored candidates, where there are some, come
    first."""
    from flashtune.core.problem import AttentionProblem
    from flashtune.kernel_templates import get_template, implementations
    from flashtune.runtime.choices import OpRouter

    a = AttentionProblem(2, 8, 2, 2048, 2048, 64, True, "bf16")
    fast = dict(FWD_CFG, num_warps=4)
    filled = get_template("attn_fwd").space.validate(fast)
    tables: dict[tuple[str, AttentionProblem], tuple[dict[str, int], float]] = {}
    asked: list[str] = []

    def tuned_at(name: str, problem: AttentionProblem, device: Any) -> Any:
        asked.append(name)
        return tables.get((name, problem))

    def served(nq: int, candidates: tuple[dict[str, Any], ...] = ()) -> tuple[Any, ...]:
        write(env["package"], entry(a, implementation=EXTERN, config={}, runner_up=None,
                                    runner_up_ms=None, extern=None, extern_ms=None,
                                    candidates=candidates),
              implementations={EXTERN: EXTERN_HASH})
        specs = {s.name: s for s in implementations("fwd")}
        specs[EXTERN] = replace(specs[EXTERN], plans_per_shape=True)
        got = OpRouter("fwd", specs, tuned_at).choose(replace(a, seqlen_q=nq, seqlen_k=nq),
                                                      HERE)
        return (None,) if got is None else (got.template, got.source, got.config,
                                            got.median_ms)

    assert served(2047) == (None,)  # nothing tuned at its shape: the default
    assert EXTERN not in asked and "attn_fwd" in asked  # the choice itself is not asked
    tables[("attn_fwd", a)] = (fast, 1.4)
    tables[("attn_fwd", replace(a, seqlen_q=4096, seqlen_k=4096))] = (FWD_CFG, 0.1)
    assert served(2047) == ("attn_fwd", "bucket", filled, 1.4)  # exactly its shape only
    assert served(2560)[:2] == ("attn_fwd", "nearest")
    # what was timed beside the choice, where it was stored, is what counts
    timed = ({"implementation": "attn_fwd", "config": FWD_CFG, "median_ms": 1.3,
              "source_hash": FWD},)
    assert served(2047, timed)[3] == 1.3

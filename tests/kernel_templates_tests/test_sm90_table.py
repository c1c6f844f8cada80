"""The sm_90 compile tables' regeneration: an entry's frontend IR hash (what ptxas would be
handed, source locations left out), reused figures where the hash is the old entry's, and
the ``--prefilter`` command's reuse and ``--hash-only`` modes (compiles for sm_90a on the
CPU; no GPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from flashtune.kernel_templates import sm90_table
from flashtune.kernel_templates.attn_fwd_gluon import space as fwd_space

ROOT = Path(__file__).resolve().parents[2]
CONFIG = {"ROWS": 64, "BLOCK_N": 64, "NUM_STAGES": 2, "NUM_CONSUMERS": 1, "PINGPONG": 0,
          "PERSISTENT": 0, "Q_BUFFERS": 1, "SPLIT_KV": 0, "TMA_STORE": 0, "CTAS_PER_SM": 1}

# in a process of its own: this one runs triton under the interpreter
_FRONTEND = """
import json, random, sys
import triton
from flashtune.kernel_templates import sm90_table as T
from flashtune.kernel_templates.attn_bwd_gluon import launcher as bwd, space as bwd_space
from flashtune.kernel_templates.attn_fwd_gluon import space as fwd_space
from flashtune.kernel_templates.attn_fwd_gluon.launcher import compile_sm90
cfg = json.loads(sys.argv[1])
real = triton.compile
out = {"a": T.frontend_hash(lambda: compile_sm90(cfg, 64, False)),
       "a_again": T.frontend_hash(lambda: compile_sm90(cfg, 64, False)),
       "causal": T.frontend_hash(lambda: compile_sm90(cfg, 64, True)),
       "stages": T.frontend_hash(lambda: compile_sm90({**cfg, "NUM_STAGES": 3}, 64, False)),
       "restored": triton.compile is real}
try:
    T.frontend_hash(lambda: None)
except RuntimeError as exc:
    out["no_compile"] = str(exc)
def broken():
    raise ValueError("the frontend failed")
out["broken"] = T.frontend_hash(broken)
rnd = random.Random(0)
for name, space, fn in (
        ("fwd", fwd_space, lambda e: compile_sm90(e["config"], e["head_dim"], e["causal"],
                                                  e["dtype"])),
        ("bwd", bwd_space, lambda e: bwd.compile_sm90(e["config"], e["head_dim"],
                                                      e["causal"]))):
    entries = json.loads(space.TABLE.read_text())["entries"]
    out[name + "_all_hashed"] = all(e.get("ir_hash") for e in entries)
    out[name] = [[T.frontend_hash(lambda e=e: fn(e)), e["ir_hash"]]
                 for e in rnd.sample(entries, 3)]
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def frontend() -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, "-c", _FRONTEND, json.dumps(CONFIG)],
                          capture_output=True, check=False, text=True, env=env, timeout=600,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


def test_the_ir_digest_leaves_source_locations_out() -> None:
    text = ('#mma = #ttg.nvidia_mma<{versionMajor = 3}>\nmodule {\n'
            '  %0 = arith.addi %a, %b : i32 loc(#loc3)\n'
            '  tt.call @"m._f__i32"(%0) : (i32) -> () loc(fused[#loc1, #loc2])\n}\n'
            '#loc1 = loc("kernel.py":10:4)\n#loc3 = loc(callsite(#loc1 at #loc2))\n')
    moved = text.replace('10:4', '12:8').replace("loc(#loc3)", 'loc("kernel.py":3:1)')
    assert sm90_table.ir_digest(text) == sm90_table.ir_digest(moved)
    assert sm90_table.ir_digest(text) != sm90_table.ir_digest(text.replace("addi", "subi"))
    assert len(sm90_table.ir_digest(text)) == 16


def test_the_frontend_hash_names_the_compile_and_compiles_nothing(frontend) -> None:
    assert frontend["a"] is not None and frontend["a"] == frontend["a_again"]
    assert len({frontend["a"], frontend["causal"], frontend["stages"]}) == 3
    assert frontend["restored"]  # triton.compile is put back
    assert "did not call triton.compile" in frontend["no_compile"]
    assert frontend["broken"] is None  # the full compile then records the error


def test_an_old_entry_is_reused_only_with_the_same_ir_hash(monkeypatch) -> None:
    compiled: list[str] = []

    def fake_compiled_entry(case, compile_fn):  # noqa: ANN001, ANN202 - the full compile
        compiled.append(case["name"])
        return dict(case, shared=1, registers=2, spill_bytes=0, error=None)

    monkeypatch.setattr(sm90_table, "_compiled_entry", fake_compiled_entry)
    digest = "0123456789abcdef"
    monkeypatch.setattr(sm90_table, "frontend_hash", lambda compile_fn: digest)
    old = {"name": "old", "shared": 99, "registers": 168, "spill_bytes": 4, "error": None,
           "ir_hash": digest}
    got = sm90_table.compile_entry({"name": "a"}, print, old)
    assert got == {"name": "a", "shared": 99, "registers": 168, "spill_bytes": 4,
                   "error": None, "ir_hash": digest, "reused": True} and compiled == []
    got = sm90_table.compile_entry({"name": "b"}, print, {**old, "ir_hash": "0" * 16})
    assert got["shared"] == 1 and got["ir_hash"] == digest and compiled == ["b"]
    got = sm90_table.compile_entry({"name": "c"}, print, {**old, "ir_hash": None})
    assert got["shared"] == 1 and compiled == ["b", "c"]  # no hash recorded: compiled
    got = sm90_table.compile_entry({"name": "d"}, print, {**old, "ir_hash": None},
                                   keep=True)
    assert got["shared"] == 99 and got["ir_hash"] == digest and compiled == ["b", "c"]


def test_a_table_entrys_ir_hash_is_checked_when_read() -> None:
    ok = fwd_space.Compiled(1024, 168, 0)
    entry = {"head_dim": 128, "dtype": "bf16", "causal": False, "config": _full(),
             "shared": ok.shared, "registers": ok.registers, "spill_bytes": ok.spill_bytes,
             "error": None}
    for good in (None, "0123456789abcdef"):
        fwd_space.parse_table({"format": 1, "entries": [{**entry, "ir_hash": good}]})
    for bad in ("xyz", 12, "0123456789ABCDEF"):
        with pytest.raises(ValueError, match="ir_hash"):
            fwd_space.parse_table({"format": 1, "entries": [{**entry, "ir_hash": bad}]})


def _full() -> dict[str, int]:
    return {name: int(CONFIG.get(name, fwd_space.DEFAULTS.get(name, 0)))
            for name in fwd_space.PARAMS}


def test_the_shipped_tables_hashes_are_their_compiles(frontend) -> None:
    """Every entry of both Gluon tables has an ``ir_hash``, and three of each, picked at
    random, hash so now (the table and the source agree, as ``--prefilter`` reuses
    them)."""
    for name in ("fwd", "bwd"):
        assert frontend[name + "_all_hashed"], name
        for now, recorded in frontend[name]:
            assert now == recorded, name


def _fake_case(case: dict[str, Any], old: dict[str, Any] | None = None,
               keep: bool = False) -> dict[str, Any]:
    """A compile_case whose 'frontend' hashes the config and whose 'compile' counts."""
    ir_hash = f"{case['n'] * 7 + case['v']:016x}"
    if old is not None and (keep or old.get("ir_hash") == ir_hash):
        return dict(case, shared=old["shared"], registers=old["registers"],
                    spill_bytes=old["spill_bytes"], error=None, ir_hash=ir_hash, reused=True)
    return dict(case, shared=1000 + case["n"], registers=128, spill_bytes=0, error=None,
                ir_hash=ir_hash)


def _write(tmp_path: Path, cases: list[dict[str, Any]], *argv: str,
           source: str = "s1", triton: str = "3.6.0") -> int:
    return sm90_table.write_table(
        ["--prefilter", "--jobs", "1", "--out", str(tmp_path / "t.json"), *argv],
        command="x --prefilter", description=None, table=tmp_path / "t.json", cases=cases,
        compile_case=_fake_case, label=lambda e: str(e["n"]),
        header={"format": 1, "source_hash": source, "triton": triton, "target": "sm_90a"},
        check=lambda doc, where: None)


def test_regenerating_reuses_the_entries_whose_hash_did_not_change(tmp_path: Path, capsys,
                                                                   monkeypatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET")  # the fake compiles need no triton
    cases = [{"n": n, "v": 0} for n in range(4)]
    assert _write(tmp_path, cases) == 0
    doc = json.loads((tmp_path / "t.json").read_text())
    assert [e["shared"] for e in doc["entries"]] == [1000, 1001, 1002, 1003]
    assert all("reused" not in e for e in doc["entries"])
    for e in doc["entries"]:  # figures a recompile would not give: kept when reused
        e["shared"] += 1
    (tmp_path / "t.json").write_text(json.dumps(doc))
    cases[2]["v"] = 1  # this compile's IR changed
    assert _write(tmp_path, cases, source="s2") == 0
    shared = [e["shared"] for e in json.loads((tmp_path / "t.json").read_text())["entries"]]
    assert shared == [1001, 1002, 1002, 1004]
    assert "3 reused" in capsys.readouterr().err
    # another Triton: nothing reused
    assert _write(tmp_path, cases, triton="3.7.0") == 0
    shared = [e["shared"] for e in json.loads((tmp_path / "t.json").read_text())["entries"]]
    assert shared == [1000, 1001, 1002, 1003]
    assert "not reusing" in capsys.readouterr().err


def test_hash_only_needs_a_table_of_this_source_with_every_case(tmp_path: Path, capsys,
                                                                 monkeypatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET")
    cases = [{"n": n, "v": 0} for n in range(3)]
    assert _write(tmp_path, cases, "--hash-only") == 2  # no table yet
    assert "no table" in capsys.readouterr().err
    assert _write(tmp_path, cases) == 0
    doc = json.loads((tmp_path / "t.json").read_text())
    for e in doc["entries"]:
        e["shared"] = 7
        e["ir_hash"] = None
    (tmp_path / "t.json").write_text(json.dumps(doc))
    assert _write(tmp_path, cases, "--hash-only", source="s2") == 2
    assert "compiled from source s1" in capsys.readouterr().err
    assert _write(tmp_path, cases + [{"n": 9, "v": 0}], "--hash-only") == 2
    assert "lacks 1 of the cases" in capsys.readouterr().err
    assert _write(tmp_path, cases, "--hash-only") == 0
    got = json.loads((tmp_path / "t.json").read_text())["entries"]
    assert [e["shared"] for e in got] == [7, 7, 7] and all(e["ir_hash"] for e in got)

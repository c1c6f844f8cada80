"""``benchmarks/shipped_sass.py``, the evidence for re-keying shipped tables: which configs it
compiles, how it compares two runs, and one real sm_90 compile of a shipped config (CPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import load_benchmark

ROOT = Path(__file__).resolve().parents[2]


def _doc(path: Path, doc: dict) -> None:
    path.write_text(json.dumps(doc))


def test_it_takes_the_templates_tables_and_its_candidates_in_op_files(tmp_path: Path) -> None:
    m = load_benchmark("shipped_sass")
    p1 = {"batch": 1, "heads_q": 8}
    p2 = {"batch": 2, "heads_q": 8}
    _doc(tmp_path / "a.json", {"template": {"name": "attn_decode"},
                               "entries": [{"problem": p1, "config": {"X": 1}}]})
    _doc(tmp_path / "b.json", {"template": {"name": "attn_fwd"},
                               "entries": [{"problem": p1, "config": {"Y": 1}}]})
    _doc(tmp_path / "c.json", {"op": "decode", "entries": [
        {"problem": p2, "candidates": [{"implementation": "attn_decode", "config": {"X": 2}},
                                       {"implementation": "sdpa_cudnn", "config": {}}]},
        {"problem": p1, "candidates": [{"implementation": "attn_decode", "config": {"X": 1}}]}]})
    got = [json.loads(k) for k in m.shipped_configs("attn_decode", tmp_path)]
    assert got == [[p1, {"X": 1}], [p2, {"X": 2}]]  # distinct, the other template's not


def test_a_comparison_fails_on_any_change_of_code_and_not_on_registers() -> None:
    m = load_benchmark("shipped_sass")
    run = {"k1": [{"kernel": "split", "sass": "aa", "registers": 96, "spill_store_bytes": 0}],
           "k2": "CompilationError: x"}
    same = {"k1": [dict(run["k1"][0], registers=90)], "k2": "CompilationError: x"}
    assert m.differences(run, same) == []
    moved = {"k1": [dict(run["k1"][0], sass="ab")], "k2": run["k2"], "k3": []}
    assert m.differences(run, moved) == ["only after: k3", "changed: k1: [('split', 'aa')] -> "
                                         "[('split', 'ab')]"]


def test_one_shipped_config_compiles_and_compares_with_itself(tmp_path: Path) -> None:
    """The whole command on the H100 decode table's first entry (a config dir of one file):
    compiled for sm_90, then compared with its own run."""
    m = load_benchmark("shipped_sass")
    configs = ROOT / "flashtune" / "configs"
    doc = json.loads((configs / "device_name=NVIDIA_H100_80GB_HBM3,template=attn_decode.json")
                     .read_text())
    doc["entries"] = doc["entries"][:1]
    (tmp_path / "configs").mkdir()
    _doc(tmp_path / "configs" / "one.json", doc)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    out = tmp_path / "run.json"
    for extra in (["--out", str(out)], ["--compare", str(out)]):
        proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "shipped_sass.py"),
                               "attn_decode", "--workers", "1", "--configs",
                               str(tmp_path / "configs"), *extra], capture_output=True,
                              text=True, env=env, timeout=600, cwd=ROOT)
        if proc.returncode == 2 and "nvdisasm" in proc.stderr:
            pytest.skip("no nvdisasm on this machine: nothing to hash")
        assert proc.returncode == 0, proc.stderr[-2000:]
    [(key, launches)] = json.loads(out.read_text()).items()
    assert json.loads(key)[1] == doc["entries"][0]["config"]
    assert launches[0]["kernel"] == "attn_decode_split_kernel" and launches[0]["sass"]
    assert "1 of 1 configs: the same code" in proc.stderr
    assert m.differences({key: launches}, {key: launches}) == []

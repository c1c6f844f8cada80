"""``benchmarks/ship_check.sh``, issue 26's nearest-against-exact check, on the CPU: a tiny
plan, the interpreter, SDPA flash as the anchor (cuDNN is GPU-only). The script's four
steps run as on a GPU: bench with no database, tune the plan, bench with the tuned
database, and the table of nearest over exact. Run with ``TRITON_INTERPRET`` unset, as a
user's shell is: ``bench`` must decide interpreter mode before it imports triton, or every
own kernel fails with "0 active drivers"."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cli_tests.test_ship_tables import PLAN, ROOT

# a decoding step: one query row over a cache, routed by the decode op's choices
DECODE_PLAN = """op = "decode"
[[shape]]
batch = 1
heads = 2
seqlen = 1
kv_seqlen = 32
head_dim = 16
causal = true
dtype = "fp16"
"""
# a softcap, which no SDPA backend serves: anchored to flashtune's template default
SOFTCAP_PLAN = PLAN.format(op="fwd") + "softcap = 30.0\n"
CASES = {  # name: (op, plan, label, anchor of the row)
    "fwd": ("fwd", PLAN.format(op="fwd"), "B=1 Hq=2 Hkv=2 Nq=32 Nk=32 D=16 fp16 causal",
            "sdpa_flash"),
    "train": ("train", PLAN.format(op="train"), "B=1 Hq=2 Hkv=2 Nq=32 Nk=32 D=16 fp16 causal",
              "sdpa_flash"),
    "decode": ("decode", DECODE_PLAN, "B=1 Hq=2 Hkv=2 Nq=1 Nk=32 D=16 fp16 causal",
               "sdpa_flash"),
    "softcap": ("fwd", SOFTCAP_PLAN, "B=1 Hq=2 Hkv=2 Nq=32 Nk=32 D=16 fp16 causal softcap=30",
                "flashtune_default"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_check_compares_nearest_with_exact_for_each_tuned_shape(tmp_path, case):
    op, text, label, row_anchor = CASES[case]
    plan = tmp_path / "plan.toml"
    plan.write_text(text)
    env = {k: v for k, v in os.environ.items()
           if k not in ("TRITON_INTERPRET", "FLASHTUNE_DB", "FLASHTUNE_CONFIG_DIR")}
    env.update(OP=op, ANCHOR="sdpa_flash", BASELINES="sdpa_flash", TRIALS="1", ROUNDS="1",
               TUNE_ARGS="--interpret", HOME=str(tmp_path), XDG_CACHE_HOME=str(tmp_path),
               PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}")
    if case == "fwd":
        env["CHECK_DB"] = str(tmp_path / "keep" / "check.db")
    proc = subprocess.run(["bash", str(ROOT / "benchmarks" / "ship_check.sh"),
                           str(tmp_path / "out"), str(plan), "tiny", "120"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900, check=False)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    assert "0 active drivers" not in output, output[-4000:]
    near = json.loads((tmp_path / "out" / "ship_nearest_tiny.json").read_text())
    assert near["rows"][0]["source"] == "default"  # no database, no table for this device
    assert "median_ms" in near["rows"][0]["flashtune"], near["rows"][0]
    check = json.loads((tmp_path / "out" / "ship_check_tiny.json").read_text())
    assert (check["op"], check["anchor"]) == (op, "sdpa_flash")
    (row,) = check["rows"]
    assert (row["label"], row["anchor"]) == (label, row_anchor)
    # SDPA was timed beside it where it serves the shape (a causal step of one query runs
    # SDPA unmasked: bottom-right)
    assert ("median_ms" in near["rows"][0]["sdpa_flash"]) == (row_anchor == "sdpa_flash")
    assert row["nearest_source"] == "default" and row["exact"]
    ratio = row["nearest_over_anchor"] / row["exact_over_anchor"]
    assert math.isclose(row["nearest_over_exact"], ratio)
    assert row["held_out"] and check["held_out"] == 1  # a shape no shipped table holds
    assert "1 held-out shapes tuned exactly: nearest/exact time geomean" in proc.stdout
    assert "0 shipped shape(s) as controls" in proc.stdout
    # CHECK_DB (the forward case): the exact tuning's database is kept where it says, so a
    # second command on a warm device machine goes on from it
    assert (tmp_path / "keep" / "check.db").is_file() == (case == "fwd")

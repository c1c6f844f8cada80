"""``flashtune.report.headroom``: the ceilings a perfect tuner reaches, on sweeps built so
the answer is known by hand."""

from __future__ import annotations

import json
import math

import pytest

from flashtune.report import headroom


def cfg(bm: int, nreg: int = 0, reverse: int = 0) -> dict:
    return {"BLOCK_M": bm, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3, "MAXNREG": nreg,
            "REVERSE_M": reverse}


def row(causal: bool, times: dict[int, float], extra: list[dict] = ()) -> dict:
    reverse = int(causal)
    trials = [{"config": cfg(bm, reverse=reverse), "state": "COMPLETE", "median_ms": ms}
              for bm, ms in times.items()]
    problem = {"batch": 1, "heads_q": 2, "heads_kv": 2, "seqlen_q": 256, "seqlen_k": 256,
               "head_dim": 64, "causal": causal, "dtype": "bf16"}
    return {"problem": problem, "picks": {"default": cfg(32, reverse=reverse)},
            "trials": trials + list(extra)}


def sweep() -> list[dict]:
    # shape A: default (32) 1.0, 64 -> 0.8, 128 -> 0.9; shape B (causal): 1.0, 1.2, 0.9.
    # Faster trials that must not count: a failed one, and one outside --fix.
    failed = {"config": cfg(16), "state": "RUNTIME_ERROR", "median_ms": 0.1}
    capped = {"config": cfg(64, nreg=128, reverse=1), "state": "COMPLETE", "median_ms": 0.2}
    return [row(False, {32: 1.0, 64: 0.8, 128: 0.9}, [failed]),
            row(True, {32: 1.0, 64: 1.2, 128: 0.9}, [capped])]


def test_ceilings_match_the_hand_computed_answer():
    rep = headroom.headroom(sweep(), {"MAXNREG": 0}, ["BLOCK_M", "BLOCK_N", "num_warps",
                                                     "num_stages"])
    a, b = rep["shapes"]
    assert a["optimum_vs_default"] == pytest.approx(1.25)
    assert b["optimum_vs_default"] == pytest.approx(1 / 0.9)
    assert rep["ceiling_vs_default"] == pytest.approx(math.sqrt(1.25 / 0.9))
    assert rep["ceiling_vs_default_max"] == pytest.approx(1.25)
    # slowdowns against each optimum: 32 -> (1.25, 1.11), 64 -> (1, 1.33), 128 -> (1.125, 1)
    # the same BLOCK_M on both shapes is one single config although REVERSE_M differs
    assert rep["best_single"] == {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 4,
                                  "num_stages": 3}
    assert rep["ceiling_vs_single"] == pytest.approx(math.sqrt(1.125))
    assert rep["configs_on_every_shape"] == 3
    assert a["optimum"]["BLOCK_M"] == 64 and b["optimum"]["BLOCK_M"] == 128


def test_without_fix_the_capped_config_is_the_causal_optimum():
    rep = headroom.headroom(sweep(), {}, ["BLOCK_M"])
    assert rep["shapes"][1]["optimum_vs_default"] == pytest.approx(5.0)
    assert rep["shapes"][1]["optimum"]["MAXNREG"] == 128


def test_errors_name_the_shape_and_what_is_missing():
    rows = sweep()
    rows[0]["picks"]["default"] = cfg(256)
    with pytest.raises(ValueError, match="d64 n256 b1 h2/2: the default config"):
        headroom.headroom(rows, {}, ["BLOCK_M"])
    with pytest.raises(ValueError, match="no COMPLETE trial matches"):
        headroom.headroom(sweep(), {"MAXNREG": 7}, ["BLOCK_M"])
    rows = sweep()
    rows[1]["trials"] = [t for t in rows[1]["trials"] if t["config"]["BLOCK_M"] != 128]
    rows[0]["trials"] = [t for t in rows[0]["trials"] if t["config"]["BLOCK_M"] != 64]
    rows[1]["trials"].append({"config": cfg(256, reverse=1), "state": "COMPLETE",
                              "median_ms": 0.5})
    rep = headroom.headroom(rows, {"MAXNREG": 0}, ["BLOCK_M"])  # only 32 is on both
    assert rep["best_single"] == {"BLOCK_M": 32}
    with pytest.raises(ValueError, match="no shapes"):
        headroom.headroom([], {}, ["BLOCK_M"])
    with pytest.raises(ValueError, match="MAXNREG's value must be an integer"):
        headroom.parse_fix("MAXNREG=x")
    with pytest.raises(ValueError, match="expected KNOB=INT"):
        headroom.parse_fix("MAXNREG")


def test_command_line_writes_the_report_and_fails_cleanly(tmp_path, capsys):
    path = tmp_path / "sweep.json"
    path.write_text(json.dumps({"rows": sweep()}))
    tuned = tmp_path / "tuned.json"
    tuned.write_text(json.dumps({"summary": {"tuned_vs_default": 1.1, "best_single": {
        "rows": [{"tuned": 2.0, "best_single": 1.0}, {"tuned": 2.0, "best_single": 2.0}]}}}))
    out = tmp_path / "report.json"
    assert headroom.main([str(path), "--fix", "MAXNREG=0", "--tuned", str(tuned),
                          "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["tuned"] == {"tuned_vs_default": 1.1,
                               "tuned_vs_single": pytest.approx(math.sqrt(2))}
    printed = capsys.readouterr().out
    assert "ceiling, tuned vs default: 1.179x" in printed
    assert headroom.main([str(path), "--fix", "MAXNREG"]) == 2
    assert "--fix: expected KNOB=INT" in capsys.readouterr().err
    assert headroom.main([str(tmp_path / "missing.json")]) == 2

"""``benchmarks/sustained_load.py`` without a GPU: how a sustained run's chunks and clock
samples become its cool and hot figures, the grid it walks, and the JSON it writes."""

from __future__ import annotations

import json
import math
from types import ModuleType

from tests.helpers import load_benchmark


def _load() -> ModuleType:
    return load_benchmark("sustained_load")


def test_cool_is_the_fastest_early_chunk_and_hot_the_last_quarters_median() -> None:
    m = _load()
    # (end time s, ms per call): fast before the power cap's controller acts, then slower
    chunks = [(0.05, 2.0), (0.15, 1.5), (0.45, 1.8), (0.9, 2.2), (3.1, 2.2), (3.5, 2.4),
              (3.9, 2.3)]
    # (time, SM MHz, W, C, throttle mask): 0x4 is the software power cap
    samples = [(0.2, 1980.0, 500.0, 40.0, 0), (3.2, 1700.0, 690.0, 60.0, 4),
               (3.6, 1680.0, 700.0, 62.0, 4)]
    got = m.summarise(chunks, samples, 0.0, 4.0)
    assert got["cool_ms"] == 1.5  # the fastest chunk ending in the first half second
    assert got["hot_ms"] == 2.3  # the median of the chunks ending at 3 s or later
    assert math.isclose(got["hot_over_cool"], 2.3 / 1.5)
    assert got["hot_clock_mhz"] == 1690.0 and got["hot_power_w"] == 695.0
    assert got["hot_temp_c"] == 62.0 and got["cool_clock_mhz"] == 1980.0
    assert math.isclose(got["energy_mj_per_call"], 695.0 * 2.3)
    assert got["throttle_reasons"] == ["sw_power_cap"]
    # no sampler: times only
    assert "hot_power_w" not in m.summarise(chunks, [], 0.0, 4.0)


def test_throttle_masks_name_their_reasons() -> None:
    m = _load()
    assert m.reason_names(0) == []
    assert m.reason_names(0x4 | 0x20) == ["sw_power_cap", "sw_thermal"]


def test_the_grid_and_explicit_shapes() -> None:
    m = _load()
    grid = m._shapes("grid")
    assert len(grid) == 24 and len(set(grid)) == 24
    assert (512, 64, False) in grid and (16384, 128, True) in grid
    assert m._shapes("4096:128:1,512:64:0") == [(4096, 128, True), (512, 64, False)]


def test_the_summary_is_a_geomean_of_flashtunes_ratios_per_mode() -> None:
    m = _load()
    rows = [{"what": "train", "contenders": {"flashtune": {"vs_cudnn_cool": 0.9,
                                                           "vs_cudnn_hot": 1.0}}},
            {"what": "train", "contenders": {"flashtune": {"vs_cudnn_cool": 1.0,
                                                           "vs_cudnn_hot": 1.1}}},
            {"what": "fwd", "contenders": {"flashtune": {"error": 1.0,
                                                         "skipped": "failed the check"}}}]
    got = m._summary(rows)
    assert set(got) == {"train"}  # a mode with nothing timed has no figure
    assert math.isclose(got["train"]["cool"], math.sqrt(0.9))
    assert math.isclose(got["train"]["hot"], math.sqrt(1.1))
    assert got["train"]["shapes"] == 2


def test_series_are_written_one_line_each_and_read_back_unchanged() -> None:
    m = _load()
    doc = {"chunk_ms": [[0.02, 0.1311], [0.04, 0.1302]], "reasons": ["a, b", "c"],
           "empty": [], "nested": {"samples": [[0.1, 1980.0, 130.5, 35.0, 0]]}}
    text = m.compact_json(doc)
    assert json.loads(text) == doc
    assert "[0.02, 0.1311]" in text and "[0.1, 1980.0, 130.5, 35.0, 0]" in text
    assert '"a, b"' in text  # lists of strings are left as they are


def test_the_tuners_timing_rotates_the_timed_contenders_and_keeps_the_median(
        monkeypatch) -> None:
    from flashtune.autotune import timing

    m = _load()
    order: list[str] = []
    figures = {"a": iter([3.0, 1.0, 2.0]), "b": iter([5.0, 4.0, 6.0])}

    def fake_bench(fn, *, rep_ms):  # noqa: ANN001, ANN202 - timing.bench's stand-in
        name = fn()
        order.append(name)
        return timing.Timing(next(figures[name]), 0.0, 0.0)

    monkeypatch.setattr(timing, "bench", fake_bench)
    results = {"a": {"cool_ms": 1.0}, "b": {"cool_ms": 2.0}, "c": {"skipped": "failed"}}
    m.tuner_timing({"a": lambda: "a", "b": lambda: "b", "c": lambda: "c"}, results, 3)
    assert order == ["a", "b"] * 3  # round-robin; a contender that was not timed is not
    assert results["a"]["tuner_ms"] == 2.0 and results["b"]["tuner_ms"] == 5.0
    assert results["a"]["tuner_rounds_ms"] == [3.0, 1.0, 2.0]
    assert "tuner_ms" not in results["c"]


def test_a_config_takes_a_kernel_file_or_not() -> None:
    m = _load()
    assert m.parse_config('big={"BLOCK_N": 128}') == ("big", "", {"BLOCK_N": 128})
    assert m.parse_config("lookup={}") == ("lookup", "", {})
    assert m.parse_config('poly=v/fwd_exp.py|{"64": {"ROWS": 64}}') == (
        "poly", "v/fwd_exp.py", {"64": {"ROWS": 64}})
    assert m.parse_config("same=fwd_exp.py|") == ("same", "fwd_exp.py", {})
    for bad in ("noequals", "x=[1]", "1x={}"):
        try:
            m.parse_config(bad)
        except ValueError as exc:
            assert "--variant" in str(exc) or "JSON" in str(exc)
        else:
            raise AssertionError(f"{bad!r} accepted")

"""``benchmarks/explore_bwd_ablation.py`` and ``explore_fwd_ablation.py`` without a GPU: each
variant's text patches must still match the library kernel's text (a kernel edit that moves
one would otherwise fail only on the device), and a ``--kernel`` file is written beside the
variants as it is."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import load_benchmark as _load


@pytest.mark.parametrize("script", ["explore_bwd_ablation", "explore_fwd_ablation"])
def test_every_variants_patches_match_the_kernel_once(script: str) -> None:
    patch = _load("explore_bwd_ablation").variant_source  # the forward's script's too
    module = _load(script)
    text = module.KERNEL.read_text()
    for name, names in module.VARIANTS.items():
        assert (patch(module.KERNEL, module.PATCHES, names) == text) == (not names), name


def test_other_kernel_files_are_written_as_variants_of_their_own(tmp_path: Path) -> None:
    module = _load("explore_bwd_ablation")
    before = tmp_path / "old_kernel.py"
    before.write_text("# another revision's kernel\n")
    out = tmp_path / "mods"
    out.mkdir()
    module.write_modules(out, variants={"base": ()}, kernels={"before": before})
    assert sorted(p.name for p in out.iterdir()) == ["bwd_ablation_base.py",
                                                      "bwd_ablation_before.py"]
    assert (out / "bwd_ablation_before.py").read_text() == before.read_text()
    assert (out / "bwd_ablation_base.py").read_text() == module.KERNEL.read_text()


def test_a_timeline_splits_a_launch_into_busy_time_tail_and_gaps() -> None:
    stats = _load("explore_bwd_ablation").timeline_stats
    # two SMs: SM 0 runs CTAs of 2 and 4 steps back to back with a 1 us gap, SM 1 one CTA
    # of 6 steps and idles 2 us at the end; each CTA costs 1 us plus 1 us a step
    records = [[0, 3000, 0, 2], [4000, 9000, 0, 4], [0, 7000, 1, 6]]
    got = stats(records)
    assert got["ctas"] == 3 and got["sms"] == 2 and got["span_us"] == 9.0
    assert got["busy_share"] == pytest.approx(15 / 18)
    assert got["tail_us"] == pytest.approx(1.0) and got["head_us"] == 0.0
    assert got["gap_us"] == pytest.approx(1.0)
    assert got["fixed_us"] == pytest.approx(1.0) and got["per_step_us"] == pytest.approx(1.0)
    # every CTA walks as many steps: no line through them
    assert stats([[0, 5, 0, 3], [5, 10, 0, 3]])["per_step_us"] is None
    with pytest.raises(ValueError, match="ends before it starts"):
        stats([[10, 5, 0, 1]])


def test_a_variant_names_its_kernel_file_and_config_updates() -> None:
    module = _load("explore_fwd_ablation")
    name, path, updates = module.parse_variant('chain=/tmp/k.py|{"128": {"PERSISTENT": 1}}')
    assert (name, path, updates) == ("chain", "/tmp/k.py", {"128": {"PERSISTENT": 1}})
    assert module.parse_variant('twin=|{"LPT": 1}') == ("twin", "", {"LPT": 1})
    lookup = {"ROWS": 64, "PERSISTENT": 0, "LPT": 0}
    # updates keyed by head dim apply to their head dim only; plain ones to every shape
    assert module.variant_config(lookup, updates, 128) == {**lookup, "PERSISTENT": 1}
    assert module.variant_config(lookup, updates, 64) == lookup
    assert module.variant_config(lookup, {"LPT": "1"}, 64) == {**lookup, "LPT": 1}
    for bad in ("chain", "chain=k.py", "2x=|{}", 'x=|[1]'):
        with pytest.raises(ValueError, match="--variant"):
            module.parse_variant(bad)

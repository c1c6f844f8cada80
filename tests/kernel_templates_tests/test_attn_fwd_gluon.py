"""attn_fwd_gluon as a registered implementation of ``fwd``: its spec and limits, its space
and the sm_90 compile table behind its predicate (CPU), the compile-only launch, and (GPU,
sm_90) its numerics through the spec's launcher and every valid config of the space.

Gluon has no interpreter mode: on the CPU the kernel is only compiled
(``test_gluon_fwd_compile.py`` and the table checks here); ``FLASHTUNE_TEST_DEVICE=cuda`` on
a Hopper runs the rest.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flashtune.core.device import DeviceFingerprint, interpreter_device
from flashtune.core.errors import ConfigError, DeviceError, InputError, InputTypeError
from flashtune.core.problem import AttentionProblem
from flashtune.kernel_templates import get_template, implementations
from flashtune.kernel_templates.attn_fwd.reference import attn_fwd_reference
from flashtune.kernel_templates.attn_fwd_gluon import space
from flashtune.kernel_templates.attn_fwd_gluon.prefilter import cases
from flashtune.kernel_templates.registry import source_hash
from tests.helpers import assert_close_to_reference

ROOT = Path(__file__).resolve().parents[2]
FOLDER = ROOT / "flashtune" / "kernel_templates" / "attn_fwd_gluon"
SPEC = get_template("attn_fwd_gluon")
H100 = DeviceFingerprint("NVIDIA_H100_80GB_HBM3", "9.0", 132, 232448, 85 * 2**30)
A100 = DeviceFingerprint("NVIDIA_A100_SXM4_80GB", "8.0", 108, 166912, 85 * 2**30)


def _problem(d: int = 128, causal: bool = False, dtype: str = "bf16", *, hq: int = 8,
             hkv: int = 8, nq: int = 1000, nk: int = 1000) -> AttentionProblem:
    return AttentionProblem(2, hq, hkv, nq, nk, d, causal, dtype)


def _config(**knobs: int) -> dict[str, int]:
    return {"ROWS": 64, "BLOCK_N": 128, "NUM_STAGES": 2, "NUM_CONSUMERS": 2, "PINGPONG": 0,
            "PERSISTENT": 0, "LPT": 0, "TMA_STORE": 0, "Q_BUFFERS": 1, "SPLIT_KV": 0,
            "CTAS_PER_SM": 1, **knobs}


def _entry(compiled: space.Compiled, config: dict[str, int], **problem: object) -> dict:
    doc = {"head_dim": 128, "dtype": "bf16", "causal": False, "config": config,
           "shared": compiled.shared, "registers": compiled.registers,
           "spill_bytes": compiled.spill_bytes, "error": compiled.error}
    doc.update(problem)
    return doc


# -- the spec and its limits -------------------------------------------------------------------

def test_it_is_registered_as_a_gluon_implementation_of_fwd() -> None:
    assert SPEC.name == "attn_fwd_gluon" and SPEC.op == "fwd" and SPEC.kind == "gluon"
    assert SPEC.serves == ("fwd", "train") and SPEC.tunable
    assert SPEC.backward == "attn_bwd"  # its LSE is attn_bwd's input: a training pair
    assert SPEC in implementations("fwd") and SPEC not in implementations("decode")
    assert SPEC.reference is attn_fwd_reference
    assert SPEC.source_hash == source_hash(FOLDER / "kernel.py", FOLDER / "launcher.py")
    assert SPEC.warmup_launches is not None
    # importing it (attn_fwd's reference included) moves no other template's hash
    assert get_template("attn_fwd").source_hash == "96002eea06a4d9b3"


def test_its_limits_refuse_what_it_cannot_serve() -> None:
    assert "needs a CUDA GPU" in SPEC.refuse(_problem(), interpreter_device())
    assert "sm_90" in SPEC.refuse(_problem(), A100)
    assert "head_dim 96" in SPEC.refuse(_problem(96), H100)
    for d in (64, 128, 256):
        for dtype in ("fp16", "bf16"):
            # GQA, causal with Nq != Nk (bottom-right, as attn_fwd), the LSE
            p = _problem(d, True, dtype, hq=8, hkv=2, nq=333, nk=517)
            assert SPEC.refuse(p, H100, return_lse=True) is None


@pytest.mark.skipif(os.environ.get("FLASHTUNE_TEST_DEVICE", "cpu") != "cpu",
                    reason="the interpreter's refusal; a GPU run has no interpreter")
def test_tune_refuses_it_under_the_interpreter_up_front() -> None:
    from flashtune.autotune.options import check_tunable

    assert os.environ.get("TRITON_INTERPRET") == "1"  # tests/conftest.py on the CPU
    with pytest.raises(ConfigError, match="'attn_fwd_gluon' .gluon. needs a CUDA GPU"):
        check_tunable([_problem()], "attn_fwd_gluon", custom_runner=False)
    check_tunable([_problem()], "attn_fwd_gluon", custom_runner=True)  # a replay, say
    check_tunable([_problem()], "attn_fwd", custom_runner=False)


def test_the_launcher_refuses_what_it_cannot_serve_by_name() -> None:
    def t(*shape: int, dtype: torch.dtype = torch.float16) -> torch.Tensor:
        return torch.zeros(shape, dtype=dtype)

    q, k = t(1, 2, 16, 128), t(1, 2, 16, 128)
    with pytest.raises(InputError, match=r"head_dim must be one of \[64, 128, 256\].*got 96"):
        SPEC.launcher(t(1, 2, 16, 96), t(1, 2, 16, 96), t(1, 2, 16, 96), _config())
    with pytest.raises(InputTypeError, match="fp16 or bf16"):
        f32 = t(1, 2, 16, 128, dtype=torch.float32)
        SPEC.launcher(f32, f32, f32, _config())
    with pytest.raises(InputError, match="multiple of heads_kv"):
        SPEC.launcher(t(1, 3, 16, 128), k, k, _config())
    bad_knobs = [  # (config, what the error says)
        (_config(NUM_CONSUMERS=1, PINGPONG=1), "PINGPONG needs 2"),
        (_config(NUM_CONSUMERS=4), "NUM_CONSUMERS must be 1, 2 or 3"),
        (_config(PERSISTENT=2), "PERSISTENT must be 0 or 1"),
        (_config(LPT=1), "LPT must be 0 or 1, and 1 orders a PERSISTENT"),
        (_config(PERSISTENT=1, LPT=2), "LPT must be 0 or 1"),
        (_config(TMA_STORE=2), "TMA_STORE must be 0 or 1"),
        (_config(PERSISTENT=1, Q_BUFFERS=3), "Q_BUFFERS must be 1 or 2"),
        (_config(Q_BUFFERS=2), "2 alternates a PERSISTENT CTA's tiles"),
        (_config(SPLIT_KV=2), "SPLIT_KV must be 0 or 1"),
        (_config(NUM_CONSUMERS=1, CTAS_PER_SM=3), "CTAS_PER_SM must be 1 or 2"),
        (_config(CTAS_PER_SM=2), "2 halves the registers of a one-consumer CTA"),
    ]
    for config, says in bad_knobs:
        with pytest.raises(ConfigError, match=says):
            SPEC.launcher(q, k, k, config)
    with pytest.raises(ConfigError, match="missing \\['PERSISTENT'\\]"):
        SPEC.launcher(q, k, k, {n: v for n, v in _config().items() if n != "PERSISTENT"})
    with pytest.raises(ConfigError, match="unknown \\['BLOCK_M'\\]"):
        SPEC.launcher(q, k, k, {**_config(), "BLOCK_M": 64})
    with pytest.raises(DeviceError, match="no interpreter mode"):
        SPEC.launcher(q, k, k, _config())


# -- the space and its predicate -----------------------------------------------------------------

@pytest.mark.parametrize("d", [64, 128, 256])
def test_the_default_config_is_valid_for_every_problem_it_serves(d: int) -> None:
    for causal in (False, True):
        for dtype in ("fp16", "bf16"):
            for p in (_problem(d, causal, dtype), _problem(d, causal, dtype, hq=8, hkv=1,
                                                           nq=77, nk=1000)):
                config = SPEC.default_config(p, H100)
                assert SPEC.space.validate(config) == config
                assert SPEC.space.check(config, p, H100) is None, config
                assert SPEC.space.check(config, p, interpreter_device()) is None


@pytest.mark.parametrize("d,causal,tma_store", [
    (64, False, 1), (64, True, 1), (128, False, 1), (128, True, 1), (256, False, 0),
    (256, True, 0)])
def test_the_default_stores_by_tma_where_the_h100_measured_it_faster(d, causal,
                                                                    tma_store) -> None:
    """explore_fwd_gluon_tma_h100.json: TMA_STORE 1 won at D128 and at D64 causal, not at D64
    without a mask with one Q buffer; with two (the overlapped default there,
    gluon_tile_cost_splitkv_h100.json) it did; D256 was not timed."""
    p = _problem(d, causal)
    config = SPEC.default_config(p, H100)
    assert config["TMA_STORE"] == tma_store
    assert SPEC.space.check(config, p, H100) is None


def test_the_predicate_rejects_spills_shared_memory_and_compile_errors_with_a_reason() -> None:
    table = space.load_table()
    p = _problem(128)
    spills = [c for c in SPEC.space if (space.structural_reason(c) is None and not c["LPT"]
              and (table[space.entry_key(128, "bf16", False, c)].spill_bytes or 0)
              > space.SPILL_LIMIT)]
    assert spills, "the space holds no spilling config at D128: the test needs another"
    assert "spills" in SPEC.space.check(spills[0], p, H100)
    # a few hoisted predicates stored once (the persistent loop's) pass; more do not
    assert space.Compiled(1024, 240, space.SPILL_LIMIT).reason() is None
    assert "at most 256 B allowed" in space.Compiled(1024, 240, space.SPILL_LIMIT + 4).reason()
    # 4 stages of 128-key K and V tiles at D128: 256 KiB
    big = _config(BLOCK_N=128, NUM_STAGES=4)
    assert "shared memory" in SPEC.space.check(big, p, H100)
    # a device that allows less than the compiled kernel needs
    small = DeviceFingerprint("small", "9.0", 132, 64 * 1024, 0)
    assert "an sm_90 block may use 65536 B" in SPEC.space.check(_config(), p, small)
    assert "PINGPONG" in SPEC.space.check(_config(NUM_CONSUMERS=1, PINGPONG=1), p, H100)
    assert "head_dim 96" in SPEC.space.check(_config(), _problem(96), H100)
    broken = space.Compiled(None, None, None, "CompilationError: out of resources")
    assert broken.reason().startswith("does not compile for sm_90a: CompilationError")


def test_the_space_has_room_to_search_at_both_head_dims() -> None:
    for d in (64, 128):
        for causal in (False, True):
            valid = SPEC.space.valid_configs(_problem(d, causal), H100)
            assert len(valid) >= 8, (d, causal, valid)
            assert any(c["PINGPONG"] for c in valid) and any(c["NUM_CONSUMERS"] == 1
                                                             for c in valid)
            # the persistent kernel of the default tiles and of ping-pong is searchable
            assert _config(PERSISTENT=1) in valid and _config(PERSISTENT=1, PINGPONG=1) in valid
            # and the TMA-store epilogue, grid-launched and persistent
            assert _config(TMA_STORE=1) in valid and _config(PERSISTENT=1, TMA_STORE=1) in valid
            # FA3's 192-row tile: three consumers of 64 rows over 64-key tiles, and over
            # 128-key tiles at D64 (P converted early: no spill), not at D128 (spills)
            assert _config(NUM_CONSUMERS=3, BLOCK_N=64) in valid
            assert _config(NUM_CONSUMERS=3, BLOCK_N=64, PERSISTENT=1) in valid
            assert (_config(NUM_CONSUMERS=3, BLOCK_N=128) in valid) == (d == 64)
            assert (_config(NUM_CONSUMERS=3, BLOCK_N=128, NUM_STAGES=3, TMA_STORE=1)
                    in valid) == (d == 64)
    for causal in (False, True):  # D256 (Gemma-2): two stages of 64-key tiles fit, not more
        valid = SPEC.space.valid_configs(_problem(256, causal), H100)
        assert _config(BLOCK_N=64) in valid and _config(BLOCK_N=64, PERSISTENT=1) in valid
        assert not any(c["BLOCK_N"] == 128 and c["NUM_CONSUMERS"] > 1 for c in valid)
        assert SPEC.default_config(_problem(256, causal), H100)["BLOCK_N"] == 64


# -- the sm_90 compile table ---------------------------------------------------------------------

def test_the_table_holds_every_point_of_the_space_and_the_current_source() -> None:
    doc = json.loads(space.TABLE.read_text())
    assert doc["source_hash"] == SPEC.source_hash, (
        f"sm90_compile.json is stale: regenerate it with {space.REGENERATE}")
    table = space.load_table()
    want = {space.entry_key(c["head_dim"], c["dtype"], c["causal"], c["config"])
            for c in cases()}
    # without the knobs Q_BUFFERS and SPLIT_KV: 192 LPT-0 configs (x 3 D x 2 dtypes x
    # causal) and 96 persistent ones with LPT 1 (causal only), half of each with TMA_STORE 1;
    # the new knobs on the ROWS 64 half: SPLIT_KV 1 (96 and 48 more) and two Q buffers
    # (persistent: 48 and 48, each at both SPLIT_KV); CTAS_PER_SM 2 on the one-consumer
    # ROWS 64 configs at D64 and D128 (x 2 dtypes): 24 grid-launched and 48 persistent, and
    # 48 more with LPT 1 causal
    assert len(want) == (192 + 96 + 2 * 48) * 12 + (96 + 48 + 2 * 48) * 6 \
        + (24 + 48 + 24 + 48 + 48) * 4 == 6816
    assert want == set(table), (sorted(want - set(table))[:3], sorted(set(table) - want)[:3])


def test_the_table_is_checked_when_read(tmp_path: Path) -> None:
    ok = space.Compiled(1024, 168, 0)
    good = {"format": space.TABLE_FORMAT, "entries": [_entry(ok, _config())]}
    assert space.parse_table(good) == {space.entry_key(128, "bf16", False, _config()): ok}
    bad_docs = {
        "format": {"format": 99, "entries": []},
        "keys": {"format": 1, "entries": [{"head_dim": 128}]},
        "config": {"format": 1, "entries": [_entry(ok, {"ROWS": 64})]},
        "a bool for an int": {"format": 1, "entries": [_entry(ok, _config(), head_dim=True)]},
        "figures": {"format": 1, "entries": [_entry(space.Compiled(None, 1, 0), _config())]},
        "twice": {"format": 1, "entries": [_entry(ok, _config()), _entry(ok, _config())]},
    }
    for what, doc in bad_docs.items():
        with pytest.raises(ValueError, match="table"):
            space.parse_table(doc)
            pytest.fail(what)
    path = tmp_path / "sm90_compile.json"
    path.write_text(json.dumps(bad_docs["twice"]))
    with pytest.raises(ValueError, match="appears twice"):
        space.load_table(path)


def _recompile(entries: list[dict]) -> list[dict]:
    # in a process of its own: this one runs triton under the interpreter
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    cases_arg = [dict(e["config"], head_dim=e["head_dim"], causal=e["causal"],
                      dtype=e["dtype"]) for e in entries]
    proc = subprocess.run([sys.executable, "-m", "flashtune.kernel_templates.attn_fwd_gluon",
                           json.dumps(cases_arg)], capture_output=True, check=False, text=True,
                          env=env, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


@pytest.mark.slow
def test_recompiling_agrees_with_the_table() -> None:
    """The default config at D64 causal fp16, a spilling config at D128, the persistent
    default tiles with LPT at D128 causal, with the TMA store at D256 and with two Q
    buffers at D128: the compiler's figures now are the table's."""
    doc = json.loads(space.TABLE.read_text())
    entries = doc["entries"]
    default = next(e for e in entries if e["config"] == _config() and e["head_dim"] == 64
                   and e["causal"] and e["dtype"] == "fp16")
    spilling = next(e for e in entries if e["spill_bytes"] and e["head_dim"] == 128)
    lpt = next(e for e in entries if e["config"] == _config(PERSISTENT=1, LPT=1)
               and e["head_dim"] == 128 and e["causal"] and e["dtype"] == "bf16")
    tma = next(e for e in entries if e["config"] == _config(PERSISTENT=1, TMA_STORE=1,
                                                            BLOCK_N=64)
               and e["head_dim"] == 256 and not e["causal"] and e["dtype"] == "bf16")
    two_q = next(e for e in entries if e["config"] == _config(PERSISTENT=1, PINGPONG=1,
                                                              TMA_STORE=1, Q_BUFFERS=2)
                 and e["head_dim"] == 128 and not e["causal"] and e["dtype"] == "bf16")
    picked = [default, spilling, lpt, tma, two_q]
    for want, got in zip(picked, _recompile(picked), strict=True):
        assert (got["shared"], max(got["registers"]), sum(got["spill_store_bytes"])) == \
            (want["shared"], want["registers"], want["spill_bytes"]), (want, got)


# -- the compile-only launch -----------------------------------------------------------------------

def test_the_warmup_launch_specializes_as_the_launch_does() -> None:
    """``warmup_launches`` builds from shapes alone what the launcher builds from tensors
    (contiguous, aligned): the same kernel signature, constants and grid, so a precompiled
    kernel is the one the launch looks up."""
    from triton.runtime.jit import mangle_type

    from flashtune.kernel_templates.attn_fwd_gluon.launcher import kernel_args

    p = _problem(64, True, "fp16", hq=6, hkv=2, nq=333, nk=517)
    config = _config(ROWS=64, BLOCK_N=64, NUM_STAGES=3)
    [(kernel, args, kwargs, grid)] = SPEC.warmup_launches(p, config)
    assert kernel is SPEC.kernel
    q = torch.zeros(2, 6, 333, 64, dtype=torch.float16)
    k = torch.zeros(2, 2, 517, 64, dtype=torch.float16)
    lse = torch.zeros(2, 6, 333)
    want_args, want_kwargs, want_grid = kernel_args(q, k, k, torch.zeros_like(q), lse, config,
                                                    causal=True, scale=64 ** -0.5)
    assert [mangle_type(a, True) for a in args] == [mangle_type(a, True) for a in want_args]
    assert args[5:] == want_args[5:]  # the scalars
    assert (kwargs, grid) == (want_kwargs, want_grid) and grid == (3, 12)


def test_a_persistent_launch_plans_a_cta_per_sm_or_per_tile() -> None:
    """``PERSISTENT`` launches ``min(tiles, SMs)`` CTAs on one grid axis (the planning SM
    count for shape-only stand-ins), with the tile count's inputs among the arguments; the
    grid-launched kernel keeps its (query blocks, batch x heads) grid."""
    from flashtune.kernel_templates.attn_fwd_gluon.launcher import PLANNING_SMS, kernel_args

    def plan(nq: int, persistent: int) -> tuple:
        q = torch.zeros(2, 6, nq, 64, dtype=torch.float16)
        k = torch.zeros(2, 2, 517, 64, dtype=torch.float16)
        args, kwargs, grid = kernel_args(q, k, k, torch.zeros_like(q), torch.zeros(2, 6, nq),
                                         _config(PERSISTENT=persistent), causal=True,
                                         scale=0.125)
        return args, kwargs, grid

    args, kwargs, grid = plan(333, 1)
    assert grid == (3 * 12, 1) and kwargs["PERSISTENT"] is True  # 36 tiles: a CTA each
    assert args[5:10] == (333, 517, 6, 3, 12)  # seqlen_q, seqlen_k, heads_q, group, B x Hq
    assert plan(4000, 1)[2] == (PLANNING_SMS, 1)  # 32 x 12 tiles: a CTA per SM
    assert plan(4000, 0)[2] == (32, 12)
    p = _problem(64, True, "fp16", hq=6, hkv=2, nq=4000, nk=517)
    assert SPEC.warmup_launches(p, _config(PERSISTENT=1))[0][3] == (PLANNING_SMS, 1)


# -- LPT: a persistent causal launch's tiles longest first ----------------------------------

def _lpt_coords(t: int, n_mblocks: int, batch_heads: int, section: int) -> tuple[int, int]:
    """The kernel's ``_coords`` with ``LPT`` (``kernel.py``), in Python: tile ``t``'s
    ``(bh, m_block)``."""
    per = section * n_mblocks
    s, r = divmod(t, per)
    heads = min(section, batch_heads - s * section)
    return s * section + r % heads, n_mblocks - 1 - r // heads


def _head_major(t: int, n_mblocks: int, batch_heads: int, section: int) -> tuple[int, int]:
    """``_coords`` without ``LPT``, causal."""
    bh, m = divmod(t, n_mblocks)
    return bh, n_mblocks - 1 - m


def test_lpt_sections_hold_whole_kv_groups_that_share_or_fit_l2_in_whole_rounds() -> None:
    from flashtune.kernel_templates.attn_fwd_gluon.launcher import L2_BUDGET, lpt_section

    assert L2_BUDGET == 40 << 20
    # N 512, D 128: a KV head's K and V take 256 KiB, 160 fit, rounded to whole rounds of
    # 132 CTAs over 4 query blocks (33 heads a round): 132; a batch of 100 heads: one section
    assert lpt_section(512, 1, 512, 128, 4, 132) == 132
    assert lpt_section(100, 1, 512, 128, 4, 132) == 100
    # N 16k, D 128, GQA 4:1: 8 MiB a KV head, 5 fit, but 64 heads run side by side: one
    # section; 1024 heads: 132 (33 heads a round over 128 query blocks, whole groups)
    assert lpt_section(64, 4, 16384, 128, 128, 132) == 64
    assert lpt_section(1024, 4, 16384, 128, 128, 132) == 132
    # no whole round fits (a round is lcm(33, 8) = 264 heads): the most whole groups that do
    assert lpt_section(512, 8, 1 << 20, 256, 8192, 132) == 128


@pytest.mark.parametrize("b,hq,hkv,nq,lpt_worst,head_major_worst", [
    (32, 16, 16, 512, 1.04, 1.6),  # BERT-like: 4 query blocks, 132 SMs: 62 blocks vs 16
    (16, 16, 16, 1024, 1.04, 1.35),
    (8, 28, 4, 2048, 1.04, 1.2),
    (3, 12, 4, 1000, 1.43, 2.0),  # ragged: 288 tiles for 132 CTAs
    (1, 16, 16, 16384, 1.07, 1.55),  # 2048 tiles: a CTA's stride covers half the lengths
    (1, 64, 8, 16384, 1.02, 1.05),
])
def test_the_lpt_order_covers_every_tile_once_and_evens_out_the_ctas(
        b, hq, hkv, nq, lpt_worst, head_major_worst) -> None:
    """Every (head, query block) once, each section's heads consecutive; a CTA striding over
    the tiles (132 SMs) walks about the mean of key blocks (causal, 128-row tiles of
    128-key blocks): the head-major order gave one CTA tiles of one length only."""
    from flashtune.kernel_templates.attn_fwd_gluon.launcher import lpt_section

    n, bh = -(-nq // 128), b * hq
    tiles = n * bh
    ctas = min(132, tiles)
    section = lpt_section(bh, hq // hkv, nq, 128, n, ctas)
    order = [_lpt_coords(t, n, bh, section) for t in range(tiles)]
    assert sorted(order) == [(h, m) for h in range(bh) for m in range(n)]
    assert all(h // section == t // (section * n) for t, (h, _) in enumerate(order))

    def worst(coords) -> float:
        load = [0] * ctas
        for t in range(tiles):
            load[t % ctas] += coords(t, n, bh, section)[1] + 1  # key blocks of the tile
        return max(load) / (sum(load) / ctas)

    assert worst(_lpt_coords) <= lpt_worst < head_major_worst <= worst(_head_major)


def test_lpt_is_searched_for_persistent_causal_launches_only() -> None:
    causal, full = _problem(128, True), _problem(128, False)
    lpt = _config(PERSISTENT=1, LPT=1)
    assert SPEC.space.check(lpt, causal, H100) is None and lpt in \
        SPEC.space.valid_configs(causal, H100)
    assert "orders causal tiles" in SPEC.space.check(lpt, full, H100)
    assert "PERSISTENT 1" in SPEC.space.check(_config(LPT=1), causal, H100)
    # a config stored before LPT existed is valid and runs its 0
    old = {k: v for k, v in _config(PERSISTENT=1).items() if k != "LPT"}
    assert SPEC.space.validate(old) == _config(PERSISTENT=1)
    assert SPEC.default_config(causal, H100)["LPT"] == 0


def test_an_lpt_launch_passes_its_section_and_compiles_the_order() -> None:
    from flashtune.kernel_templates.attn_fwd_gluon.launcher import kernel_args, lpt_section

    q = torch.zeros(4, 16, 512, 128, dtype=torch.bfloat16)
    k = torch.zeros(4, 4, 512, 128, dtype=torch.bfloat16)

    def plan(config):
        return kernel_args(q, k, k, torch.zeros_like(q), torch.zeros(4, 16, 512), config,
                           causal=True, scale=0.125)

    args, kwargs, grid = plan(_config(PERSISTENT=1, LPT=1))
    assert args[-1] == lpt_section(64, 4, 512, 128, 4, 132) == 64 and kwargs["LPT"] is True
    args0, kwargs0, grid0 = plan(_config(PERSISTENT=1))
    assert args0[-1] == 1 and kwargs0["LPT"] is False and grid0 == grid == (132, 1)


def test_a_tma_store_launch_passes_a_descriptor_over_out_in_qs_view() -> None:
    """``TMA_STORE`` 1: an O descriptor of Q's block over ``out``'s 2-D view (the one Q is
    read through, ``(B * H * N, D)`` or ``(B * N, H * D)``); 0 (or left out, as in configs
    stored before it) passes none, which compiles the kernel stored before it."""
    from flashtune.kernel_templates.attn_fwd_gluon.launcher import kernel_args

    for q in (torch.zeros(2, 4, 300, 128, dtype=torch.bfloat16),
              torch.zeros(2, 300, 4, 128, dtype=torch.bfloat16).transpose(1, 2)):
        k = torch.zeros(2, 2, 300, 128, dtype=torch.bfloat16)
        out = torch.empty_like(q)

        def plan(config, q=q, k=k, out=out):
            return kernel_args(q, k, k, out, torch.zeros(2, 4, 300), config, causal=True,
                               scale=0.125)

        (q_desc, *_), kwargs, grid = plan(_config(TMA_STORE=1, PERSISTENT=1))
        o_desc = kwargs["o_desc"]
        assert kwargs["TMA_STORE"] is True and o_desc.base is out
        assert (o_desc.shape, o_desc.strides, o_desc.block_shape, o_desc.layout) == \
            (q_desc.shape, q_desc.strides, q_desc.block_shape, q_desc.layout)
        for config in (_config(), {n: v for n, v in _config().items() if n != "TMA_STORE"}):
            assert not {"o_desc", "TMA_STORE"} & set(plan(config)[1])


def test_two_q_buffers_are_searched_for_persistent_launches_where_they_fit() -> None:
    """``Q_BUFFERS`` 2 (a persistent CTA's tiles alternate between two sets of Q buffers):
    searched with ``PERSISTENT`` 1 and ``ROWS`` 64 only, its shared memory the table's, one
    more Q tile per consumer (16 KiB at D128 with 64 rows), so the D128 table config's 3
    stages of 128-key tiles no longer fit and 2 do; ``SPLIT_KV`` 1 adds a barrier per
    stage and no more; a config stored before the knobs runs one buffer, K and V released
    together."""
    d128 = _problem(128, False)
    two = _config(PERSISTENT=1, PINGPONG=1, TMA_STORE=1, Q_BUFFERS=2)
    assert SPEC.space.check(two, d128, H100) is None
    assert two in SPEC.space.valid_configs(d128, H100)
    assert "PERSISTENT 1" in SPEC.space.check(_config(Q_BUFFERS=2), d128, H100)
    for knob in ({"Q_BUFFERS": 2}, {"SPLIT_KV": 1}):
        assert "ROWS 64" in SPEC.space.check(_config(PERSISTENT=1, ROWS=128, BLOCK_N=64, **knob),
                                             _problem(64), H100)
    assert "shared memory" in SPEC.space.check({**two, "NUM_STAGES": 3}, d128, H100)
    assert SPEC.space.check({**two, "NUM_STAGES": 3, "Q_BUFFERS": 1}, d128, H100) is None
    table = space.load_table()
    for d, dtype in ((64, "fp16"), (128, "bf16"), (256, "bf16")):
        for config in (_config(PERSISTENT=1), _config(PERSISTENT=1, TMA_STORE=1, BLOCK_N=64)):
            one = table[space.entry_key(d, dtype, True, config)]
            both = table[space.entry_key(d, dtype, True, {**config, "Q_BUFFERS": 2})]
            q_tiles = config["NUM_CONSUMERS"] * config["ROWS"] * d * 2
            assert one.shared + q_tiles <= both.shared <= one.shared + q_tiles + 64, (d, config)
            split = table[space.entry_key(d, dtype, True, {**config, "SPLIT_KV": 1})]
            assert one.shared <= split.shared <= one.shared + 64, (d, config)
    old = {k: v for k, v in _config(PERSISTENT=1).items()
           if k not in ("Q_BUFFERS", "SPLIT_KV", "CTAS_PER_SM")}
    assert SPEC.space.validate(old) == _config(PERSISTENT=1)


def test_two_ctas_an_sm_take_half_the_register_file_and_of_the_shared_memory() -> None:
    """``CTAS_PER_SM`` 2 (occupancy_probe_h100.json: twice one consumer's speed, ahead of two
    consumers at causal short N): a one-consumer CTA of 64 rows (8 warps: the producer's
    warpgroup is padded) launches at 128 registers a thread, half the 64K file, and
    ``setmaxnreg`` raises its consumer to 232; the predicate gives it half of an SM's 228
    KiB less the 1 KiB a CTA reserves and refuses it with two consumers, 128 rows, or at
    D256; a persistent launch plans two CTAs an SM. Left out, as in configs stored before
    it, it is 1: the launch of before."""
    from flashtune.kernel_templates.attn_fwd_gluon.launcher import (
        PLANNING_SMS,
        kernel_args,
        launch_meta,
    )

    one = _config(NUM_CONSUMERS=1, BLOCK_N=64, TMA_STORE=1, SPLIT_KV=1)
    two = {**one, "CTAS_PER_SM": 2}
    meta = launch_meta(two)
    assert (meta["maxnreg"], meta["PRODUCER_REGS"], meta["CONSUMER_REGS"]) == (128, 24, 232)
    assert 2 * 8 * 32 * meta["maxnreg"] == 65536
    assert launch_meta({k: v for k, v in one.items() if k != "CTAS_PER_SM"}) == \
        launch_meta(one) != meta
    d128 = _problem(128, True)
    assert SPEC.space.check(two, d128, H100) is None
    assert two in SPEC.space.valid_configs(d128, H100)
    assert space.cta_smem_limit(two, H100) == (232448 + 1024) // 2 - 1024 == 115712
    assert space.cta_smem_limit(one, H100) == 232448
    table = space.load_table()
    three = {**two, "NUM_STAGES": 3}  # Q and 3 stages of 64-key K and V tiles at D128: 112 KiB
    assert space.load_table()[space.entry_key(128, "bf16", True, three)].shared <= 115712
    assert SPEC.space.check(three, d128, H100) is None
    wide = {**two, "BLOCK_N": 128}  # Q and 2 stages of 128-key K and V tiles: 144 KiB
    shared = table[space.entry_key(128, "bf16", True, wide)].shared
    assert 115712 < shared <= 232448
    assert "shared memory" in SPEC.space.check(wide, d128, H100)
    assert SPEC.space.check({**wide, "CTAS_PER_SM": 1}, d128, H100) is None
    for config, says in (({**two, "NUM_CONSUMERS": 2}, "NUM_CONSUMERS 1"),
                         ({**two, "ROWS": 128}, "ROWS 64")):
        assert says in SPEC.space.check(config, d128, H100)
    assert "head_dim 256" in SPEC.space.check(two, _problem(256, True), H100)
    q = torch.zeros(8, 16, 1024, 128, dtype=torch.bfloat16)

    def plan(config):
        return kernel_args(q, q, q, torch.empty_like(q), torch.zeros(8, 16, 1024), config,
                           causal=True, scale=0.125)

    args, kwargs, grid = plan({**two, "PERSISTENT": 1})
    assert grid == (2 * PLANNING_SMS, 1) and kwargs["maxnreg"] == 128
    assert plan({**one, "PERSISTENT": 1})[2] == (PLANNING_SMS, 1)
    assert plan(two)[2] == plan(one)[2] == (16, 8 * 16)  # a grid launch: a CTA per tile


@pytest.mark.parametrize("d", [64, 128])
def test_without_a_mask_the_default_overlaps_the_epilogue_with_the_next_tile(d: int) -> None:
    """gluon_tile_cost_splitkv_h100.json (H100, Nq 512, Nk 128-4096): the persistent kernel
    with two Q buffers, K and V released apart and the TMA store ran 0.93-1.04x cuDNN at
    D64 and 0.94-1.06x at D128, ahead of the earlier default and of the tuned table
    config; it is the default without a mask (2 stages at D128, where 3 do not fit beside
    the second Q buffer). Causal problems keep the grid launch, D256 its old default."""
    config = SPEC.default_config(_problem(d), H100)
    assert (config["PERSISTENT"], config["Q_BUFFERS"], config["SPLIT_KV"],
            config["TMA_STORE"]) == (1, 2, 1, 1)
    assert config["NUM_STAGES"] == (3 if d == 64 else 2)
    assert SPEC.space.check(config, _problem(d, dtype="fp16"), H100) is None
    assert SPEC.default_config(_problem(d, True), H100)["PERSISTENT"] == 0
    assert SPEC.default_config(_problem(256), H100)["Q_BUFFERS"] == 1


@pytest.mark.parametrize("d,longest", [(64, 2048), (128, 1024)])
def test_short_causal_problems_default_to_two_one_consumer_ctas_an_sm(d: int,
                                                                      longest: int) -> None:
    """occupancy_probe_h100.json (H100, 16k tokens): one-consumer CTAs two an SM ran causal
    D64 N512-2k at 0.78-0.91x cuDNN (the two-consumer default 0.66-0.84x) and D128 N512-1k
    at 0.87-0.91x (0.79-0.87x), but lost to the two-consumer tile at D128 N2k; the default
    follows up to those key lengths, causal only, and never at D256."""
    for nk in (77, longest):
        p = _problem(d, True, nq=nk, nk=nk)
        config = SPEC.default_config(p, H100)
        assert (config["NUM_CONSUMERS"], config["CTAS_PER_SM"], config["PERSISTENT"]) \
            == (1, 2, 0), (nk, config)
        assert SPEC.space.check(config, p, H100) is None
        assert config["SPLIT_KV"] == (d == 128)
    for p in (_problem(d, True, nq=longest, nk=2 * longest), _problem(d, nq=512, nk=512),
              _problem(256, True, nq=512, nk=512)):
        assert SPEC.default_config(p, H100)["CTAS_PER_SM"] == 1, p


def test_long_d64_problems_default_to_fa3s_tile() -> None:
    """sustained_early_h200.json (H200, at the power cap, cuDNN = 1): three consumers of 64
    rows over 128-key tiles, grid-launched, 3 stages and the TMA store ran D64 N16k 1.09x,
    N8k causal 1.04x (the tuned configs 0.98x, 0.97x) and trailed at N 1k-2k causal; the
    default from 8k keys at D64, with a mask or without, and only there."""
    fa3 = _config(NUM_CONSUMERS=3, BLOCK_N=128, NUM_STAGES=3, TMA_STORE=1)
    for causal in (False, True):
        for n in (8192, 16384):
            p = _problem(64, causal, nq=n, nk=n)
            assert SPEC.default_config(p, H100) == fa3, (causal, n)
            assert SPEC.space.check(fa3, p, H100) is None
        for p in (_problem(64, causal, nq=4096, nk=4096), _problem(128, causal, nq=8192,
                                                                    nk=8192)):
            assert SPEC.default_config(p, H100)["NUM_CONSUMERS"] != 3, p


@pytest.mark.parametrize("d", [64, 128, 256])
def test_a_search_tries_the_defaults_rivals_right_after_it(d: int) -> None:
    """occupancy_probe_h100.json and _h200.json: at causal D64 N512-2k one consumer two an
    SM led on the H100 and the persistent two-consumer LPT kernel on the H200, so the seeds
    of a short causal problem hold the other structures; past the short range they hold the
    one-consumer tile; without a mask the grid tile beside the overlapped default. Each is
    valid, none is the default, at most two; D256 has none that fit."""
    for causal in (False, True):
        for n in (77, 512, 2048, 4096, 8192):
            p = _problem(d, causal, nq=n, nk=n)
            default = SPEC.default_config(p, H100)
            seeds = SPEC.seed_configs(p, H100)
            assert len(seeds) <= 2 and default not in seeds
            assert len({json.dumps(c, sort_keys=True) for c in seeds}) == len(seeds)
            for config in seeds:
                assert SPEC.space.validate(config) == config
                assert SPEC.space.check(config, p, H100) is None, (p, config)
            structures = {(c["NUM_CONSUMERS"], c["CTAS_PER_SM"], c["PERSISTENT"], c["LPT"])
                          for c in seeds}
            if d == 256:
                assert seeds == []
            elif causal and default["CTAS_PER_SM"] == 2:  # the short causal range
                assert (2, 1, 1, 1) in structures and (2, 1, 0, 0) in structures
            elif d == 64 and n == 4096:  # FA3's D64 tile first, short of its default range
                assert seeds[0]["NUM_CONSUMERS"] == 3 and seeds[0]["BLOCK_N"] == 128
            elif causal:
                assert (1, 2, 0, 0) in structures and (2, 1, 1, 1) in structures
            elif default["NUM_CONSUMERS"] == 3:  # D64 from 8k: the overlapped kernel too
                assert structures == {(2, 1, 0, 0), (2, 1, 1, 0)}
            else:
                assert structures == {(2, 1, 0, 0)}


def test_a_launch_passes_q_buffers_and_split_kv_only_when_set() -> None:
    """``Q_BUFFERS`` 2 and ``SPLIT_KV`` 1 reach the kernel as constexprs; 1 and 0, or left
    out as in configs stored before them, pass nothing, which compiles (and caches) the
    kernel stored before them."""
    from flashtune.kernel_templates.attn_fwd_gluon.launcher import kernel_args

    q = torch.zeros(2, 4, 300, 128, dtype=torch.bfloat16)
    k = torch.zeros(2, 2, 300, 128, dtype=torch.bfloat16)

    def plan(config):
        return kernel_args(q, k, k, torch.empty_like(q), torch.zeros(2, 4, 300), config,
                           causal=False, scale=0.125)

    _, kwargs, grid = plan(_config(PERSISTENT=1, Q_BUFFERS=2, SPLIT_KV=1))
    assert kwargs["Q_BUFFERS"] == 2 and kwargs["SPLIT_KV"] is True
    assert grid == plan(_config(PERSISTENT=1))[2]
    for config in (_config(PERSISTENT=1),
                   {n: v for n, v in _config(PERSISTENT=1).items()
                    if n not in ("Q_BUFFERS", "SPLIT_KV")}):
        assert not {"Q_BUFFERS", "SPLIT_KV"} & set(plan(config)[1])


# -- GPU (sm_90) -------------------------------------------------------------------------------------

def _rand(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(*shape, device="cuda", dtype=torch.float32).to(dtype)


def _precompile(p: AttentionProblem, configs: list[dict[str, int]]) -> None:
    """Compile ``configs`` for ``p`` in the tuner's process pool first (a cache hit at
    launch): ~100 kernels compile in a minute on 16 cores, not in minutes one by one."""
    from flashtune.autotune.precompile import precompile

    errors = {c: e for c, e in precompile(SPEC, p, configs, workers=None).items() if e}
    assert not errors, errors


def _assert_each_matches_the_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                       configs: list[dict[str, int]], causal: bool) -> None:
    """Output (relative error < 2e-2) and LSE (1e-2) of each config against float32."""
    ref, ref_lse = attn_fwd_reference(q, k, v, causal=causal, dtype=torch.float32)
    for config in configs:
        out, lse = SPEC.launcher(q, k, v, config, causal=causal, return_lse=True)
        rel = ((out.float() - ref).norm() / ref.norm()).item()
        assert rel < 2e-2, (config, causal, rel)
        assert torch.allclose(lse, ref_lse, atol=1e-2), (config, causal)


CASES = [  # (batch, heads_q, heads_kv, seqlen_q, seqlen_k, head_dim, causal)
    (2, 4, 4, 1000, 1000, 128, False),  # ragged: 1000 is no multiple of a tile
    (2, 4, 4, 1000, 1000, 64, True),
    (1, 8, 2, 77, 133, 64, True),  # GQA 4:1, causal Nq < Nk
    (2, 6, 2, 333, 517, 128, True),
    (1, 4, 1, 384, 130, 128, True),  # MQA, causal Nq > Nk: rows that see no key
    (1, 4, 4, 1, 1000, 64, False),  # one query
    (3, 2, 2, 64, 64, 128, True),
    (2, 4, 2, 333, 517, 256, True),  # D256 (Gemma-2), GQA, causal Nq < Nk
    (1, 2, 2, 1000, 1000, 256, False),
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("case", CASES,
                         ids=lambda s: "b{}h{}:{}q{}k{}d{}{}".format(*s[:6], "c" if s[6] else ""))
def test_matches_the_reference_through_the_spec_launcher(case, dtype) -> None:
    b, hq, hkv, nq, nk, d, causal = case
    q, k, v = _rand(b, hq, nq, d, dtype=dtype), _rand(b, hkv, nk, d, dtype=dtype), \
        _rand(b, hkv, nk, d, dtype=dtype)
    p = AttentionProblem.from_tensors(q, k, causal=causal)
    from flashtune.core.device import cuda_device

    config = SPEC.default_config(p, cuda_device())
    out = SPEC.launcher(q, k, v, config, causal=causal)
    assert_close_to_reference(out, q, k, v, causal=causal)
    out2, lse = SPEC.launcher(q, k, v, config, causal=causal, return_lse=True)
    assert torch.equal(out, out2)
    assert_close_to_reference(out2, q, k, v, causal=causal, lse=lse)


def test_the_layouts_it_reads_without_a_copy() -> None:
    """Contiguous (B, H, N, D), and (B, N, H, D) storage seen as (B, H, N, D) (what a
    transformers model hands over), are read as they are; other strides and bases not
    16-byte aligned are not (the launcher copies them)."""
    from flashtune.kernel_templates.attn_fwd_gluon.launcher import layout

    bhsd = torch.empty(2, 4, 33, 64, dtype=torch.bfloat16)
    bshd = torch.empty(2, 33, 4, 64, dtype=torch.bfloat16).transpose(1, 2)
    assert (layout(bhsd), layout(bshd)) == ("bhsd", "bshd")
    assert layout(torch.empty(1, 1, 33, 64).transpose(1, 2)[:, :1]) == "bhsd"  # size-1 dims
    assert layout(torch.empty(2, 33, 8, 64)[:, :, :4].transpose(1, 2)) is None  # every 2nd head
    assert layout(torch.empty(2, 4, 64, 33).transpose(2, 3)) is None  # D not contiguous
    assert layout(bhsd[:, :, 1:]) is None  # a slice of each head: rows no longer meet
    offset = torch.empty(2 * 4 * 33 * 64 + 1, dtype=torch.bfloat16)[1:].view(2, 4, 33, 64)
    assert offset.data_ptr() % 16 and layout(offset) is None


@pytest.mark.gpu
@pytest.mark.parametrize("persistent,tma_store", [(0, 0), (1, 0), (0, 1), (1, 1)],
                         ids=["grid", "persistent", "grid-tma-store", "persistent-tma-store"])
@pytest.mark.parametrize("case", [(2, 8, 2, 333, 517, 128, True), (3, 4, 4, 1000, 1000, 64, False),
                                  (1, 8, 1, 77, 77, 128, False)],
                         ids=lambda s: "b{}h{}:{}q{}k{}d{}{}".format(*s[:6], "c" if s[6] else ""))
def test_inputs_in_bshd_storage_run_without_copies(case, persistent, tma_store) -> None:
    """q, k, v as transformers hands them over (``x.view(B, N, H, D).transpose(1, 2)``), and
    q so with K/V contiguous: read where they are (no copy: the kernel's descriptors are over
    the caller's tensors), O returned in q's layout (``TMA_STORE``: whole tiles stored through
    the ``(B * N, H * D)`` view, a head ``D`` columns along), the reference matched."""
    from flashtune.kernel_templates.attn_fwd_gluon import launcher

    b, hq, hkv, nq, nk, d, causal = case
    dtype = torch.bfloat16
    q = _rand(b, nq, hq, d, dtype=dtype).transpose(1, 2)
    k, v = (_rand(b, nk, hkv, d, dtype=dtype).transpose(1, 2) for _ in range(2))
    config = {**_config(), "PERSISTENT": persistent, "TMA_STORE": tma_store}
    for kk, vv in ((k, v), (k.contiguous(), v.contiguous())):
        ready = launcher._tma_ready(q, kk, vv)
        assert all(a is b_ for a, b_ in zip(ready, (q, kk, vv)))  # nothing copied
        out, lse = SPEC.launcher(q, kk, vv, config, causal=causal, return_lse=True)
        assert out.stride() == q.stride()
        assert_close_to_reference(out, q, kk, vv, causal=causal, lse=lse)


@pytest.mark.gpu
def test_copies_what_it_cannot_address_and_takes_a_negative_scale() -> None:
    """A base 2 bytes past a 16-byte boundary is copied (and V with it: K and V share one
    descriptor shape); a negative scale runs as ``-scale`` on ``-k``."""
    dtype = torch.bfloat16
    q = _rand(2, 300, 4, 128, dtype=dtype).transpose(1, 2)
    k = _rand(2 * 2 * 260 * 128 + 1, dtype=dtype)[1:].view(2, 2, 260, 128)
    v = _rand(2, 260, 2, 128, dtype=dtype).transpose(1, 2)
    assert k.data_ptr() % 16 and not q.is_contiguous()
    for scale in (None, -0.05):
        out, lse = SPEC.launcher(q, k, v, _config(), causal=True, scale=scale, return_lse=True)
        assert_close_to_reference(out, q, k, v, causal=True, scale=scale, lse=lse)


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128, 256])
def test_every_valid_config_of_the_space_compiles_and_runs(d: int) -> None:
    from flashtune.core.device import cuda_device

    b, hq, hkv, nq, nk = 1, 4, 2, 333, 517
    q, k, v = _rand(b, hq, nq, d, dtype=torch.bfloat16), \
        _rand(b, hkv, nk, d, dtype=torch.bfloat16), _rand(b, hkv, nk, d, dtype=torch.bfloat16)
    for causal in (False, True):
        p = AttentionProblem.from_tensors(q, k, causal=causal)
        valid = SPEC.space.valid_configs(p, cuda_device())
        assert valid
        _precompile(p, valid)
        _assert_each_matches_the_reference(q, k, v, valid, causal)


@pytest.mark.gpu
@pytest.mark.parametrize("case", [c for c in CASES if c[5] == 64] + [
    (2, 6, 2, 333, 517, 64, True), (1, 4, 1, 384, 130, 64, True), (2, 4, 4, 1000, 1000, 64, False)],
    ids=lambda s: "b{}h{}:{}q{}k{}d{}{}".format(*s[:6], "c" if s[6] else ""))
def test_fa3s_d64_tile_matches_the_reference(case) -> None:
    """Three consumers over 128-key tiles at D64 (P converted to the P V operand before
    the next S: kernel.py's EARLY_P), every launch of it the space holds, on ragged, GQA,
    MQA, Nq != Nk and single-query shapes."""
    from flashtune.core.device import cuda_device

    b, hq, hkv, nq, nk, d, causal = case
    q, k, v = _rand(b, hq, nq, d, dtype=torch.bfloat16), \
        _rand(b, hkv, nk, d, dtype=torch.bfloat16), _rand(b, hkv, nk, d, dtype=torch.bfloat16)
    p = AttentionProblem.from_tensors(q, k, causal=causal)
    configs = [c for c in SPEC.space.valid_configs(p, cuda_device())
               if c["NUM_CONSUMERS"] == 3 and c["BLOCK_N"] == 128]
    assert _config(NUM_CONSUMERS=3, BLOCK_N=128, NUM_STAGES=3, TMA_STORE=1) in configs
    _precompile(p, configs)
    _assert_each_matches_the_reference(q, k, v, configs, causal)
    out = SPEC.launcher(q, k, v, configs[0], causal=causal)
    assert_close_to_reference(out, q, k, v, causal=causal)


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128])
def test_two_ctas_an_sm_match_the_reference(d: int) -> None:
    """Every valid ``CTAS_PER_SM`` 2 config (half the register file: a consumer short of
    registers would spill or fail to compile, the table says it does not) on an odd GQA
    shape, causal with Nq < Nk and not: output and LSE against float32 (the whole-space
    test covers them too; this one runs them alone, in seconds)."""
    from flashtune.core.device import cuda_device

    b, hq, hkv, nq, nk = 1, 4, 2, 333, 517
    q, k, v = _rand(b, hq, nq, d, dtype=torch.bfloat16), \
        _rand(b, hkv, nk, d, dtype=torch.bfloat16), _rand(b, hkv, nk, d, dtype=torch.bfloat16)
    for causal in (False, True):
        p = AttentionProblem.from_tensors(q, k, causal=causal)
        configs = [c for c in SPEC.space.valid_configs(p, cuda_device())
                   if c["CTAS_PER_SM"] == 2]
        assert len(configs) >= 8, configs
        _precompile(p, configs)
        _assert_each_matches_the_reference(q, k, v, configs, causal)


@pytest.mark.gpu
@pytest.mark.parametrize("case", [
    (3, 12, 4, 1000, 1000, 128, False),  # 288 tiles of 128 rows: 2-3 a CTA, ragged end
    (2, 16, 4, 1900, 2100, 64, True),  # GQA 4:1, causal Nq < Nk: tiles of every length
    (2, 16, 16, 2100, 700, 128, True),  # causal Nq > Nk: tiles whose rows see no key
], ids=["d128-full", "d64-causal-gqa", "d128-causal-nokey"])
def test_persistent_ctas_serve_many_tiles_each(case) -> None:
    """Every valid ``PERSISTENT`` config on problems of more tiles than SMs, so each CTA
    carries its barrier phases and ring slots from tile to tile (the protocol model's
    persistent cases) and reuses its Q buffers: output and LSE against float32."""
    from flashtune.core.device import cuda_device
    from flashtune.kernel_templates.attn_fwd_gluon.launcher import persistent_ctas

    b, hq, hkv, nq, nk, d, causal = case
    q, k, v = _rand(b, hq, nq, d, dtype=torch.bfloat16), \
        _rand(b, hkv, nk, d, dtype=torch.bfloat16), _rand(b, hkv, nk, d, dtype=torch.bfloat16)
    p = AttentionProblem.from_tensors(q, k, causal=causal)
    configs = [c for c in SPEC.space.valid_configs(p, cuda_device()) if c["PERSISTENT"]]
    assert len(configs) >= 4, configs
    _precompile(p, configs)
    ref, ref_lse = attn_fwd_reference(q, k, v, causal=causal, dtype=torch.float32)
    for config in configs:
        tiles = -(-nq // (config["ROWS"] * config["NUM_CONSUMERS"])) * b * hq
        # several tiles a CTA
        assert tiles > persistent_ctas(q, tiles, config["CTAS_PER_SM"]), (config, tiles)
        out, lse = SPEC.launcher(q, k, v, config, causal=causal, return_lse=True)
        rel = ((out.float() - ref).norm() / ref.norm()).item()
        assert rel < 2e-2, (config, rel)
        assert torch.allclose(lse, ref_lse, atol=1e-2), config


@pytest.mark.gpu
@pytest.mark.parametrize("budget", [1, 2_560_000], ids=["two-group-sections", "ragged-sections"])
def test_lpt_sections_smaller_than_the_batch_cover_every_tile(monkeypatch, budget) -> None:
    """``LPT`` on 8 persistent CTAs (36 tiles each) with sections of two GQA groups (6
    heads) and of 15 heads (15, 15 and a last one of 6 over 36 batch x heads): every tile
    is computed once, output and LSE against float32."""
    from flashtune.core.device import cuda_device
    from flashtune.kernel_templates.attn_fwd_gluon import launcher

    monkeypatch.setattr(launcher, "L2_BUDGET", budget)
    monkeypatch.setattr(launcher, "persistent_ctas", lambda t, tiles, per_sm=1: min(tiles, 8))
    assert launcher.lpt_section(36, 3, 1000, 128, 8, 8) == (6 if budget == 1 else 15)
    q = _rand(3, 12, 1000, 128, dtype=torch.bfloat16)
    k, v = (_rand(3, 4, 1000, 128, dtype=torch.bfloat16) for _ in range(2))
    p = AttentionProblem.from_tensors(q, k, causal=True)
    configs = [c for c in SPEC.space.valid_configs(p, cuda_device()) if c["LPT"]]
    assert configs
    _precompile(p, configs)
    _assert_each_matches_the_reference(q, k, v, configs, True)


@pytest.mark.gpu
def test_the_warmup_launch_compiles_on_the_gpu() -> None:
    p = _problem(128, True, "bf16", hq=4, hkv=2, nq=333, nk=517)
    for kernel, args, kwargs, grid in SPEC.warmup_launches(p, _config()):
        kernel.warmup(*args, grid=grid, **kwargs)


# -- a causal sliding window (issue 29) -----------------------------------------------------


def test_it_serves_a_causal_sliding_window_and_a_softcap_only() -> None:
    windowed = AttentionProblem(1, 8, 2, 4096, 4096, 128, True, "bf16", 1023)
    assert SPEC.refuse(windowed, H100) is None
    both_sides = AttentionProblem(1, 8, 2, 4096, 4096, 128, False, "bf16", 1023, 7)
    assert "a local window" in SPEC.refuse(both_sides, H100)
    capped = AttentionProblem(1, 8, 2, 4096, 4096, 128, True, "bf16", 1023, -1, 30.0)
    assert SPEC.refuse(capped, H100) is None
    assert SPEC.refuse(AttentionProblem(2, 16, 8, 8192, 8192, 256, False, "bf16", -1, -1,
                                        50.0), H100) is None
    alibi = AttentionProblem(1, 8, 2, 4096, 4096, 128, True, "bf16", alibi=True)
    assert "ALiBi" in SPEC.refuse(alibi, H100)
    q = torch.zeros(1, 2, 16, 128, dtype=torch.float16)
    for causal, window in ((False, (8, 8)), (False, (8, 0)), (True, (8, 4)), (True, (-2, 0)),
                           (False, (-1, 0))):  # the last a right bound, not "no window"
        with pytest.raises(InputError, match="causal sliding window"):
            SPEC.launcher(q, q, q, _config(), causal=causal, window=window)
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(InputError, match="softcap"):
            SPEC.launcher(q, q, q, _config(), causal=True, softcap=bad)


def test_a_softcap_launch_passes_the_cap_as_a_constexpr_and_the_scale_into_the_tanh() -> None:
    """With a softcap the kernel takes ``SOFTCAP`` = cap x log2 e (a constexpr: a compile
    per cap) and ``qk_scale`` = scale / cap (an argument: no compile per scale); without
    one, nothing new (the kernel compiled and cached before the knob); the warmup launch
    compiles a capped problem's kernel."""
    from flashtune.kernel_templates.attn_fwd_gluon.launcher import LOG2E, kernel_args

    q = torch.zeros(2, 4, 300, 256, dtype=torch.bfloat16)
    k = torch.zeros(2, 2, 300, 256, dtype=torch.bfloat16)

    def plan(**kw):
        return kernel_args(q, k, k, torch.empty_like(q), torch.zeros(2, 4, 300),
                           _config(BLOCK_N=64), causal=True, scale=0.0625, **kw)

    args, kwargs, _ = plan(softcap=50.0)
    assert kwargs["SOFTCAP"] == pytest.approx(50.0 * LOG2E)
    assert args[10] == pytest.approx(0.0625 / 50.0)
    args, kwargs, _ = plan()
    assert "SOFTCAP" not in kwargs and args[10] == pytest.approx(0.0625 * LOG2E)
    capped = AttentionProblem(2, 4, 2, 300, 300, 256, True, "bf16", 99, -1, 50.0)
    (_, _, kwargs, _), = SPEC.warmup_launches(capped, _config(BLOCK_N=64))
    assert kwargs["SOFTCAP"] == pytest.approx(50.0 * LOG2E) and kwargs["WINDOW"]


@pytest.mark.slow
def test_the_window_compiles_for_sm90_without_new_spills() -> None:
    """The window's mask and block range cost no register and no spill over the plain
    causal kernel (both compiled for sm_90 on the CPU)."""
    config = _config(ROWS=64, BLOCK_N=128, NUM_STAGES=2, NUM_CONSUMERS=2, PINGPONG=1,
                     PERSISTENT=0)
    plain, windowed = _recompile([{"config": config, "head_dim": 128, "causal": True,
                                   "dtype": "bf16"},
                                  {"config": dict(config, window=True), "head_dim": 128,
                                   "causal": True, "dtype": "bf16"}])
    assert windowed["window"] and not plain["window"]
    assert max(windowed["registers"]) <= max(plain["registers"])
    assert sum(windowed["spill_store_bytes"]) <= sum(plain["spill_store_bytes"])


@pytest.mark.slow
def test_the_softcap_compiles_for_sm90_without_spills_at_gemmas_head_dim() -> None:
    """The capped kernel (a tanh a score before the softmax) compiles for sm_90 at D256
    (Gemma 2, windowed or not) and D128 with the plain kernel's shared memory and no
    spill where the plain one has none."""
    d256 = _config(BLOCK_N=64)
    d128 = _config(PINGPONG=1)
    got = _recompile([{"config": d256, "head_dim": 256, "causal": True, "dtype": "bf16"},
                      {"config": dict(d256, softcap=50.0), "head_dim": 256, "causal": True,
                       "dtype": "bf16"},
                      {"config": dict(d256, softcap=50.0, window=True), "head_dim": 256,
                       "causal": True, "dtype": "bf16"},
                      {"config": d128, "head_dim": 128, "causal": False, "dtype": "fp16"},
                      {"config": dict(d128, softcap=30.0), "head_dim": 128, "causal": False,
                       "dtype": "fp16"}])
    assert [g["softcap"] for g in got] == [0.0, 50.0, 50.0, 0.0, 30.0]
    for plain, capped in ((got[0], got[1]), (got[0], got[2]), (got[3], got[4])):
        assert capped["shared"] <= plain["shared"] + 16
        assert sum(plain["spill_store_bytes"]) > 0 or sum(capped["spill_store_bytes"]) == 0


# knob variants beside the default where the space has hundreds of points (D64, D128)
_SOFTCAP_KNOBS = [{"PINGPONG": 1}, {"PERSISTENT": 1, "LPT": 1, "TMA_STORE": 1, "Q_BUFFERS": 2,
                                    "SPLIT_KV": 1},
                  {"NUM_CONSUMERS": 1, "BLOCK_N": 64, "CTAS_PER_SM": 2},
                  {"NUM_CONSUMERS": 3, "NUM_STAGES": 2}, {"NUM_STAGES": 3, "TMA_STORE": 1}]


@pytest.mark.gpu
@pytest.mark.parametrize("case", [
    (2, 8, 2, 1000, 1000, 128, True, -1, 5.0),  # GQA, causal, ragged end, a cap that bites
    (1, 4, 4, 777, 1300, 64, True, 100, 5.0),  # Nq < Nk, a window inside one key block
    (2, 4, 2, 1000, 1000, 256, True, 300, 5.0),  # Gemma 2's local layers
    (2, 4, 2, 333, 517, 256, False, -1, 5.0),  # Gemma 2 without a mask (Nq != Nk)
    (1, 4, 1, 1300, 700, 128, True, -1, 5.0),  # MQA, Nq > Nk: rows that see no key
], ids=["d128-gqa-c", "d64-window", "d256-window", "d256-full", "d128-mqa-nq>nk"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_a_softcap_matches_the_reference(case, dtype) -> None:
    """The scores capped (and windowed): output and LSE against the float32 reference (its
    tanh exact, the kernel's the hardware's approximation); in bf16 every valid config of
    D256 (Gemma 2's head dim), elsewhere the default and its knob variants."""
    from flashtune.core.device import cuda_device

    b, hq, hkv, nq, nk, d, causal, left, cap = case
    q, k, v = _rand(b, hq, nq, d, dtype=dtype), _rand(b, hkv, nk, d, dtype=dtype), \
        _rand(b, hkv, nk, d, dtype=dtype)
    q = q * 2  # scores of several units: the cap of 5 bends them
    window = (left, 0) if left >= 0 else (-1, -1)
    p = AttentionProblem.from_tensors(q, k, causal=causal, window=window, softcap=cap)
    default = SPEC.default_config(p, cuda_device())
    if dtype == torch.bfloat16 and d == 256:
        configs = SPEC.space.valid_configs(p, cuda_device())
    else:
        variants = [{**default, **knobs} for knobs in _SOFTCAP_KNOBS]
        configs = [default] + [c for c in variants if c != default
                               and SPEC.space.check(c, p, cuda_device()) is None]
    assert len(configs) > 1
    _precompile(p, configs)
    ref, ref_lse = attn_fwd_reference(q, k, v, causal=causal, window=window, softcap=cap,
                                      dtype=torch.float32)
    plain, _ = attn_fwd_reference(q, k, v, causal=causal, window=window, dtype=torch.float32)
    assert ((plain - ref).norm() / ref.norm()).item() > 0.05  # the cap matters here
    tol = 2e-2 if dtype == torch.bfloat16 else 5e-3
    for config in configs:
        out, lse = SPEC.launcher(q, k, v, config, causal=causal, window=window, softcap=cap,
                                 return_lse=True)
        rel = ((out.float() - ref).norm() / ref.norm()).item()
        assert rel < tol, (config, rel)
        inf = torch.isinf(ref_lse)
        assert torch.equal(torch.isinf(lse), inf), config
        assert torch.allclose(lse[~inf], ref_lse[~inf], atol=1e-2), config


@pytest.mark.gpu
def test_a_softcap_trains_through_flashtune_with_the_gluon_forward() -> None:
    """flashtune.attention with a softcap and a window, forced to the Gluon forward (its
    plan replays the launcher bit for bit) and with gradients (the forward's pair with
    attn_bwd, which recomputes the capped scores): output and gradients against float32
    autograd."""
    import flashtune
    from flashtune.kernel_templates.attn_fwd_gluon.plan import AttnFwdGluonPlan
    from flashtune.kernel_templates.direct import current_stream

    torch.manual_seed(0)
    q, k, v = (_rand(1, 8, 1000, 256, dtype=torch.bfloat16) for _ in range(3))
    q = q * 4
    kw = dict(causal=True, window=(255, 0), softcap=50.0)
    out = flashtune.attention(q, k, v, impl="attn_fwd_gluon", **kw)
    ref, _ = attn_fwd_reference(q, k, v, dtype=torch.float32, **kw)
    assert ((out.float() - ref).norm() / ref.norm()).item() < 2e-2
    config = _config(BLOCK_N=64)
    plan = AttnFwdGluonPlan(q, k, v, config, scale=None, return_lse=True, **kw)
    for seed in (1, 2):
        torch.manual_seed(seed)
        q2, k2, v2 = (_rand(1, 8, 1000, 256, dtype=torch.bfloat16) for _ in range(3))
        got = plan(q2, k2, v2, current_stream(q2.get_device()))
        want = SPEC.launcher(q2, k2, v2, config, return_lse=True, **kw)
        assert all(torch.equal(g, w) for g, w in zip(got, want))
    pair = get_template("attn_fwd_gluon")
    problem = AttentionProblem.from_tensors(q, k, causal=True, window=(255, 0), softcap=50.0)
    assert pair.limits.both(get_template("attn_bwd").limits).refuse(problem, H100) is None
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    fwd_cfg = SPEC.default_config(problem, H100)
    from flashtune.runtime.autograd import pair_fn

    bwd = get_template("attn_bwd")
    out, _ = pair_fn(*leaves, True, None, SPEC.launcher, fwd_cfg, bwd.launcher,
                     bwd.default_config(problem, H100),
                     {"window": (255, 0), "softcap": 50.0})
    dout = torch.randn_like(out)
    out.backward(dout)
    ref_leaves = [t.detach().float().requires_grad_() for t in (q, k, v)]
    ref, _ = attn_fwd_reference(*ref_leaves, dtype=torch.float32, **kw)
    ref.backward(dout.float())
    for got, want in zip(leaves, ref_leaves):
        rel = ((got.grad.float() - want.grad).norm() / want.grad.norm()).item()
        assert rel < 3e-2, rel


@pytest.mark.gpu
@pytest.mark.parametrize("case", [
    (2, 8, 2, 1000, 1000, 128, 255),  # GQA, a window of 2 tiles, ragged end
    (1, 4, 4, 777, 1300, 64, 100),  # Nq < Nk, a window inside one key block
    (1, 4, 1, 1300, 700, 128, 511),  # Nq > Nk: rows that see no key
    (2, 4, 2, 1000, 1000, 256, 300),  # D256 (Gemma-2's sliding layers)
    (4, 16, 4, 2048, 2048, 128, 0),  # window 0: each query sees itself only
], ids=["d128-gqa", "d64-nq<nk", "d128-nq>nk", "d256", "d128-w0"])
def test_a_causal_window_matches_the_reference_for_every_config(case) -> None:
    """Every valid config (grid and persistent, ping-pong, 1-3 consumers): the tiles skip
    the key blocks before the window and mask its left band; output and LSE against the
    float32 reference."""
    from flashtune.core.device import cuda_device

    b, hq, hkv, nq, nk, d, left = case
    q, k, v = _rand(b, hq, nq, d, dtype=torch.bfloat16), \
        _rand(b, hkv, nk, d, dtype=torch.bfloat16), _rand(b, hkv, nk, d, dtype=torch.bfloat16)
    p = AttentionProblem.from_tensors(q, k, causal=True, window=(left, 0))
    configs = SPEC.space.valid_configs(p, cuda_device())
    assert configs
    _precompile(p, configs)
    ref, ref_lse = attn_fwd_reference(q, k, v, causal=True, window=(left, 0),
                                      dtype=torch.float32)
    for config in configs:
        out, lse = SPEC.launcher(q, k, v, config, causal=True, window=(left, 0),
                                 return_lse=True)
        rel = ((out.float() - ref).norm() / ref.norm()).item()
        assert rel < 2e-2, (config, rel)
        inf = torch.isinf(ref_lse)
        assert torch.equal(torch.isinf(lse), inf), config
        assert torch.allclose(lse[~inf], ref_lse[~inf], atol=1e-2), config


@pytest.mark.gpu
def test_flashtune_attention_routes_a_tuned_window_to_it() -> None:
    """A stored op choice of the Gluon forward for a windowed problem is what
    flashtune.attention runs (the scored route takes flashtune's kernels that serve the
    call), forward and with gradients (its pair with attn_bwd)."""
    import flashtune
    from flashtune.core.device import cuda_device
    from flashtune.runtime import scored

    q, k, v = (_rand(1, 8, 1024, 128, dtype=torch.bfloat16) for _ in range(3))
    out = flashtune.attention(q, k, v, causal=True, window=(255, 0), impl="attn_fwd_gluon")
    ref, _ = attn_fwd_reference(q, k, v, causal=True, window=(255, 0), dtype=torch.float32)
    assert ((out.float() - ref).norm() / ref.norm()).item() < 2e-2
    problem = AttentionProblem.from_tensors(q, k, causal=True, window=(255, 0))
    assert scored._serves(SPEC, problem, cuda_device(), True)


# -- the runtime's launch plan ------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("knobs", [
    {},
    {"PERSISTENT": 1, "LPT": 1, "TMA_STORE": 1, "Q_BUFFERS": 2, "SPLIT_KV": 1},
    {"NUM_CONSUMERS": 1, "BLOCK_N": 64, "TMA_STORE": 1, "CTAS_PER_SM": 2},
    {"NUM_STAGES": 3, "TMA_STORE": 1},
], ids=["default", "persistent-lpt-qbuf2-splitkv-tma-store", "two-ctas", "grid-tma-store"])
@pytest.mark.parametrize("storage", ["bhsd", "bshd"])
def test_a_plan_replays_the_launcher_bit_for_bit(knobs, storage) -> None:
    """:class:`AttnFwdGluonPlan` (what the runtime replays after a signature's first call)
    returns what the launcher returns for new tensors of the same signature, bit for bit,
    with and without the LSE, O in q's layout; and it refuses what the launcher would copy."""
    from flashtune.kernel_templates.attn_fwd_gluon.plan import AttnFwdGluonPlan
    from flashtune.kernel_templates.direct import current_stream

    b, hq, hkv, nq, nk, d = 2, 8, 2, 333, 517, 128
    config = {**_config(), **knobs}

    def make(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        torch.manual_seed(seed)
        if storage == "bshd":
            return (_rand(b, nq, hq, d, dtype=torch.bfloat16).transpose(1, 2),
                    *(_rand(b, nk, hkv, d, dtype=torch.bfloat16).transpose(1, 2)
                      for _ in range(2)))
        return (_rand(b, hq, nq, d, dtype=torch.bfloat16),
                *(_rand(b, hkv, nk, d, dtype=torch.bfloat16) for _ in range(2)))

    for causal in (False, True):
        for return_lse in (False, True):
            q, k, v = make(0)
            plan = AttnFwdGluonPlan(q, k, v, config, causal=causal, scale=None,
                                    return_lse=return_lse)
            for seed in (1, 2):
                q, k, v = make(seed)
                got = plan(q, k, v, current_stream(q.get_device()))
                want = SPEC.launcher(q, k, v, config, causal=causal, return_lse=return_lse)
                for g, w in zip(got if return_lse else (got,), want if return_lse else (want,)):
                    assert torch.equal(g, w), (knobs, storage, causal, return_lse)
                out = got[0] if return_lse else got
                assert out.stride() == q.stride()
            assert_close_to_reference(out, q, k, v, causal=causal)
    q, k, v = make(3)
    shifted = _rand(b * hq * nq * d + 1, dtype=torch.bfloat16)[1:].view(b, hq, nq, d)
    for args, kw in (((shifted, k, v), {}), ((q, k, v), {"scale": -0.1})):
        with pytest.raises(ValueError, match="no plan"):
            AttnFwdGluonPlan(*args, config, causal=True, return_lse=False,
                             **{"scale": None, **kw})


@pytest.mark.gpu
def test_flashtune_attention_replays_a_gluon_plan(monkeypatch) -> None:
    """A call the router sends to the Gluon forward builds its plan on the first call and
    replays it after (the runtime's hot path), matching the reference."""
    import flashtune
    from flashtune.kernel_templates.attn_fwd_gluon.plan import AttnFwdGluonPlan
    from flashtune.runtime import routing

    q = _rand(2, 8, 300, 128, dtype=torch.bfloat16)
    k, v = (_rand(2, 2, 300, 128, dtype=torch.bfloat16) for _ in range(2))
    p = AttentionProblem.from_tensors(q, k, causal=True)
    from flashtune.core.device import cuda_device

    choice = routing.ConfigChoice(SPEC.default_config(p, cuda_device()), "exact",
                                  template="attn_fwd_gluon")
    monkeypatch.setattr(routing, "_route", lambda *a, **kw: choice)
    flashtune.reload_configs()
    try:
        with torch.no_grad():
            outs = [flashtune.attention(q, k, v, causal=True) for _ in range(3)]
        plans = [pl for pl in routing._PLANS.values() if isinstance(pl, AttnFwdGluonPlan)]
        assert len(plans) == 1
        assert torch.equal(outs[0], outs[2])
        assert_close_to_reference(outs[2], q, k, v, causal=True)
    finally:
        flashtune.reload_configs()

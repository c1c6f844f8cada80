"""attn_fwd_gluon's search space and validity predicate.

The knobs are the launcher's: ``ROWS`` query rows per consumer warpgroup, ``BLOCK_N`` keys
per K/V tile, ``NUM_STAGES`` K/V buffers, ``NUM_CONSUMERS`` consumer warpgroups and
``PINGPONG`` (the two consumers take turns to issue their wgmmas), ``PERSISTENT`` (a CTA
per SM looping over the tiles instead of a CTA per tile) and ``LPT`` (a persistent causal
launch's tiles longest first across the heads of an L2-sized section; optional, 0 when a
stored config predates it), ``TMA_STORE`` (O out through Q's shared buffer by one TMA copy),
``Q_BUFFERS`` (a persistent CTA's tiles alternate between two sets of Q buffers; optional,
1), ``SPLIT_KV`` (K and V buffers released apart; optional, 0) and ``CTAS_PER_SM`` (2: a
one-consumer CTA compiled to half the register file, two an SM; optional, 1). Tiles are
powers of two
(Gluon tensors and TMA boxes are), so FA3's 176-key tile is out; ``NUM_STAGES`` starts at 2
(one buffer would deadlock: block ``j`` is loaded only once block ``j - 1``'s buffer is
released, which waits for block ``j``).

Whether a config fits is what ptxas makes of it: registers spill (more than
:data:`SPILL_LIMIT` bytes) or not, shared memory fits
the 227 KiB an sm_90 block may opt in to or not. Compiling takes seconds, so the predicate
reads a table instead, ``sm90_compile.json`` next to this file: every point of the space
compiled for sm_90a on the CPU per head dim, dtype and causal flag (shared bytes, registers,
spill bytes, or the compile error), written by

    python -m flashtune.kernel_templates.attn_fwd_gluon --prefilter

(:mod:`.prefilter`; hours on 2 cores for every entry, but an entry whose frontend IR a
kernel change left as it was is reused: :mod:`flashtune.kernel_templates.sm90_table`). The
table records the template's source hash;
``tests/kernel_templates_tests/test_attn_fwd_gluon.py`` fails when it is stale or misses a
point of the space. The table compiles scalar arguments without the divisibility
specialization a launch may add (``seqlen_q`` a multiple of 16): a pre-filter, and the
tuner's trials have the last word. A causal window and a softcap are not keys: their
kernels are read as their plain twins (the window's mask and block range cost no register
over the causal kernel; the softcap's tanh a few at most, its shared memory the same:
``test_attn_fwd_gluon.py`` compiles both).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from flashtune.core.device import DeviceFingerprint
from flashtune.core.problem import AttentionProblem
from flashtune.core.space import Config, SearchSpace
from flashtune.kernel_templates import sm90_table
from flashtune.kernel_templates.attn_fwd_gluon.launcher import OPTIONAL_CONFIG
from flashtune.kernel_templates.sm90_table import SMEM_LIMIT, SPILL_LIMIT, Compiled

__all__ = ["DEFAULTS", "HEAD_DIMS", "PARAMS", "SMEM_LIMIT", "SPILL_LIMIT", "SPACE", "TABLE",
           "Compiled", "check", "cta_smem_limit", "default_config", "entry_key", "load_table",
           "seed_configs", "structural_reason"]

PARAMS: dict[str, tuple[int, ...]] = {
    # ROWS 128 fits at D64 with 64-key tiles (no spill), spills with larger tiles
    "ROWS": (64, 128),
    # 256-key tiles spilled 0.7-2 KB at 240 registers per consumer in every config compiled
    # (D64 and D128, one or two consumers): left out, their compiles took most of the time
    "BLOCK_N": (64, 128),
    "NUM_STAGES": (2, 3, 4),
    # 3: FA3's 192-row tile for head dim 64, at 160 registers a consumer (64-key tiles
    # compile without spills at D64 and D128; 128-key tiles at D64 since P is converted
    # early there, kernel.py's EARLY_P: grid-launched, no spill; persistent, 0.4 KB; at
    # D128 and D256 they spill 0.8 KB and more)
    "NUM_CONSUMERS": (1, 2, 3),
    "PINGPONG": (0, 1),
    # a CTA per SM looping over the tiles (the next tile's loads overlap this one's epilogue)
    "PERSISTENT": (0, 1),
    # a persistent causal launch: the tiles longest first across a section's heads (the
    # head-major order leaves a CTA striding by a multiple of the query blocks tiles of one
    # length: 0.72-1.01x the grid launch, explore_fwd_gluon_persistent_h100.json)
    "LPT": (0, 1),
    # a whole tile's O written to Q's shared buffer, then stored by one TMA copy (FA3's
    # epilogue; the registers' scattered 4-byte stores otherwise): 1.00-1.12x at D128 on
    # the H100, 0.95-1.08x at D64 (explore_fwd_gluon_tma_h100.json; _TMA_STORE_WINS)
    "TMA_STORE": (0, 1),
    # Q buffers per consumer (persistent): 2 lets the next tile's Q load while this tile's
    # epilogue holds its buffer (with TMA_STORE, O goes out through it), where one buffer
    # serialises epilogue, store, Q load and the next tile's first S; a tile's fixed cost
    # was 2.2 key blocks' worth at D128 N512 against cuDNN's 0.8 (gluon_tile_cost_h100.json)
    "Q_BUFFERS": (1, 2),
    # a K buffer released once its S is done, a V buffer once its P V is (FA3's separate K
    # and V pipelines), where both wait for the P V: the next K load starts a step earlier,
    # so 2 stages run the main loop as fast as 3 (D128: 203 against 269 us per 1k keys,
    # gluon_tile_cost_splitkv_h100.json) and leave room for the second Q buffer
    "SPLIT_KV": (0, 1),
    # CTAs an SM runs side by side: 2 launches a one-consumer CTA at 128 registers a thread
    # (setmaxnreg still gives its consumer 232), so an SM holds two where their shared
    # memory fits twice, and one's prologue and epilogue overlap the other's main loop. On
    # the H100 at 16k tokens (occupancy_probe_h100.json) it doubled one consumer's speed
    # and beat the two-consumer tile at causal short N: D128 N512 0.87x cuDNN (two
    # consumers 0.79x), N1024 0.91x (0.87x); D64 N512 0.78x (0.75x), N2048 0.91x (0.84x)
    "CTAS_PER_SM": (1, 2),
}
# knobs a config may leave out, the launcher's (configs stored before LPT, TMA_STORE,
# Q_BUFFERS, SPLIT_KV and CTAS_PER_SM existed ran 0, 0, 1, 0 and 1)
DEFAULTS: dict[str, int] = OPTIONAL_CONFIG
HEAD_DIMS = (64, 128, 256)  # the wgmma N of P V; the launcher refuses others
DTYPES = ("fp16", "bf16")
# SPILL_LIMIT (sm90_table: 256 spill-store bytes a config may have). The persistent kernel's consumers spill 72-216 B at
# 240 registers (sm_90a SASS, D64 and D128): the per-thread column predicates of the first
# key block, hoisted out of the tile loop, stored once at the start and reloaded only on a
# masked block; the inner loop stays in registers. The limit also lets through a few ROWS 128
# configs that spill 40-240 B: the tuner's timing judges them. Larger spills (ROWS 128 at
# D128: 0.7-5 KiB, 256-key tiles: 0.7-2 KiB, three consumers over 128-key tiles: 1.6 KiB
# and more) are the inner loop's and are refused.
TABLE = Path(__file__).with_name("sm90_compile.json")
TABLE_FORMAT = 1
REGENERATE = "python -m flashtune.kernel_templates.attn_fwd_gluon --prefilter"


def entry_key(head_dim: int, dtype: str, causal: bool, config: Mapping[str, int]) -> str:
    """The table's key for one compile: ``d128-bf16-causal-ROWS=64,BLOCK_N=128,...``."""
    knobs = ",".join(f"{name}={int(config.get(name, DEFAULTS.get(name, 0)))}"
                     for name in PARAMS)
    return f"d{head_dim}-{dtype}-{'causal' if causal else 'full'}-{knobs}"


def structural_reason(config: Mapping[str, int]) -> str | None:
    """What the kernel's own static asserts refuse (never compiled, not in the table)."""
    if config["PINGPONG"] and config["NUM_CONSUMERS"] != 2:
        return "PINGPONG takes turns between two consumers (NUM_CONSUMERS 2)"
    if config.get("LPT", 0) and not config["PERSISTENT"]:
        return "LPT orders a persistent launch's tiles (PERSISTENT 1; a grid launch runs " \
               "its causal CTAs longest first already)"
    if config.get("Q_BUFFERS", 1) != 1 and not config["PERSISTENT"]:
        return "Q_BUFFERS 2 alternates a persistent CTA's tiles between two Q buffers " \
               "(PERSISTENT 1; a grid launch's CTA has one tile)"
    if (config.get("Q_BUFFERS", 1) != 1 or config.get("SPLIT_KV", 0)) and config["ROWS"] != 64:
        return "Q_BUFFERS 2 and SPLIT_KV 1 are searched with ROWS 64 (ROWS 128: 1274 of " \
               "its 1440 sm_90 compiles spill or overflow shared memory, none was ever chosen)"
    if config.get("CTAS_PER_SM", 1) != 1 and (config["NUM_CONSUMERS"] != 1
                                              or config["ROWS"] != 64):
        return "CTAS_PER_SM 2 halves the register file of a one-consumer CTA of 64 rows " \
               "(NUM_CONSUMERS 1, ROWS 64; two consumers need all of it)"
    return None


def cta_smem_limit(config: Mapping[str, int], device: DeviceFingerprint) -> int:
    """The shared memory one CTA of ``config`` may use on ``device``: the block limit, or
    with ``CTAS_PER_SM`` 2 half of what an SM holds, less the 1 KiB each CTA reserves."""
    limit = sm90_table.smem_limit(device)
    per_sm = config.get("CTAS_PER_SM", 1)
    return limit if per_sm == 1 else (limit + 1024) // per_sm - 1024


def _entry(raw: Any, where: str) -> tuple[str, Compiled]:
    """One table entry, checked field by field (``ValueError`` naming ``where``)."""
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: an entry must be an object, got {type(raw).__name__}")
    fields = {"head_dim", "dtype", "causal", "config", "shared", "registers", "spill_bytes",
              "error"}
    if set(raw) - {"ir_hash"} != fields:  # ir_hash: sm90_table.parse_table checks it
        raise ValueError(f"{where}: an entry has the keys {sorted(fields)} (and ir_hash), "
                         f"got {sorted(raw)}")
    config = sm90_table.entry_config(raw, PARAMS, where)
    if type(raw["head_dim"]) is not int or raw["dtype"] not in DTYPES \
            or type(raw["causal"]) is not bool:
        raise ValueError(f"{where}: head_dim int, dtype in {DTYPES}, causal bool; got "
                         f"{raw['head_dim']!r}, {raw['dtype']!r}, {raw['causal']!r}")
    return (entry_key(raw["head_dim"], raw["dtype"], raw["causal"], config),
            sm90_table.entry_figures(raw, where))


def parse_table(doc: Any, where: str = "table") -> dict[str, Compiled]:
    """The entries of a table document (``json.load`` of ``sm90_compile.json``), checked.

    Raises:
        ValueError naming what is wrong and where.
    """
    return sm90_table.parse_table(doc, where, table_format=TABLE_FORMAT,
                                  regenerate=REGENERATE, entry=_entry)


@functools.lru_cache(maxsize=1)
def load_table(path: Path = TABLE) -> dict[str, Compiled]:
    """The sm_90 compile table, read and checked once (a stale source hash is logged).

    Raises:
        OSError when it cannot be read; ValueError when it is not a valid table.
    """
    return sm90_table.read_table(path, "attn_fwd_gluon", REGENERATE, parse_table)


def check(config: Mapping[str, int], problem: AttentionProblem,
          device: DeviceFingerprint) -> str | None:
    """Why ``config`` cannot (or should not) run ``problem`` on ``device``; None if it can.

    Structural rules first, then the sm_90 compile table: a config that failed to compile,
    spills, or needs more shared memory than the block may use (227 KiB, or the device's
    opt-in limit when lower; half an SM's, less 1 KiB, with ``CTAS_PER_SM`` 2) is refused
    with the table's figures.
    """
    reason = structural_reason(config)
    if reason is not None:
        return reason
    if problem.head_dim not in HEAD_DIMS:
        return f"head_dim {problem.head_dim}: the Gluon forward serves {list(HEAD_DIMS)}"
    if config.get("LPT", 0) and not problem.causal:
        return "LPT orders causal tiles (without a mask every tile is as long: LPT 0's order)"
    if config.get("CTAS_PER_SM", 1) != 1 and problem.head_dim == HEAD_DIMS[-1]:
        return f"CTAS_PER_SM 2 at head_dim {problem.head_dim}: Q and two K/V stages " \
               f"overflow half an SM's shared memory (not compiled)"
    compiled = load_table().get(entry_key(problem.head_dim, problem.dtype, problem.causal,
                                          config))
    if compiled is None:
        return f"not in the sm_90 compile table ({TABLE.name}); regenerate it: {REGENERATE}"
    return compiled.reason(cta_smem_limit(config, device))


SPACE = SearchSpace(params=PARAMS, predicate=check, defaults=DEFAULTS)

# what an untuned shape runs, best first where the predicate allows it. On the H100 (bf16,
# standard grid, benchmarks/results/explore_fwd_gluon_persistent_h100.json) 3 stages of
# 128-key tiles led, persistent without a mask (1.03-1.23x the grid launch at N 512-4k:
# the next tile's loads overlap this one's epilogue), grid-launched with one (the static
# round-robin of a persistent CTA leaves causal tiles unbalanced: 0.72-1.01x). LPT 1 evens
# them out but took 0.70-0.93x the grid launch at D128 causal N 512-16k
# (explore_fwd_gluon_lpt_h100.json: its head-wide order costs L2 reuse); the tuner may pick it
def _knobs(stages: int, persistent: int, block_n: int = 128, consumers: int = 2) -> Config:
    return {"ROWS": 64, "BLOCK_N": block_n, "NUM_STAGES": stages, "NUM_CONSUMERS": consumers,
            "PINGPONG": 0, "PERSISTENT": persistent, "LPT": 0, "TMA_STORE": 0, "Q_BUFFERS": 1,
            "SPLIT_KV": 0, "CTAS_PER_SM": 1}


_FALLBACKS: tuple[Config, ...] = (_knobs(2, 0), _knobs(3, 0, 64), _knobs(2, 0, 64),
                                  _knobs(2, 0, 64, 1))
_DEFAULTS: dict[bool, tuple[Config, ...]] = {
    False: (_knobs(3, 1), _knobs(2, 1)) + _FALLBACKS,  # no mask
    True: (_knobs(3, 0),) + _FALLBACKS,  # causal
}


# TMA_STORE 1 where it was measured to win on the H100 (explore_fwd_gluon_tma_h100.json,
# standard grid, the same config with and without): at D128 1.00-1.12x grid-launched and
# 1.02-1.07x persistent up to 8k tokens (0.98-0.99x persistent at 16k); at D64 causal
# 1.01-1.08x grid-launched. At D64 without a mask (persistent) 0.95-1.02x: left at 0 there,
# and at D256 (not timed)
_TMA_STORE_WINS: frozenset[tuple[int, bool]] = frozenset({(64, True), (128, False),
                                                          (128, True)})
# without a mask, first of all: the persistent kernel whose epilogue overlaps the next
# tile's Q load (Q_BUFFERS 2) and stores by TMA, 2 stages at D128 with SPLIT_KV (a second
# Q buffer does not fit beside 3). On the H100 at Nq 512, Nk 128-4096
# (gluon_tile_cost_splitkv_h100.json) 0.93-1.04x cuDNN at D64 (the earlier default
# 0.76-0.99x) and 0.94-1.06x at D128 (the tuned table config 0.75-1.04x)
_OVERLAPPED: dict[int, Config] = {
    64: {**_knobs(3, 1), "TMA_STORE": 1, "Q_BUFFERS": 2, "SPLIT_KV": 1},
    128: {**_knobs(2, 1), "PINGPONG": 1, "TMA_STORE": 1, "Q_BUFFERS": 2, "SPLIT_KV": 1},
}


# causal with few keys, first of all: one-consumer CTAs two an SM, so one CTA's prologue
# and epilogue (a larger share of a short causal tile) overlap the other's main loop; up to
# the longest key length where it was measured to win. On the H100 at 16k tokens
# (occupancy_probe_h100.json, cuDNN = 1): D64 N512/1k/2k 0.78/0.85/0.91 (the two-consumer
# default 0.66/0.76/0.84); D128 N512/1k 0.87/0.91 (0.79/0.87), at N2k 0.93 against the
# two-consumer tile's 0.96, so not there
_TWO_AN_SM: dict[int, tuple[int, Config]] = {
    64: (2048, {**_knobs(3, 0, 128, 1), "TMA_STORE": 1, "CTAS_PER_SM": 2}),
    128: (1024, {**_knobs(2, 0, 64, 1), "TMA_STORE": 1, "SPLIT_KV": 1, "CTAS_PER_SM": 2}),
}


# FA3's D64 tile: three consumers of 64 rows over 128-key tiles, grid-launched, 3 stages,
# the TMA store (kernel.py's EARLY_P makes it fit). On the H200 (sustained_early_h200.json,
# at the power cap, cuDNN = 1) it ran N 16k 1.09x, N 8k causal 1.04x, N 4k 1.02x and N 4k
# causal 0.96x, where the tuned configs of before ran 0.98x, 0.97x, 0.97x and 0.92x; at
# N 1k-2k causal it trailed them (0.66-0.88x). The default from 8k keys, a rival from 4k
_FA3_D64_TILE: Config = {**_knobs(3, 0, 128, 3), "TMA_STORE": 1}
_FA3_D64_DEFAULT_FROM, _FA3_D64_RIVAL_FROM = 8192, 4096  # keys


def default_config(problem: AttentionProblem, device: DeviceFingerprint) -> Config:
    """A safe config for ``problem``: the first of the defaults the predicate accepts (the
    first one for a problem no config serves: the predicate names why), with TMA_STORE 1
    where it wins, the overlapped persistent kernel first without a mask, two CTAs an SM
    first for short causal problems and FA3's 192 x 128 tile first at D64 from 8k keys,
    where each was measured."""
    defaults = _DEFAULTS[bool(problem.causal)]
    if (problem.head_dim, bool(problem.causal)) in _TMA_STORE_WINS:
        defaults = tuple(c for config in defaults
                         for c in ({**config, "TMA_STORE": 1}, config))
    if not problem.causal and problem.head_dim in _OVERLAPPED:
        defaults = (_OVERLAPPED[problem.head_dim], *defaults)
    short = _TWO_AN_SM.get(problem.head_dim)
    if problem.causal and short is not None and problem.seqlen_k <= short[0]:
        defaults = (short[1], *defaults)
    if problem.head_dim == 64 and problem.seqlen_k >= _FA3_D64_DEFAULT_FROM:
        defaults = (_FA3_D64_TILE, *defaults)
    for config in defaults:
        if check(config, problem, device) is None:
            return dict(config)
    return dict(defaults[0])


# the default's rivals, tried right after it by a search (TemplateSpec.seed_configs): the
# structures that led where the default did not. With a mask, the persistent two-consumer
# kernel ordering its tiles longest first, with two Q buffers and K/V apart, led the short
# causal D64 shapes on the H200 (occupancy_probe_h200.json: N512-2k 0.82/0.92/0.94x cuDNN,
# one consumer two an SM 0.77/0.85/0.92x) where the H100 ran it behind (0.75/0.85/0.84x
# against 0.78/0.85/0.91x); one consumer two an SM past the default's key lengths (D128
# N2k: 0.93-0.94x against the two-consumer tile's 0.96-0.98x on both GPUs: close); the
# two-consumer grid tile with 3 stages and the TMA store, the default's own past them.
# Without a mask: the overlapped persistent kernel and the grid tile (D128 N4k on the
# H200: 1.05x cuDNN against 1.03x)
_CAUSAL_RIVALS: tuple[Config, ...] = (
    {**_knobs(2, 1), "LPT": 1, "TMA_STORE": 1, "Q_BUFFERS": 2, "SPLIT_KV": 1},
    {**_knobs(3, 0), "TMA_STORE": 1},
)
_RIVALS_PER_SEARCH = 2


def seed_configs(problem: AttentionProblem, device: DeviceFingerprint) -> list[Config]:
    """The default's rivals for ``problem`` (at most two, each valid on ``device`` and
    other than the default): what a search of a few trials should compare with it."""
    default = default_config(problem, device)
    if problem.causal:
        short = _TWO_AN_SM.get(problem.head_dim)
        rivals: tuple[Config, ...] = ((short[1],) if short else ()) + _CAUSAL_RIVALS
    else:
        rivals = tuple(c for c in (_OVERLAPPED.get(problem.head_dim),
                                   {**_knobs(3, 0), "TMA_STORE": 1}) if c is not None)
    if problem.head_dim == 64 and problem.seqlen_k >= _FA3_D64_RIVAL_FROM:
        rivals = (_FA3_D64_TILE, *rivals)
    out: list[Config] = []
    for config in rivals:
        if config != default and config not in out and check(config, problem, device) is None:
            out.append(dict(config))
    return out[:_RIVALS_PER_SEARCH]

"""attn_bwd_gluon's search space and validity predicate.

The knobs are the launcher's: ``BLOCK_M`` query rows per step (64, 128), ``BLOCK_N`` keys
per CTA (64, 128; the consumers split them), ``NUM_STAGES`` Q/dO buffers (2, 3: one would
deadlock the ring), ``NUM_CONSUMERS`` consumer warpgroups (1, 2), ``LPT`` the order the
CTAs run in (0: a head's key blocks side by side; 1: longest walk first, in sections of heads
whose Q, dO and dQ accumulator fit L2: under a causal mask the first key blocks walk every
later query block, and in the 2-D order one of them can start last and run alone; optional,
0 when left out), ``PERSISTENT`` (1: the same tiles in the same order on at most one CTA an SM, so a
tile's K/V and first Q/dO loads run under the last tile's steps and dK/dV stores: at short
sequences a CTA walks few steps and a grid launch pays its ramp and epilogue each time;
dense batches only; optional, 0), ``DQ_TMA`` (1: the dQ writer adds each step's partial with
TMA bulk reduce-adds, FA3's writer, where 0 issues vector atomics; optional, 0),
``TMA_STORE`` (1: a consumer stores a whole block of dK and dV through its K and V rows in
shared memory by two TMA copies, FA3's epilogue, where 0 stores them from registers;
optional, 0), ``EXPAND_GQA`` (1: a GQA problem runs as MHA, a CTA per query head reading its
group's K and V, dK and dV per query head summed over the group after, FlashAttention-2's
GQA backward, where 0 walks a group's query heads in one CTA: the CTAs in flight then read
the group's times as many Q, dO and dQ rows, more than L2 holds; dense GQA problems only;
optional, 0).
Structurally refused: ``BLOCK_N // NUM_CONSUMERS < 64`` (a warpgroup's wgmma covers 64
rows), and at D256, where the consumers split the head dim (``launcher.split_d``), any tile
shape but ``launcher.SPLIT_D_CONFIG``'s (64 x 64, two stages, two consumers, a grid launch,
dQ added by the consumers: ``LPT``, ``TMA_STORE`` and ``EXPAND_GQA`` are its knobs).

Whether a config fits is what ptxas makes of it, read from ``sm90_compile.json`` beside this
file (shared memory, registers, spill-store bytes or the compile error of every structurally
valid point per head dim and causal flag, compiled for sm_90a on the CPU by
:mod:`.prefilter`):

    python -m flashtune.kernel_templates.attn_bwd_gluon --prefilter

(about 30 minutes on 2 cores; an entry whose frontend IR a kernel change left as it was is
reused, not compiled again: :mod:`flashtune.kernel_templates.sm90_table`). The table is
compiled in bf16; fp16 compiles to the same registers and shared memory (the
same tile shapes, wgmma of another input type), so its verdicts serve both. ``EXPAND_GQA``
is not a key of it: its kernel differs by the producer's K/V head (``hk // KV_GROUP``), and
compiled to the same shared memory, registers and spills as its twin (D128 causal with the
TMA stores at groups 1, 7 and 8; D64 causal longest-first at 4), so a config's entry
serves it either way. A config spilling
more than :data:`SPILL_LIMIT` bytes or needing more than 227 KiB of shared memory is refused.
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
from flashtune.kernel_templates.attn_bwd_gluon.launcher import (
    HEAD_DIMS,
    OPTIONAL_CONFIG,
    split_d,
    split_d_reason,
)
from flashtune.kernel_templates.sm90_table import SMEM_LIMIT, SPILL_LIMIT, Compiled

__all__ = ["COMPILED", "DEFAULTS", "HEAD_DIMS", "PARAMS", "REGENERATE", "SMEM_LIMIT", "SPACE", "SPILL_LIMIT", "TABLE",
           "Compiled", "check", "default_config", "dq_tma_by_default", "entry_key", "load_table",
           "expand_gqa_by_default", "lpt_by_default", "persistent_by_default",
           "tma_store_by_default",
           "parse_table", "structural_reason"]

# the knobs the sm_90 table is keyed by (each a compile of its own)
COMPILED: dict[str, tuple[int, ...]] = {
    "BLOCK_M": (64, 128),
    "BLOCK_N": (64, 128),
    "NUM_STAGES": (2, 3),
    "NUM_CONSUMERS": (1, 2),
    "LPT": (0, 1),
    "PERSISTENT": (0, 1),
    "DQ_TMA": (0, 1),
    "TMA_STORE": (0, 1),
}
PARAMS: dict[str, tuple[int, ...]] = {**COMPILED, "EXPAND_GQA": (0, 1)}
# knobs a config may leave out, the launcher's (configs stored before LPT existed ran its 0)
DEFAULTS: dict[str, int] = OPTIONAL_CONFIG
# SPILL_LIMIT (sm90_table: 256 spill-store bytes allowed): at D128 the consumers hold dK and dV (128 fp32 registers a
# thread) across the walk; 8-220 B spill around the epilogue's stores (as attn_fwd_gluon's
# allowance: a pre-filter, the tuner's timing judges)
TABLE = Path(__file__).with_name("sm90_compile.json")
TABLE_FORMAT = 1
REGENERATE = "python -m flashtune.kernel_templates.attn_bwd_gluon --prefilter"


def entry_key(head_dim: int, causal: bool, config: Mapping[str, int]) -> str:
    """The table's key: ``d128-causal-BLOCK_M=64,BLOCK_N=128,NUM_STAGES=2,NUM_CONSUMERS=2,
    LPT=0``."""
    knobs = ",".join(f"{name}={int(config.get(name, DEFAULTS.get(name, 0)))}"
                     for name in COMPILED)
    return f"d{head_dim}-{'causal' if causal else 'full'}-{knobs}"


def structural_reason(config: Mapping[str, int], head_dim: int | None = None) -> str | None:
    """What the kernel's static asserts refuse (never compiled, not in the table): at a
    ``head_dim`` whose consumers split it, any config but :data:`SPLIT_D_CONFIG`'s shape
    (``launcher.split_d_reason``); else fewer than 64 keys a consumer."""
    if head_dim is not None and split_d(head_dim):
        return split_d_reason(config, head_dim)
    if config["BLOCK_N"] // config["NUM_CONSUMERS"] < 64:
        return (f"BLOCK_N {config['BLOCK_N']} over {config['NUM_CONSUMERS']} consumers leaves "
                f"fewer than 64 keys a warpgroup (a wgmma's rows)")
    return None


def _entry(raw: Any, where: str) -> tuple[str, Compiled]:
    fields = {"head_dim", "causal", "config", "shared", "registers", "spill_bytes", "error"}
    # ir_hash (optional): sm90_table.parse_table checks it
    if not isinstance(raw, dict) or set(raw) - {"ir_hash"} != fields:
        raise ValueError(f"{where}: an entry is an object with the keys {sorted(fields)} "
                         f"(and ir_hash)")
    config = sm90_table.entry_config(raw, COMPILED, where)
    if type(raw["head_dim"]) is not int or type(raw["causal"]) is not bool:
        raise ValueError(f"{where}: head_dim int and causal bool, got {raw['head_dim']!r}, "
                         f"{raw['causal']!r}")
    return (entry_key(raw["head_dim"], raw["causal"], config),
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
    return sm90_table.read_table(path, "attn_bwd_gluon", REGENERATE, parse_table)


def check(config: Mapping[str, int], problem: AttentionProblem,
          device: DeviceFingerprint) -> str | None:
    """Why ``config`` cannot (or should not) run ``problem`` on ``device``; None if it can:
    the structural rule, the head dim, then the sm_90 compile table's verdict."""
    if problem.head_dim not in HEAD_DIMS:
        return f"head_dim {problem.head_dim}: the Gluon backward serves {list(HEAD_DIMS)}"
    reason = structural_reason(config, problem.head_dim)
    if reason is not None:
        return reason
    if config.get("PERSISTENT") and problem.packed:
        return "PERSISTENT serves dense batches only (a packed batch runs the grid launch)"
    if config.get("EXPAND_GQA") and (problem.packed or problem.heads_q == problem.heads_kv):
        return "EXPAND_GQA runs a dense GQA problem per query head (MHA has one a KV head; a " \
               "packed batch walks its groups)"
    compiled = load_table().get(entry_key(problem.head_dim, problem.causal, config))
    if compiled is None:
        return f"not in the sm_90 compile table ({TABLE.name}); regenerate it: {REGENERATE}"
    return compiled.reason(sm90_table.smem_limit(device))


SPACE = SearchSpace(params=PARAMS, predicate=check, defaults=DEFAULTS)


def _knobs(bm: int, bn: int, stages: int, consumers: int) -> Config:
    return {"BLOCK_M": bm, "BLOCK_N": bn, "NUM_STAGES": stages, "NUM_CONSUMERS": consumers,
            "LPT": 0, "PERSISTENT": 0, "DQ_TMA": 0, "TMA_STORE": 0, "EXPAND_GQA": 0}


# per head dim, best guess first (FA3's sm90 backward: 64 x 128 tiles at D128 with two MMA
# warpgroups, 128 x 128 at D64); the first the predicate accepts is the default. Untimed:
# the GPU benchmark decides (benchmarks/bench_bwd.py --gluon)
_DEFAULTS: dict[int, tuple[Config, ...]] = {
    64: (_knobs(64, 128, 2, 2), _knobs(128, 128, 2, 2), _knobs(64, 64, 2, 1)),
    128: (_knobs(64, 128, 2, 2), _knobs(64, 64, 2, 1), _knobs(64, 64, 3, 1)),
    256: (_knobs(64, 64, 2, 2),),  # the split-D kernel's one shape (FA3's hdim 256: 64 x 80)
}


def lpt_by_default(problem: AttentionProblem) -> bool:
    """Whether the default walks the longest key blocks first (``LPT`` 1): under a causal
    mask, where the walks' lengths differ (packed batches: GQA only). On the H100 it ran
    1.03-1.11x ``LPT`` 0 at D128 on four causal GQA shapes (28:4, 32:8, 64:8; N 2k-16k) and
    0.98-1.01x on MHA (benchmarks/results/bwd_lpt_h100.json). On an H200, with sections
    that count the dQ accumulator (``lpt_sections_{new,gqa}_h200.json``, the main kernel
    against ``LPT`` 0): GQA 4:1 D128 N 1k / 4k 1.07x / 1.04x; GQA 4:1 D64 (with the TMA
    stores, which spill nothing there) 1.10x / 1.13x; MHA D128 0.95-1.00x, until the
    one-head walks' sections were sized for 16 MiB (``launcher.L2_BUDGET_ONE_HEAD``): then
    MHA D128 N 512 / 1k / 2k / 4k / 8k 0.99x / 1.01x / 1.03x / 1.03x / 1.04x, and D64 from
    4k (the grid launch) 1.02x / 1.01x at N 4k / 8k
    (``lpt_sections_b16_d128c_h200.json``, ``lpt_b16_d64c_h200.json``)."""
    return problem.causal and (problem.heads_q > problem.heads_kv or not problem.packed)


# the longest query lengths whose walks the default runs persistent, without and with a
# causal mask (see persistent_by_default)
PERSISTENT_MAX_SEQLEN = {False: 2048, True: 2048}


def persistent_by_default(problem: AttentionProblem) -> bool:
    """Whether the default runs ``PERSISTENT`` (with ``LPT`` 1 under a causal mask, where a
    static stride over the grid's order would hand some CTAs only long walks): dense MHA
    batches at D64 with at most :data:`PERSISTENT_MAX_SEQLEN` queries, where a CTA walks
    few steps and a grid launch pays its ramp and epilogue per tile. On an H200, two runs of
    the standard grid's D64 shapes against the grid launch's main kernel
    (``benchmarks/results/train_breakdown_d64_h200.json``, ``defaults_d64_*_h200.json``):
    without a mask 1.10-1.11x at N 512, 1.04-1.05x at 1k, 1.00-1.02x at 2k, 0.97-1.00x at
    4k; causal 1.10-1.12x, 1.07x, 1.05-1.06x, 1.03x; from 8k 0.95-1.01x (a walk long
    enough to hide its tile's start). Since the causal walks at D64 run the mask's diagonal
    last (``kernel.DIAGONAL_LAST_MAX_D``), the grid launch's main kernel runs faster and
    passed the persistent one at causal N 4k: 0.971x against 0.942x cuDNN's in one run
    (``bwd_diag_last_d64{,p}_h200.json``); the re-timed table took the grid launch at 2k
    too, by 1%: persistent causal up to 2k. GQA 4:1 (``train_breakdown_d64_gqa_h200.json``,
    causal N 1k / 4k): the step 0.90x / 0.85x, not by default. At D128 the persistent loop
    spills in the consumers' main loop (the tile loop keeps shared-memory descriptors live:
    152-312 B against 112) and its main kernel ran 0.62-0.99x the grid launch's
    (``train_breakdown_persistent_h200.json``): the grid launch there. The tuner times the
    knob wherever it compiles within budget."""
    return (problem.head_dim == 64 and not problem.packed
            and problem.heads_q == problem.heads_kv
            and problem.seqlen_q <= PERSISTENT_MAX_SEQLEN[problem.causal])


def dq_tma_by_default(problem: AttentionProblem) -> bool:
    """Whether the default adds dQ by TMA reduce-adds (``DQ_TMA`` 1): D128 without a mask.
    On an H200 (``benchmarks/results/train_breakdown_dq_tma_h200.json``, the grid launch
    of the D128 default) the main kernel ran 1.026x / 1.031x / 1.036x the atomics' at N 512
    / 1k / 4k (again, ``defaults_d128_full_h200.json``: 1.03x / 1.03x / 1.04x / 1.02x at N
    512-4k, 0.99x at 8k, 1.05x at 16k), and causal 1.010x / 0.985x / 0.990x; at D64 (the
    persistent default) 0.91-0.96x:
    a step there is shorter than the writer's wait for its reduce-adds to read the one
    buffer."""
    return problem.head_dim == 128 and not problem.causal


def tma_store_by_default(problem: AttentionProblem) -> bool:
    """Whether the default stores dK and dV through shared memory by TMA (``TMA_STORE`` 1):
    dense batches. A grid launch's CTA spent most of its fixed time storing dK and dV from
    registers (``benchmarks/results/bwd_ablation_full_h200.json``: at D128 8.1 us a CTA
    besides its steps, 2.2 us with those stores masked off). With the knob, on an H200
    (``train_breakdown_tma_store_{d128,d64,gqa}_h200.json``, against the default without
    it): the D128 main kernel 1.15x / 1.09x / 1.00x at N 512 / 1k / 4k, causal 1.18x /
    1.11x / 1.03x, the step 0.91x -> 0.99x cuDNN's at N512 (causal 0.85x -> 0.93x); D64
    (the persistent default) and GQA 4:1 1.00-1.02x. Not the default for packed batches:
    0.95x there (``packed_bwd_tma_store_h200.json``, most blocks short or cut by a
    document's end). Under a persistent launch at D128 the main kernel ran 0.77-0.92x the
    grid launch's (the next tile's K and V wait for the stores), and D128 is not persistent
    by default."""
    return not problem.packed


# EXPAND_GQA's rule (see expand_gqa_by_default): the query heads' bytes a CTA walks
# (group x head dim, fp16/bf16 Q and dO with the fp32 dQ accumulator) and the walk's length
EXPAND_MIN_GROUP_DIM = 512
EXPAND_MIN_WORK = 1 << 21  # group x head dim x seqlen_q


def expand_gqa_by_default(problem: AttentionProblem) -> bool:
    """Whether the default runs a GQA problem per query head (``EXPAND_GQA`` 1): dense
    causal GQA whose grid, walking each group in one CTA, keeps more query rows in flight
    than L2 holds, with walks long enough to pay for the group sums after. A grid launch
    holds about 132 x 128 keys' worth of KV heads in flight, each reading ``group`` query
    heads' Q, dO and dQ accumulator (8 bytes an element): about ``group x D x 135 KB``,
    69 MB at 4:1 D128 or 8:1 D64, against 50 MB of L2. On an H200 (the main kernel against
    cuDNN's backward, ``benchmarks/results/expand_g{4,8}_d{64,128}_h200.json``): 8:1 D128
    N 2k / 8k 0.65x / 0.68x -> 0.90x / 0.97x (the step 0.74x / 0.76x -> 0.89x / 0.98x);
    4:1 D128 N 1k / 2k / 4k / 8k the step 0.93 / 0.89 / 0.88 / 0.89x -> 0.82 / 0.87 /
    0.92 / 0.96x; 8:1 D64 N 2k / 8k 0.95 / 0.88x -> 0.97 / 0.99x; 4:1 D64 (35 MB, fits)
    1.10 / 1.01 / 1.03x -> 0.94 / 0.95 / 0.98x at N 1k / 4k / 8k. The sums cost 60-80 us
    a step at 16k tokens: paid back from ``group x D x seqlen_q`` of 2M (4:1 D128 at 4k,
    8:1 D128 at 2k). With this rule (``expand_default_*_h200.json``): MQA 16:1 D128 N 1k /
    4k the main kernel 0.58x / 0.50x -> 0.83x / 0.94x. Without a mask the grouped walk kept
    up (8:1 D128 N 2k / 8k the step 1.03x / 1.01x cuDNN's, per query head 0.97x / 0.98x,
    ``expand_full_g8_h200.json``): a key block's CTAs then walk the group's heads in step,
    where under a causal mask each walks a head for as many blocks as it sees and they drift
    apart, so the default leaves it off there. Nor at D256, where the consumers split the
    head dim (``launcher.split_d``: 64-key blocks, dQ added by the consumers): on an H200,
    Gemma's 2:1 groups causal (``benchmarks/results/bwd_d256_gqa_h200.json``, the whole
    backward), 16:8 N 4k / 8k and 32:16 N 4k ran 1.07x / 1.04x / 1.07x faster grouped than per
    query head (the tuner took the grouped walk in all six D256 training steps it gave the
    Gluon pair)."""
    group = problem.heads_q // problem.heads_kv
    work = group * problem.head_dim
    return (problem.causal and not problem.packed and group > 1
            and not split_d(problem.head_dim)
            and work >= EXPAND_MIN_GROUP_DIM and work * problem.seqlen_q >= EXPAND_MIN_WORK)


def default_config(problem: AttentionProblem, device: DeviceFingerprint) -> Config:
    """A safe config for ``problem``: the first of its head dim's defaults the predicate
    accepts (the first one when none is: the predicate names why), with dQ by TMA where
    :func:`dq_tma_by_default` says so, persistent where :func:`persistent_by_default` says
    so, else longest-first where :func:`lpt_by_default` says so, then dK and dV by TMA where
    :func:`tma_store_by_default` says so, and per query head where
    :func:`expand_gqa_by_default` says so, each where it compiles within budget (the order
    is the measured gains'; at D128 causal GQA longest-first with the TMA stores spilled
    268 B, over budget, until the epilogue's addresses stopped spilling: 104 B now, and the
    re-timed H200 table took both on 8 of its 9 causal GQA D128 shapes)."""
    defaults = _DEFAULTS.get(problem.head_dim, _DEFAULTS[128])
    for base in defaults:
        config = base
        if dq_tma_by_default(problem) and check({**base, "DQ_TMA": 1}, problem, device) is None:
            config = {**base, "DQ_TMA": 1}
        if check(config, problem, device) is None:
            persistent = {**config, "PERSISTENT": 1, "LPT": int(problem.causal)}
            lpt = {**config, "LPT": 1}
            if persistent_by_default(problem) and check(persistent, problem, device) is None:
                config = persistent
            elif lpt_by_default(problem) and check(lpt, problem, device) is None:
                config = lpt
            stored = {**config, "TMA_STORE": 1}
            if tma_store_by_default(problem) and check(stored, problem, device) is None:
                config = stored
            expand = {**config, "EXPAND_GQA": 1}
            if expand_gqa_by_default(problem) and check(expand, problem, device) is None:
                config = expand
            return dict(config)
    return dict(defaults[0])

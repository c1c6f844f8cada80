"""attn_fwd's search space as data, its validity predicate and its default config."""

from __future__ import annotations

from collections.abc import Mapping

from flashtune.core.device import DeviceFingerprint
from flashtune.core.problem import AttentionProblem
from flashtune.core.space import Config, SearchSpace
from flashtune.kernel_templates.head_tiles import d_tiles, saves_padding
from flashtune.kernel_templates.tma import tma_head_dim

# tiles, warps and software-pipelining depth: every GPU
BASE_PARAMS: dict[str, tuple[int, ...]] = {
    "BLOCK_M": (16, 32, 64, 128, 256),
    "BLOCK_N": (16, 32, 64, 128),
    "num_warps": (2, 4, 8),
    "num_stages": (1, 2, 3, 4, 5),
}
# Hopper knobs (see kernel.py); 0 = off, and off when left out of a config
KNOBS: dict[str, tuple[int, ...]] = {
    "USE_TMA": (0, 1),
    "REVERSE_M": (0, 1),
    # a head dim that is not a power of two as two tiles (96 = 64 + 32: head_tiles.d_tiles)
    "SPLIT_D": (0, 1),
}
PARAMS: dict[str, tuple[int, ...]] = {**BASE_PARAMS, **KNOBS}
DEFAULTS: dict[str, int] = {name: 0 for name in KNOBS}
# the tensor-copy engine (TMA) needs compute capability 9.0 or newer
TMA_MIN_CC = (9, 0)
# barrier and 1 KiB swizzle alignment the TMA path adds to shared memory (sm_90 compiler)
TMA_SMEM_EXTRA = 1024

# fp32 accumulator elements one thread may hold before the config is pruned as hopeless
# (it would spill to local memory): BLOCK_M x BLOCK_D / (32 x num_warps).
MAX_ACC_PER_THREAD = 256


def block_d(head_dim: int) -> int:
    """The tile's head dim: the next power of two of ``head_dim``, at least 16 (``tl.dot``'s
    smallest K). Every head dim 1..256 is served: the columns past ``head_dim`` are loaded
    as zeros (masked loads, or the tensor-copy engine's zero fill) and never stored, so
    D40 runs in 64-wide tiles, D80 and D111 in 128, D160 and D224 in 256."""
    return max(16, 1 << (head_dim - 1).bit_length())


def tma_refusal(problem: AttentionProblem, device: DeviceFingerprint) -> str | None:
    """Why ``USE_TMA`` cannot serve ``problem``'s head dim on ``device`` (None: it can): the
    tensor-copy engine wants rows of a 16-byte multiple (``kernel_templates.tma.tma_ok``),
    so under the interpreter a head dim that is not a multiple of 8 (fp16/bf16) runs plain,
    masked loads instead; on a GPU the launchers run it padded to the next multiple
    (``tma.pads_head_dim``), which TMA serves. The launchers also fall back to plain loads
    at run time for tensors whose strides are not aligned."""
    if tma_head_dim(problem.head_dim) or not device.is_interpreter:
        return None
    return (f"USE_TMA needs head_dim x 2 bytes to be a multiple of 16 (head_dim % 8 == 0), "
            f"got head_dim {problem.head_dim}: plain loads (USE_TMA 0) serve it")


def shared_mem_bytes(config: Mapping[str, int], head_dim: int, elem_size: int = 2) -> int:
    """Shared memory of one program, as ``triton.compile`` reports it for sm_90.

    The Q tile is staged in shared memory for the tensor cores, and the software pipeliner
    keeps ``num_stages`` K and V tiles in flight; the TMA path adds its barriers and a
    swizzle alignment (an upper bound). ``tests/kernel_templates_tests`` checks this formula
    against the compiler for several configs.
    """
    bd = sum(d_tiles(head_dim, config.get("SPLIT_D", 0)))
    bm, bn, stages = config["BLOCK_M"], config["BLOCK_N"], config["num_stages"]
    tiles = (bm * bd + max(1, stages) * 2 * bn * bd) * elem_size
    return tiles + (TMA_SMEM_EXTRA if config.get("USE_TMA", 0) else 0)


def check(config: Mapping[str, int], problem: AttentionProblem,
          device: DeviceFingerprint) -> str | None:
    """Why ``config`` cannot (or should not) run ``problem`` on ``device``; None if it can."""
    split_d = config.get("SPLIT_D", 0)
    bd = sum(d_tiles(problem.head_dim, split_d))
    if split_d and not saves_padding(problem.head_dim):
        return (f"SPLIT_D 1 cuts a head dim that is not a power of two; head_dim "
                f"{problem.head_dim} is one tile of {block_d(problem.head_dim)} either way")
    bm, bn, warps = config["BLOCK_M"], config["BLOCK_N"], config["num_warps"]  # noqa: F841
    if config.get("REVERSE_M", 0) and not problem.causal:
        return "REVERSE_M only reorders causal problems (no-op here)"
    if config.get("USE_TMA", 0):
        refusal = tma_refusal(problem, device)
        if refusal is not None:
            return refusal
        cc = device.capability
        if not device.is_interpreter and (cc is None or cc < TMA_MIN_CC):
            return (f"USE_TMA needs compute capability >= {TMA_MIN_CC[0]}.{TMA_MIN_CC[1]}, "
                    f"the device has {device.compute_capability}")
    acc_per_thread = bm * bd // (32 * warps)
    if acc_per_thread > MAX_ACC_PER_THREAD:
        return (f"BLOCK_M x BLOCK_D = {bm}x{bd} over {warps} warps holds {acc_per_thread} fp32 "
                f"accumulators per thread (> {MAX_ACC_PER_THREAD}): would spill")
    if not device.is_interpreter:
        smem = shared_mem_bytes(config, problem.head_dim)
        if smem > device.shared_mem_per_block:
            return (f"needs ~{smem} B of shared memory, the device allows "
                    f"{device.shared_mem_per_block} B per block")
    return None


SPACE = SearchSpace(params=PARAMS, predicate=check, defaults=DEFAULTS)

_DEFAULTS: tuple[tuple[int, Config], ...] = (
    # (max head_dim, config) in increasing head_dim; measured on an H100 without TMA
    (64, {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3}),
    (128, {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3}),
    (256, {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4, "num_stages": 2}),
)
_DEFAULTS_TMA: tuple[tuple[int, Config], ...] = (
    # with the tensor-copy engine (compute capability >= 9.0): the configs that were fastest
    # or within 2% of it on most shapes of benchmarks/results/explore_fwd_knobs_h100.json
    (64, {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 4, "num_stages": 3, "USE_TMA": 1}),
    (128, {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 3, "USE_TMA": 1}),
    (256, {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4, "num_stages": 2, "USE_TMA": 1}),
)
# with the tensor-copy engine, a head dim between 64 and 128 that two tiles cover with less
# padding than one (D96 = 64 + 32, D80 = 64 + 16: head_tiles.d_tiles; below 64 unmeasured).
# On an H200 (bf16, benchmarks/results/fwd_split_d_h200.json: Phi-3's 32:32 D96 at B1 x 2048
# and 4096 causal and B4 x 2048, Phi-2-like D80 at B4 x 2048 causal; cold L2) it was the
# fastest of 8 configs at each, 1.06 / 1.09 / 1.19 / 1.23x the D128 row's config with one
# tile (0.89 / 0.96 / 0.96 / 0.99x cuDNN); with one tile these tiles were the slower
# (0.91-0.93x)
_DEFAULT_TWO_TILES: Config = {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3,
                              "USE_TMA": 1, "SPLIT_D": 1}

# a head dim that is not a multiple of 8 under the interpreter (no TMA; its rows are not
# 16-byte aligned, so the loads cannot be vectorised and their addresses take registers; on
# a GPU the launchers pad it and it takes the tables above): the configs of the tables
# above spill there, these compile without spills for sm_90 (D59, D111 and D250, causal;
# `python -m flashtune.kernel_templates.sm90`)
_DEFAULTS_UNALIGNED: tuple[tuple[int, Config], ...] = (
    (64, {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3}),
    (128, {"BLOCK_M": 128, "BLOCK_N": 32, "num_warps": 8, "num_stages": 3}),
    (256, {"BLOCK_M": 64, "BLOCK_N": 16, "num_warps": 4, "num_stages": 2}),
)


def default_config(problem: AttentionProblem, device: DeviceFingerprint) -> Config:
    """A safe config for ``problem``: the head-dim default for the device (TMA on Hopper and
    newer, where a head dim between 64 and 128 that is not a power of two runs as two tiles,
    ``_DEFAULT_TWO_TILES``; plain loads and tiles of their own for a head dim TMA cannot
    serve, see :func:`tma_refusal`; reversed tile order under a causal mask), shrunk until
    the device takes it. A head dim between two rows of a table takes the larger's config
    (with one tile, the same BLOCK_D: D112 runs D128's tiles)."""
    cc = device.capability
    if tma_refusal(problem, device) is not None:
        table = _DEFAULTS_UNALIGNED
    elif cc is not None and cc >= TMA_MIN_CC:
        table = _DEFAULTS_TMA
    else:
        table = _DEFAULTS
    cfg = next((c for max_d, c in table if problem.head_dim <= max_d), table[-1][1])
    d = problem.head_dim
    if table is _DEFAULTS_TMA and 64 < d < 128 and saves_padding(d):
        cfg = _DEFAULT_TWO_TILES
    config = {**DEFAULTS, **cfg, "REVERSE_M": int(problem.causal)}
    if problem.dropout > 0 and table is _DEFAULTS_TMA and problem.head_dim <= 64:
        # the dropout mask's registers on top of a 128 x 128 score tile at 4 warps spill
        # for sm_90 (D64: 100 B at 255 registers; D32: 848 B); 64 keys at 8 warps take 128
        # and none. H100, BERT-base B32 H12 N512 D64 dropout 0.1, `bench_dropout.py
        # --tune-ops` (benchmarks/README.md "Attention dropout"): this config was the
        # fastest of 65 forward trials, 0.100 ms against the old default's 0.111
        config.update(BLOCK_N=64, num_warps=8)
    while check(config, problem, device) is not None:
        if config["num_stages"] > 1:
            config["num_stages"] -= 1
        elif config["BLOCK_N"] > 16:
            config["BLOCK_N"] //= 2
        elif config["BLOCK_M"] > 16:
            config["BLOCK_M"] //= 2
        else:
            break
    return config

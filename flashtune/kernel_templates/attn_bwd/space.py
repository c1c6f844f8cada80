"""attn_bwd's search space as data, its validity predicate and its default config."""

from __future__ import annotations

from collections.abc import Mapping

from flashtune.core.device import DeviceFingerprint
from flashtune.core.problem import AttentionProblem
from flashtune.core.space import Config, SearchSpace
from flashtune.kernel_templates.attn_fwd.space import (
    TMA_MIN_CC,
    TMA_SMEM_EXTRA,
    block_d,
    tma_refusal,
)
from flashtune.kernel_templates.head_tiles import d_tiles, saves_padding

BASE_PARAMS: dict[str, tuple[int, ...]] = {
    "BLOCK_M1": (16, 32, 64, 128),   # dK/dV kernel: query rows per step
    "BLOCK_N1": (16, 32, 64, 128),   # dK/dV kernel: keys a program owns
    "BLOCK_M2": (16, 32, 64, 128),   # dQ kernel: queries a program owns
    "BLOCK_N2": (16, 32, 64, 128),   # dQ kernel: keys per step
    "num_warps": (2, 4, 8),
    "num_stages": (1, 2, 3, 4, 5),
}
# optional knobs (see kernel.py); the default when left out of a config
KNOBS: dict[str, tuple[int, ...]] = {
    "SPLIT_LOOPS": (0, 1),  # unmasked blocks in loops of their own
    "KV_SPLITS": (1, 2, 4, 8),  # dK/dV programs per key tile over slices of the GQA group
    "USE_TMA": (0, 1),  # streamed tiles through tensor descriptors (compute capability >= 9)
    "REVERSE_DQ": (0, 1),  # causal: dQ programs take query tiles last-first (longest first)
    "ONE_LAUNCH": (0, 1),  # the dK/dV and dQ programs in one grid (dQ fills dK/dV's tail)
    # dropout: the dK/dV kernel stores its keep mask as bits, the dQ kernel reads them instead
    # of drawing Philox again (a scratch of Nq x Nk bits per query head during the backward)
    "DROPOUT_BITS": (0, 1),
    # a head dim that is not a power of two as two tiles (96 = 64 + 32: head_tiles.d_tiles)
    "SPLIT_D": (0, 1),
}
PARAMS: dict[str, tuple[int, ...]] = {**BASE_PARAMS, **KNOBS}
DEFAULTS: dict[str, int] = {"SPLIT_LOOPS": 0, "KV_SPLITS": 1, "USE_TMA": 0, "REVERSE_DQ": 0,
                            "ONE_LAUNCH": 0, "DROPOUT_BITS": 0, "SPLIT_D": 0}
# fp32 accumulators a thread may hold (dK + dV tiles, or the dQ tile) before the config is
# pruned as hopeless (it would spill to local memory)
MAX_ACC_PER_THREAD = 256
# bf16 tensor-core dots (and cp.async pipelining) need compute capability 8.0
BF16_MIN_CC = (8, 0)


def shared_mem_bytes(config: Mapping[str, int], head_dim: int, elem_size: int = 2) -> int:
    """Shared memory of the larger of the two main kernels, as ``triton.compile`` reports it
    for sm_90.

    Each keeps its owned tiles resident (K and V of BLOCK_N1 keys; Q and dO of BLOCK_M2
    queries) and the software pipeliner keeps ``num_stages`` tiles of the two streamed
    operands in flight; the dK/dV kernel also stages the streamed LSE and delta (rounded up
    to 1 KiB). For owned tiles of 64 rows and more (the wgmma path) this is the compiler's
    figure or at most 1 KiB above it (``tests/kernel_templates_tests`` checks it against the
    compiler); smaller owned tiles take the mma.sync path, which the formula overestimates
    for ``num_stages >= 2`` and underestimates by up to 8 KiB for ``num_stages = 1`` (tiles
    far below any limit).
    """
    bd = sum(d_tiles(head_dim, config.get("SPLIT_D", 0)))
    stages = max(1, config["num_stages"])
    bm1, bn1, bm2, bn2 = (config[n] for n in ("BLOCK_M1", "BLOCK_N1", "BLOCK_M2", "BLOCK_N2"))
    rows = -(-max(1, stages - 1) * bm1 * 8 // 1024) * 1024
    dkdv = (2 * bn1 * bd + stages * 2 * bm1 * bd) * elem_size + rows
    dq = (2 * bm2 * bd + stages * 2 * bn2 * bd) * elem_size
    return max(dkdv, dq) + (TMA_SMEM_EXTRA if config.get("USE_TMA", 0) else 0)


# DROPOUT_BITS' scratch past this is refused (the bits of B x Hq x Nq x Nk scores)
MAX_DROPOUT_BITS_BYTES = 1 << 30


def dropout_bits_words(config: Mapping[str, int], seqlen_q: int,
                       seqlen_k: int) -> tuple[int, int]:
    """``(words, nkb)`` of DROPOUT_BITS' int32 bit array per query head: ``seqlen_q`` and
    ``seqlen_k`` (the longest sequences of a packed batch) padded to both kernels' tiles,
    in blocks of 64 queries by 32 keys (64 words each), ``nkb`` key blocks a row of blocks
    (layout: ``attn_bwd/kernel.py``, ``_bits_offsets``)."""
    pad_q = max(config["BLOCK_M1"], config["BLOCK_M2"], 64)
    pad_k = max(config["BLOCK_N1"], config["BLOCK_N2"], 32)
    nqb = -(-seqlen_q // pad_q) * pad_q // 64
    nkb = -(-seqlen_k // pad_k) * pad_k // 32
    return nqb * nkb * 64, nkb


def dropout_bits_refusal(config: Mapping[str, int], has_dropout: bool) -> str | None:
    """Why ``config``'s DROPOUT_BITS cannot run (None: it can, or it is off)."""
    if not config.get("DROPOUT_BITS", 0):
        return None
    if not has_dropout:
        return "DROPOUT_BITS stores the dropout mask: the problem has no dropout"
    if config.get("ONE_LAUNCH", 0):
        return ("DROPOUT_BITS needs the dK/dV kernel (which writes the bits) to finish before "
                "the dQ kernel reads them: ONE_LAUNCH runs both in one launch")
    if config["BLOCK_M1"] % 64 or config["BLOCK_M2"] % 64:
        return (f"DROPOUT_BITS needs query tiles of 64 or more (whole 64-query words): "
                f"BLOCK_M1 {config['BLOCK_M1']}, BLOCK_M2 {config['BLOCK_M2']}")
    if config["BLOCK_N1"] % 32 or config["BLOCK_N2"] % 32:
        return (f"DROPOUT_BITS needs key tiles of 32 or more (whole 32-key words): "
                f"BLOCK_N1 {config['BLOCK_N1']}, BLOCK_N2 {config['BLOCK_N2']}")
    return None


def check(config: Mapping[str, int], problem: AttentionProblem,
          device: DeviceFingerprint) -> str | None:
    """Why ``config`` cannot (or should not) run ``problem`` on ``device``; None if it can."""
    split_d = config.get("SPLIT_D", 0)
    bd = sum(d_tiles(problem.head_dim, split_d))
    if split_d and not saves_padding(problem.head_dim):
        return (f"SPLIT_D 1 cuts a head dim that is not a power of two; head_dim "
                f"{problem.head_dim} is one tile of {block_d(problem.head_dim)} either way")
    threads = 32 * config["num_warps"]
    dkdv_acc = 2 * config["BLOCK_N1"] * bd // threads
    dq_acc = config["BLOCK_M2"] * bd // threads
    if max(dkdv_acc, dq_acc) > MAX_ACC_PER_THREAD:
        which = "dK/dV" if dkdv_acc >= dq_acc else "dQ"
        return (f"the {which} kernel holds {max(dkdv_acc, dq_acc)} fp32 accumulators per "
                f"thread (> {MAX_ACC_PER_THREAD}) at {config['num_warps']} warps: would spill")
    if config.get("REVERSE_DQ", 0) and not problem.causal:
        return "REVERSE_DQ only reorders causal problems (no-op here)"
    refusal = dropout_bits_refusal(config, problem.dropout > 0)
    if refusal is not None:
        return refusal
    if config.get("DROPOUT_BITS", 0):
        words, _ = dropout_bits_words(config, problem.seqlen_q, problem.seqlen_k)
        scratch = 4 * words * problem.batch * problem.heads_q
        if scratch > MAX_DROPOUT_BITS_BYTES:
            return (f"DROPOUT_BITS' scratch would hold {scratch} B (> "
                    f"{MAX_DROPOUT_BITS_BYTES}): regenerate the mask instead")
    if config.get("USE_TMA", 0):
        refusal = tma_refusal(problem, device)  # an unaligned head dim, interpreted
        if refusal is not None:
            return refusal
    if device.is_interpreter:
        return None
    cc = device.capability
    if problem.dtype == "bf16" and cc is not None and cc < BF16_MIN_CC:
        return (f"bf16 needs compute capability >= {BF16_MIN_CC[0]}.{BF16_MIN_CC[1]}, the device "
                f"has {device.compute_capability}")
    if config.get("USE_TMA", 0) and (cc is None or cc < TMA_MIN_CC):
        return (f"USE_TMA needs compute capability >= {TMA_MIN_CC[0]}.{TMA_MIN_CC[1]}, the "
                f"device has {device.compute_capability}")
    smem = shared_mem_bytes(config, problem.head_dim)
    if smem > device.shared_mem_per_block:
        return (f"needs ~{smem} B of shared memory, the device allows "
                f"{device.shared_mem_per_block} B per block")
    return None


SPACE = SearchSpace(params=PARAMS, predicate=check, defaults=DEFAULTS)

_DEFAULTS: tuple[tuple[int, Config], ...] = (
    # (max head_dim, config): FlashAttention-2's shape (short query steps against many owned
    # keys for dK/dV, the transpose for dQ). D64 and D128: the fastest tiles of a per-kernel
    # sweep on 4 standard-grid shapes on the H100, then SPLIT_LOOPS measured both ways
    # (benchmarks/results/explore_bwd_h100.json: D128 1.4x, D64 1.0-1.1x the first
    # version's default); ONE_LAUNCH at D128 only (benchmarks/results/bwd_one_launch_h100.json:
    # 1.02x full, 1.04x causal at D128; 0.91x at D64);
    # 128 < D <= 256 (256-wide tiles): steps of 16 at one stage (the first default) spill for
    # sm_90 (dK/dV 116 B at 255 registers); steps of 32 at three stages compile without
    # (dK/dV 246 registers, dQ 148; 160 KiB of shared memory in each kernel). H100, D224
    # N4096 causal, backward alone, one run (benchmarks/results/bwd_sweep_d224_h100.json):
    # 2.52x the first default, 1.14x two stages; dQ key steps of 64 or dK/dV query steps of
    # 64 at two stages were 2% faster (one kernel then holds 192 KiB, the other 128, and the
    # dK/dV one spills 20 B at 64).
    (64, {"BLOCK_M1": 64, "BLOCK_N1": 128, "BLOCK_M2": 128, "BLOCK_N2": 32,
          "num_warps": 4, "num_stages": 3, "SPLIT_LOOPS": 1}),
    (128, {"BLOCK_M1": 64, "BLOCK_N1": 128, "BLOCK_M2": 128, "BLOCK_N2": 64,
           "num_warps": 8, "num_stages": 3, "SPLIT_LOOPS": 0, "ONE_LAUNCH": 1}),
    (256, {"BLOCK_M1": 32, "BLOCK_N1": 64, "BLOCK_M2": 64, "BLOCK_N2": 32,
           "num_warps": 8, "num_stages": 3, "SPLIT_LOOPS": 0}),
)
# small tiles keep the interpreter's per-block numpy work cheap
_INTERPRETER: Config = {"BLOCK_M1": 16, "BLOCK_N1": 32, "BLOCK_M2": 32, "BLOCK_N2": 16,
                        "num_warps": 2, "num_stages": 1}


# The dK/dV kernel runs cdiv(Nk, BLOCK_N1) * B * Hkv * KV_SPLITS programs, the dQ kernel
# cdiv(Nq, BLOCK_M2) * B * Hq; the standard grid (B x H >= 512) fills the GPU with the
# head-dim defaults, but GQA/MQA shapes with small batches do not. H100 measurements
# (benchmarks/results/explore_bwd_occupancy*_h100.json, explore_bwd_kv_splits_h100.json;
# benchmarks/README.md has the tables):
# * D64, BLOCK_N1 128 collapses on small grids (12 TFLOP/s with 32 programs, 44-74 with
#   128-256 made by KV_SPLITS) while BLOCK_N1 64 with KV_SPLITS 4 (256 programs) was the
#   fastest of every tile x split on both D64 GQA/MQA shapes (162 and 328 TFLOP/s); without
#   GQA to split, BLOCK_N1 32 (B1 H8 N512: 25 vs 15 TFLOP/s at 128).
# * D128, BLOCK_N1 128 stays the fastest tile; KV_SPLITS 2 paid wherever the grid was under
#   the SM count (48-128 -> 96-256 programs: 1.03-1.5x, the best split on 4 of 5 such shapes)
#   and KV_SPLITS 4 was slower than 2 on every D128 shape measured (the fp32 partials are
#   written and read once more per split); above the SM count splits gain or lose a few %.
# * D64 (4 warps), KV_SPLITS 4 was the best split on all three GQA/MQA shapes (256-512
#   programs), 8 worse.
# * dQ: at D64, BLOCK_M2 64 beat 128 by 5% (128 -> 256 programs) and 19% (32 -> 64); at D128
#   BLOCK_M2 128 won everywhere, by 36% with 96 programs against 64's 188.
MIN_BLOCK_N1 = 32
MIN_BLOCK_M2 = 64


def fill_the_gpu(config: Config, problem: AttentionProblem, sm_count: int) -> Config:
    """``config`` reshaped so that both kernels' grids fill ``sm_count`` SMs (fitted to the
    measurements above): at D <= 64, BLOCK_N1 to 64 while the dK/dV grid is under half the
    SM count, then KV_SPLITS doubled (within the GQA group, up to 4) while it is under
    twice the SM count; at D > 64, KV_SPLITS 2 (an even group) while it is under the SM
    count; then BLOCK_N1 halved (to 32) while under half; and (D <= 64) BLOCK_M2 halved (to
    64) while the dQ grid is under the SM count."""
    config = dict(config)
    b, group = problem.batch, problem.heads_q // problem.heads_kv

    def dkdv_programs() -> int:
        splits = config.get("KV_SPLITS", 1)
        return -(-problem.seqlen_k // config["BLOCK_N1"]) * b * problem.heads_kv * splits

    def dq_programs() -> int:
        return -(-problem.seqlen_q // config["BLOCK_M2"]) * b * problem.heads_q

    small_d = problem.head_dim <= 64
    if small_d and dkdv_programs() < sm_count // 2:
        config["BLOCK_N1"] = min(config["BLOCK_N1"], 64)
    max_splits, target = (4, 2 * sm_count) if small_d else (2, sm_count)
    while dkdv_programs() < target and 2 * config.get("KV_SPLITS", 1) <= max_splits \
            and group % (2 * config.get("KV_SPLITS", 1)) == 0:
        config["KV_SPLITS"] = 2 * config.get("KV_SPLITS", 1)
    while dkdv_programs() < sm_count // 2 and config["BLOCK_N1"] > MIN_BLOCK_N1:
        config["BLOCK_N1"] //= 2
    while small_d and dq_programs() < sm_count and config["BLOCK_M2"] > MIN_BLOCK_M2:
        config["BLOCK_M2"] //= 2
    return config


def default_config(problem: AttentionProblem, device: DeviceFingerprint) -> Config:
    """A safe config for ``problem`` on ``device``: the head-dim default (the interpreter's
    small tiles under it; Q/dO and K/V through tensor descriptors on Hopper and newer, with
    dQ key steps of 64 at D <= 64 there and a head dim between 64 and 128 that is not a
    power of two as two tiles, ``SPLIT_D``; dQ tiles last-first where the dQ programs share the
    dK/dV programs' launch; a head dim between two rows of the table takes the larger's
    tiles, one that is not a multiple of 8 too: the launcher runs it padded, see
    ``kernel_templates.tma.pads_head_dim``), its owned tiles shrunk while a kernel would
    leave SMs idle (:func:`fill_the_gpu`), then shrunk until the predicate accepts it."""
    if device.is_interpreter:
        return {**DEFAULTS, **_INTERPRETER}
    config = {**DEFAULTS, **next((c for max_d, c in _DEFAULTS if problem.head_dim <= max_d),
                                 _DEFAULTS[-1][1])}
    if config["ONE_LAUNCH"] and problem.causal:
        # the longest dQ tiles first, so that they do not make the launch's tail: with
        # ONE_LAUNCH at D128 causal 1.047x the default against 1.037x without
        # (benchmarks/results/bwd_one_launch_h100.json); alone, 1.00x
        config["REVERSE_DQ"] = 1
    cc = device.capability
    if cc is not None and cc >= TMA_MIN_CC:
        # H100, one run over the 24-shape standard grid: 1.05x the plain-load default on
        # every shape (benchmarks/results/bwd_tma_h100.json)
        config["USE_TMA"] = 1
        # with TMA the D64 dQ kernel wants key steps of 64 (per-kernel sweep,
        # explore_bwd_d64_tma_h100.json): 1.03-1.08x on the 12 D64 shapes
        # (bwd_d64_variant_h100.json)
        if problem.head_dim <= 64:
            config["BLOCK_N2"] = max(config["BLOCK_N2"], 64)
        # a head dim between 64 and 128 that two tiles serve with less padding (D96 = 64 +
        # 32, D80 = 64 + 16: head_tiles.d_tiles) runs as two, at the D128 row's tiles. On
        # an H200 (bf16, backward alone, cold L2; benchmarks/results/bwd_split_d_h200.json:
        # Phi-3's 32:32 D96 at B2 x 4096 and B4 x 2048 causal, B4 x 2048 not causal,
        # Phi-2-like D80 at B4 x 2048 causal) 1.06 / 1.07 / 1.04 / 1.11x the one padded
        # tile, the fastest of 7 variants of these tiles at each shape (two tiles were
        # 1.00-1.17x one at every variant but one, 0.98x); still 0.75-0.79x cuDNN's
        d = problem.head_dim
        if 64 < d < 128 and saves_padding(d):
            config["SPLIT_D"] = 1
    if problem.dropout > 0 and problem.head_dim <= 64:
        # with dropout the D64 dK/dV tile of 128 keys at 4 warps spills (1716 B for sm_90:
        # the mask's registers on top of two 128x64 fp32 accumulators); 64 keys does not.
        # H100, BERT-base B32 H12 N512 D64 dropout 0.1, backward alone (one run,
        # benchmarks/README.md "Attention dropout"): 149 TFLOP/s against 95 (128 keys at
        # 8 warps: 140). With the mask built keys by queries (no fp32 conversion) the dQ
        # tile of 128 queries spills (292 B at 255 registers), 64 does not (158): backward
        # 191 TFLOP/s against 183 (benchmarks/results/dropout_v2_sweep_h100.json)
        config["BLOCK_N1"] = min(config["BLOCK_N1"], 64)
        config["BLOCK_M2"] = min(config["BLOCK_M2"], 64)
    config = fill_the_gpu(config, problem, device.sm_count)
    while check(config, problem, device) is not None:
        if config["num_stages"] > 1:
            config["num_stages"] -= 1
        elif config["BLOCK_N1"] > 16 or config["BLOCK_M2"] > 16:
            config["BLOCK_N1"] = max(16, config["BLOCK_N1"] // 2)
            config["BLOCK_M2"] = max(16, config["BLOCK_M2"] // 2)
        elif config["BLOCK_M1"] > 16 or config["BLOCK_N2"] > 16:
            config["BLOCK_M1"] = max(16, config["BLOCK_M1"] // 2)
            config["BLOCK_N2"] = max(16, config["BLOCK_N2"] // 2)
        else:
            break
    return config

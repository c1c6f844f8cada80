"""attn_bwd's search space as data, its validity predicate and its default config."""

from __future__ import annotations

from typing import Mapping

from flashtune.autotune.devices import DeviceFingerprint
from flashtune.autotune.problems import AttentionProblem
from flashtune.autotune.spaces import Config, SearchSpace
from flashtune.kernel_templates.attn_fwd.space import block_d

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
}
PARAMS: dict[str, tuple[int, ...]] = {**BASE_PARAMS, **KNOBS}
DEFAULTS: dict[str, int] = {"SPLIT_LOOPS": 0}
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
    bd = block_d(head_dim)
    stages = max(1, config["num_stages"])
    bm1, bn1, bm2, bn2 = (config[n] for n in ("BLOCK_M1", "BLOCK_N1", "BLOCK_M2", "BLOCK_N2"))
    rows = -(-max(1, stages - 1) * bm1 * 8 // 1024) * 1024
    dkdv = (2 * bn1 * bd + stages * 2 * bm1 * bd) * elem_size + rows
    dq = (2 * bm2 * bd + stages * 2 * bn2 * bd) * elem_size
    return max(dkdv, dq)


def _capability(device: DeviceFingerprint) -> tuple[int, int] | None:
    try:
        major, minor = device.compute_capability.split(".")
        return int(major), int(minor)
    except ValueError:
        return None


def check(config: Mapping[str, int], problem: AttentionProblem,
          device: DeviceFingerprint) -> str | None:
    """Why ``config`` cannot (or should not) run ``problem`` on ``device``; None if it can."""
    bd = block_d(problem.head_dim)
    threads = 32 * config["num_warps"]
    dkdv_acc = 2 * config["BLOCK_N1"] * bd // threads
    dq_acc = config["BLOCK_M2"] * bd // threads
    if max(dkdv_acc, dq_acc) > MAX_ACC_PER_THREAD:
        which = "dK/dV" if dkdv_acc >= dq_acc else "dQ"
        return (f"the {which} kernel holds {max(dkdv_acc, dq_acc)} fp32 accumulators per "
                f"thread (> {MAX_ACC_PER_THREAD}) at {config['num_warps']} warps: would spill")
    if device.is_interpreter:
        return None
    cc = _capability(device)
    if problem.dtype == "bf16" and cc is not None and cc < BF16_MIN_CC:
        return (f"bf16 needs compute capability >= {BF16_MIN_CC[0]}.{BF16_MIN_CC[1]}, the device "
                f"has {device.compute_capability}")
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
    # version's default);
    # D256: not measured.
    (64, {"BLOCK_M1": 64, "BLOCK_N1": 128, "BLOCK_M2": 128, "BLOCK_N2": 32,
          "num_warps": 4, "num_stages": 3, "SPLIT_LOOPS": 1}),
    (128, {"BLOCK_M1": 64, "BLOCK_N1": 128, "BLOCK_M2": 128, "BLOCK_N2": 64,
           "num_warps": 8, "num_stages": 3, "SPLIT_LOOPS": 0}),
    (256, {"BLOCK_M1": 16, "BLOCK_N1": 64, "BLOCK_M2": 64, "BLOCK_N2": 16,
           "num_warps": 8, "num_stages": 1, "SPLIT_LOOPS": 0}),
)
# small tiles keep the interpreter's per-block numpy work cheap
_INTERPRETER: Config = {"BLOCK_M1": 16, "BLOCK_N1": 32, "BLOCK_M2": 32, "BLOCK_N2": 16,
                        "num_warps": 2, "num_stages": 1}


# Owned tiles shrink (down to these) while a kernel's grid would leave the GPU idle: the
# dK/dV kernel runs cdiv(Nk, BLOCK_N1) * B * Hkv programs, the dQ kernel cdiv(Nq, BLOCK_M2)
# * B * Hq. H100, every owned-tile pair timed on 11 low-parallelism shapes
# (benchmarks/results/explore_bwd_occupancy_h100.json and ..._check_h100.json):
# * dK/dV: B2 Hq8 Hkv2 N1000 D64 and B1 Hq16 Hkv1 N4096 D64 ran at 12 TFLOP/s with
#   BLOCK_N1 128 (32 programs) and at 117 and 168 with BLOCK_N1 32 (128 programs); with 64
#   programs BLOCK_N1 64 beat 128 by 3-4% (D128); from 96 programs up BLOCK_N1 128 was the
#   fastest (D128, by 1.3-1.6x). So: at least half the SM count of programs.
# * dQ: at D64, BLOCK_M2 64 beat 128 by 5% (128 -> 256 programs) and 19% (32 -> 64); at D128
#   BLOCK_M2 128 won everywhere, by 36% with 96 programs against 64's 188. So: at D <= 64
#   only, at least the SM count of programs.
MIN_BLOCK_N1 = 32
MIN_BLOCK_M2 = 64


def fill_the_gpu(config: Config, problem: AttentionProblem, sm_count: int) -> Config:
    """``config`` with BLOCK_N1 halved while the dK/dV kernel would run fewer programs than
    half the SM count, and (head_dim <= 64) BLOCK_M2 while the dQ kernel would run fewer
    than the SM count; see the measurements above."""
    config = dict(config)
    b = problem.batch

    def dkdv_programs() -> int:
        return -(-problem.seqlen_k // config["BLOCK_N1"]) * b * problem.heads_kv

    def dq_programs() -> int:
        return -(-problem.seqlen_q // config["BLOCK_M2"]) * b * problem.heads_q

    while dkdv_programs() < sm_count // 2 and config["BLOCK_N1"] > MIN_BLOCK_N1:
        config["BLOCK_N1"] //= 2
    while problem.head_dim <= 64 and dq_programs() < sm_count \
            and config["BLOCK_M2"] > MIN_BLOCK_M2:
        config["BLOCK_M2"] //= 2
    return config


def default_config(problem: AttentionProblem, device: DeviceFingerprint) -> Config:
    """A safe config for ``problem`` on ``device``: the head-dim default (the interpreter's
    small tiles under it), its owned tiles shrunk while a kernel would leave SMs idle
    (:func:`fill_the_gpu`), then shrunk until the predicate accepts it."""
    if device.is_interpreter:
        return {**DEFAULTS, **_INTERPRETER}
    config = {**DEFAULTS, **next((c for max_d, c in _DEFAULTS if problem.head_dim <= max_d),
                                 _DEFAULTS[-1][1])}
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

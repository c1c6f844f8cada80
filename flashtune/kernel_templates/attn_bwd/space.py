"""attn_bwd's search space as data, its validity predicate and its default config."""

from __future__ import annotations

from typing import Mapping

from flashtune.autotune.devices import DeviceFingerprint
from flashtune.autotune.problems import AttentionProblem
from flashtune.autotune.spaces import Config, SearchSpace
from flashtune.kernel_templates.attn_fwd.space import block_d

PARAMS: dict[str, tuple[int, ...]] = {
    "BLOCK_M1": (16, 32, 64, 128),   # dK/dV kernel: query rows per step
    "BLOCK_N1": (16, 32, 64, 128),   # dK/dV kernel: keys a program owns
    "BLOCK_M2": (16, 32, 64, 128),   # dQ kernel: queries a program owns
    "BLOCK_N2": (16, 32, 64, 128),   # dQ kernel: keys per step
    "num_warps": (2, 4, 8),
    "num_stages": (1, 2, 3, 4, 5),
}
# fp32 accumulators a thread may hold (dK + dV tiles, or the dQ tile) before spilling
MAX_ACC_PER_THREAD = 256


def shared_mem_bytes(config: Mapping[str, int], head_dim: int, elem_size: int = 2) -> int:
    """An upper-bound model of one program's shared memory (the larger of the two main
    kernels): the resident tiles plus ``num_stages`` pipelined tiles of the streamed
    operands."""
    bd = block_d(head_dim)
    stages = max(1, config["num_stages"])
    dkdv = (2 * config["BLOCK_N1"] * bd + stages * 2 * config["BLOCK_M1"] * bd) * elem_size
    dq = (2 * config["BLOCK_M2"] * bd + stages * 2 * config["BLOCK_N2"] * bd) * elem_size
    return max(dkdv, dq)


def check(config: Mapping[str, int], problem: AttentionProblem,
          device: DeviceFingerprint) -> str | None:
    """Why ``config`` cannot (or should not) run ``problem`` on ``device``; None if it can."""
    bd = block_d(problem.head_dim)
    threads = 32 * config["num_warps"]
    dkdv_acc = 2 * config["BLOCK_N1"] * bd // threads
    dq_acc = config["BLOCK_M2"] * bd // threads
    if max(dkdv_acc, dq_acc) > MAX_ACC_PER_THREAD:
        return (f"{max(dkdv_acc, dq_acc)} fp32 accumulators per thread "
                f"(> {MAX_ACC_PER_THREAD}): would spill")
    if not device.is_interpreter:
        smem = shared_mem_bytes(config, problem.head_dim)
        if smem > device.shared_mem_per_block:
            return (f"needs ~{smem} B of shared memory, the device allows "
                    f"{device.shared_mem_per_block} B per block")
    return None


SPACE = SearchSpace(params=PARAMS, predicate=check)

_DEFAULTS: tuple[tuple[int, Config], ...] = (
    # (max head_dim, config): FlashAttention-2 / the Triton tutorial's tiles (small query
    # steps against many owned keys for dK/dV, the transpose for dQ)
    (64, {"BLOCK_M1": 32, "BLOCK_N1": 128, "BLOCK_M2": 128, "BLOCK_N2": 32,
          "num_warps": 4, "num_stages": 3}),
    (128, {"BLOCK_M1": 32, "BLOCK_N1": 128, "BLOCK_M2": 128, "BLOCK_N2": 32,
           "num_warps": 8, "num_stages": 2}),
    (256, {"BLOCK_M1": 16, "BLOCK_N1": 64, "BLOCK_M2": 64, "BLOCK_N2": 16,
           "num_warps": 8, "num_stages": 1}),
)
_INTERPRETER: Config = {"BLOCK_M1": 16, "BLOCK_N1": 32, "BLOCK_M2": 32, "BLOCK_N2": 16,
                        "num_warps": 2, "num_stages": 1}


def default_config(problem: AttentionProblem, device: DeviceFingerprint) -> Config:
    """A safe config for ``problem`` on ``device``, shrunk until the predicate accepts it."""
    if device.is_interpreter:
        return dict(_INTERPRETER)
    config = dict(next((c for max_d, c in _DEFAULTS if problem.head_dim <= max_d),
                       _DEFAULTS[-1][1]))
    while check(config, problem, device) is not None:
        if config["num_stages"] > 1:
            config["num_stages"] -= 1
        elif config["BLOCK_N1"] > 16:
            config["BLOCK_N1"] //= 2
            config["BLOCK_M2"] = max(16, config["BLOCK_M2"] // 2)
        else:
            break
    return config

"""attn_fwd's search space as data, its validity predicate and its default config."""

from __future__ import annotations

from typing import Mapping

from flashtune.autotune.devices import DeviceFingerprint
from flashtune.autotune.problems import AttentionProblem
from flashtune.autotune.spaces import Config, SearchSpace

PARAMS: dict[str, tuple[int, ...]] = {
    "BLOCK_M": (16, 32, 64, 128, 256),
    "BLOCK_N": (16, 32, 64, 128),
    "num_warps": (2, 4, 8),
    "num_stages": (1, 2, 3, 4, 5),
}

# fp32 accumulator elements one thread may hold before the config is pruned as hopeless
# (it would spill to local memory): BLOCK_M x BLOCK_D / (32 x num_warps).
MAX_ACC_PER_THREAD = 256


def block_d(head_dim: int) -> int:
    """Head dims that are not powers of two (96, 192) are padded to the next one in-kernel."""
    return max(16, 1 << (head_dim - 1).bit_length())


def shared_mem_bytes(config: Mapping[str, int], head_dim: int, elem_size: int = 2) -> int:
    """Shared memory of one program, as ``triton.compile`` reports it for sm_90.

    The Q tile is staged in shared memory for the tensor cores, and the software pipeliner
    keeps ``num_stages`` K and V tiles in flight (``tests/kernel_templates_tests`` checks
    this formula against the compiler for several configs).
    """
    bd = block_d(head_dim)
    bm, bn, stages = config["BLOCK_M"], config["BLOCK_N"], config["num_stages"]
    return (bm * bd + max(1, stages) * 2 * bn * bd) * elem_size


def check(config: Mapping[str, int], problem: AttentionProblem,
          device: DeviceFingerprint) -> str | None:
    """Why ``config`` cannot (or should not) run ``problem`` on ``device``; None if it can."""
    bd = block_d(problem.head_dim)
    bm, bn, warps = config["BLOCK_M"], config["BLOCK_N"], config["num_warps"]
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


SPACE = SearchSpace(params=PARAMS, predicate=check)

_DEFAULTS: tuple[tuple[int, Config], ...] = (
    # (max head_dim, config) in increasing head_dim
    (64, {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3}),
    (128, {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3}),
    (256, {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4, "num_stages": 2}),
)


def default_config(problem: AttentionProblem, device: DeviceFingerprint) -> Config:
    """A safe config for ``problem``: the head-dim default, shrunk until the device takes it."""
    for max_d, cfg in _DEFAULTS:
        if problem.head_dim <= max_d:
            config = dict(cfg)
            break
    else:  # pragma: no cover - head dims are validated before this
        config = dict(_DEFAULTS[-1][1])
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

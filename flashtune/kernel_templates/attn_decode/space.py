"""attn_decode's search space as data, its validity predicate and its default config.

The problem key is the :class:`~flashtune.core.problem.AttentionProblem` with
``seqlen_k`` = the cache's capacity (``Nmax`` for a contiguous cache, ``max_pages x
page_size`` for a paged one: metadata, no device sync) and the score modifications; under a
window with a left bound the splits cut only the window's keys (:func:`keys_seen`). ``NUM_SPLITS`` is a split *count*:
each sequence's own length is cut into that many chunks of whole ``BLOCK_N`` blocks, so a
config tuned for a capacity stays sensible for the ragged lengths actually in the cache.

Paged and contiguous caches share configs and the predicate: the kernel reads any page size
with any ``BLOCK_N`` (one page id per tile when ``page_size % BLOCK_N == 0``, one per key row
otherwise, see kernel.py), so no combination is invalid and the page size is not in the key.
"""

from __future__ import annotations

from collections.abc import Mapping

from flashtune.core.device import DeviceFingerprint
from flashtune.core.problem import AttentionProblem
from flashtune.core.space import Config, SearchSpace
from flashtune.kernel_templates.head_tiles import d_tiles, saves_padding

PARAMS: dict[str, tuple[int, ...]] = {
    "BLOCK_N": (16, 32, 64, 128),
    "NUM_SPLITS": (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128),
    "num_warps": (1, 2, 4, 8),
    "num_stages": (1, 2, 3, 4),
    # 1: a head dim that is not a power of two read as two tiles (D96 = 64 + 32, see
    # d_tiles), so no padded dim is loaded or multiplied
    "SPLIT_D": (0, 1),
}
# knobs a config may leave out: configs tuned before them run as they did
DEFAULTS: dict[str, int] = {"SPLIT_D": 0}

# query rows (GQA group x Nq) one program holds at most; more rows take more programs,
# each reading the group's K/V again
MAX_ROWS = 128
# fp32 accumulator elements (and K or V tile elements) one thread may hold before the
# config is pruned as hopeless (it would spill to local memory)
MAX_PER_THREAD = 256
# a split shorter than this many keys costs more in partials and the combine than it gains
MIN_SPLIT_KEYS = 256


def keys_seen(problem: AttentionProblem) -> int:
    """How many keys of a sequence the splits cut at most: ``seqlen_k``, or under a window
    with a left bound its span, ``left + seqlen_q`` (the kernel's splits start at the
    window's first key; the last query sees up to the end)."""
    if problem.window_left >= 0:
        return max(1, min(problem.seqlen_k, problem.window_left + problem.seqlen_q))
    return problem.seqlen_k


def block_d(head_dim: int) -> int:
    """Head dims that are not powers of two (96, 192) are padded to the next one in-kernel."""
    return max(16, 1 << (head_dim - 1).bit_length())


def rows(group: int, seqlen_q: int) -> int:
    """Query rows of one KV head: every query head of its GQA group times every query."""
    return group * seqlen_q


def block_m(group: int, seqlen_q: int) -> int:
    """Rows of one program's tile: all of a group's rows padded to a power of two >= 16
    (``tl.dot``'s minimum), at most :data:`MAX_ROWS`."""
    r = rows(group, seqlen_q)
    return min(MAX_ROWS, max(16, 1 << (r - 1).bit_length()))


def shared_mem_bytes(config: Mapping[str, int], bm: int, head_dim: int,
                     elem_size: int = 2) -> int:
    """Shared memory of one program: the Q tile plus ``num_stages`` K and V tiles in flight
    (same model as attn_fwd's, an estimate), the head dim's tiles as :func:`d_tiles` cuts
    them."""
    bd = sum(d_tiles(head_dim, config.get("SPLIT_D", 0)))
    bn, stages = config["BLOCK_N"], config["num_stages"]
    return (bm * bd + max(1, stages) * 2 * bn * bd) * elem_size


def check(config: Mapping[str, int], problem: AttentionProblem,
          device: DeviceFingerprint) -> str | None:
    """Why ``config`` cannot (or should not) run ``problem`` on ``device``; None if it can."""
    split_d = config.get("SPLIT_D", 0)
    bd = sum(d_tiles(problem.head_dim, split_d))
    if split_d and not saves_padding(problem.head_dim):
        return (f"SPLIT_D 1 cuts a head dim that is not a power of two; head_dim "
                f"{problem.head_dim} is one tile of {block_d(problem.head_dim)} either way")
    bm = block_m(problem.heads_q // problem.heads_kv, problem.seqlen_q)
    bn, splits, warps = config["BLOCK_N"], config["NUM_SPLITS"], config["num_warps"]
    threads = 32 * warps
    if bm * bd // threads > MAX_PER_THREAD:
        return (f"{bm} query rows x BLOCK_D {bd} over {warps} warps holds "
                f"{bm * bd // threads} fp32 accumulators per thread (> {MAX_PER_THREAD}): "
                f"would spill")
    if bn * bd // threads > MAX_PER_THREAD:
        return (f"BLOCK_N x BLOCK_D = {bn}x{bd} over {warps} warps holds {bn * bd // threads} "
                f"K (and as many V) elements per thread (> {MAX_PER_THREAD}): would spill")
    keys = keys_seen(problem)
    # a window's keys need not start at a block boundary: one more block at most
    blocks = -(-keys // bn) if keys == problem.seqlen_k else (keys - 2) // bn + 2
    if splits > 1 and splits > blocks:
        where = (f"seqlen_k {problem.seqlen_k}" if keys == problem.seqlen_k
                 else f"the window's {keys} keys")
        return (f"NUM_SPLITS {splits} exceeds the {blocks} key blocks of BLOCK_N {bn} in "
                f"{where}: programs would idle")
    if not device.is_interpreter:
        smem = shared_mem_bytes(config, bm, problem.head_dim)
        if smem > device.shared_mem_per_block:
            return (f"needs ~{smem} B of shared memory, the device allows "
                    f"{device.shared_mem_per_block} B per block")
    return None


SPACE = SearchSpace(params=PARAMS, predicate=check, defaults=DEFAULTS)


def default_splits(problem: AttentionProblem, sm_count: int, block_n: int = 64,
                   per_sm: int = 1) -> int:
    """The split count of the space nearest below ``round(per_sm * sm_count / programs)``
    (about ``per_sm`` programs per SM), but no split shorter than :data:`MIN_SPLIT_KEYS`
    keys (or one ``block_n`` block) of :func:`keys_seen`; 1 once the unsplit grid fills the
    SMs."""
    group = problem.heads_q // problem.heads_kv
    row_blocks = -(-rows(group, problem.seqlen_q) // block_m(group, problem.seqlen_q))
    programs = problem.batch * problem.heads_kv * row_blocks
    want = round(per_sm * max(1, sm_count) / programs)
    cap = max(1, -(-keys_seen(problem) // max(MIN_SPLIT_KEYS, block_n)))
    want = min(want, cap)
    return max(s for s in PARAMS["NUM_SPLITS"] if s <= max(1, want))


def default_config(problem: AttentionProblem, device: DeviceFingerprint) -> Config:
    """BLOCK_N 128 with 2 stages (64 for head_dim > 128), 4 warps and
    :func:`default_splits`; for a head dim below 128 that is not a power of two, BLOCK_N 64
    with 3 stages, two programs per SM and its two tiles (``SPLIT_D``, where they save
    padding); shrunk until the device takes it.

    Measured on an H100 (bf16, Hq 32, Hkv 8, D 128, Nq 1, CUDA-graph timings): split
    counts of half or twice this rule were 1-12% slower (B 1..64 x Nk 1k..128k). Of
    BLOCK_N {32, 64, 128} x stages {2, 3, 4}, contiguous caches ran best with (128, 3) or
    (64, 4) (geomean 3.03 / 3.01 TB/s over B 1/16/64), paged ones (page 16 and 64) with
    (128, 2) (2.65 / 2.73 TB/s; 2.19-2.46 with 3 or 4 stages); (128, 2) gives contiguous
    caches 2.99, so it is the one default for both (configs are shared, see above).

    Phi-3's 32:32 heads of 96 on an H200 (bf16, B 1-16 over 4096 and 12000 keys,
    CUDA-graph replays with a cold L2: ``benchmarks/results/decode_split_d_cold_h200.json``)
    ran the D128 rule (one padded tile) at 0.71-0.86x cuDNN's step at B 1-4; this one ran
    0.97-1.06x at every shape (0.79-1.01x with one tile: two tiles keep a lent or default
    config from the worst)."""
    wide = problem.head_dim > 128
    if problem.head_dim < 128 and block_d(problem.head_dim) != problem.head_dim:
        config: Config = {
            "BLOCK_N": 64,
            "NUM_SPLITS": default_splits(problem, device.sm_count, 64, per_sm=2),
            "num_warps": 4,
            "num_stages": 3,
        }
        if saves_padding(problem.head_dim):
            config["SPLIT_D"] = 1
    else:
        config = {
            "BLOCK_N": 64 if wide else 128,
            "NUM_SPLITS": default_splits(problem, device.sm_count, 64 if wide else 128),
            "num_warps": 4,
            "num_stages": 2,
        }
    while (reason := check(config, problem, device)) is not None:
        if "NUM_SPLITS" in reason and config["NUM_SPLITS"] > 1:
            config["NUM_SPLITS"] = max(s for s in PARAMS["NUM_SPLITS"]
                                       if s < config["NUM_SPLITS"])
        elif "per thread" in reason and config["num_warps"] < 8:
            config["num_warps"] *= 2
        elif config["num_stages"] > 1:
            config["num_stages"] -= 1
        elif config["BLOCK_N"] > 16:
            config["BLOCK_N"] //= 2
        else:
            break
    return config

"""How a config tuned for one decode shape runs another: the router serves a shape with
no tuning of its own by the nearest tuned one (:meth:`~flashtune.core.space.SearchSpace.lent`),
and of attn_decode's knobs the split count follows the shape.

A split count is a matter of filling the SMs, the way FlashAttention's ``num_splits``
heuristic chooses it from batch x heads: lent unchanged from another batch it left an H100
half idle (a softcap step at B 8 took B 16's single split and ran at 0.72x the exact
tuning's two splits: benchmarks/results/ship_check_heldout_decode_h100.json).

Not imported by the launcher, so not part of the template's source hash: the generated code
does not depend on it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from flashtune.core.device import DeviceFingerprint
from flashtune.core.problem import AttentionProblem
from flashtune.core.space import Config
from flashtune.kernel_templates.attn_decode.space import (
    MIN_SPLIT_KEYS,
    PARAMS,
    block_m,
    check,
    keys_seen,
    rows,
)


def programs(problem: AttentionProblem) -> int:
    """Programs of the unsplit grid: one per batch row, KV head and block of query rows (the
    count :func:`~flashtune.kernel_templates.attn_decode.space.default_splits` makes inline:
    space.py is in the template's source hash, so it does not call this)."""
    group = problem.heads_q // problem.heads_kv
    row_blocks = -(-rows(group, problem.seqlen_q) // block_m(group, problem.seqlen_q))
    return problem.batch * problem.heads_kv * row_blocks


def lend(config: Mapping[str, int], tuned_for: AttentionProblem, problem: AttentionProblem,
         device: DeviceFingerprint) -> Config:
    """``config``, tuned for ``tuned_for``, fitted to ``problem``.

    ``NUM_SPLITS`` is scaled so that the grid keeps the programs the tuning found fastest
    (split count x :func:`programs`; an unsplit config says only that its grid needed no
    split, so it lends at most one program per SM, the rule of
    :func:`~flashtune.kernel_templates.attn_decode.space.default_splits`), with no split
    shorter than the tuned one's or :data:`MIN_SPLIT_KEYS` keys, whichever is shorter; the
    space's split count nearest on a log scale (ties to the smaller), lowered while
    :func:`check` refuses it. The other knobs are kept.

    Arguments:
        config: a config of the space, tuned for ``tuned_for``.
        tuned_for: the problem it was tuned for.
        problem: the problem it is lent to.
        device: the device it runs on (its SM count).
    Returns:
        A new config.
    """
    splits = config["NUM_SPLITS"]
    target = splits * programs(tuned_for)
    if splits == 1:
        target = min(target, max(1, device.sm_count))
    want = target / programs(problem)
    split_keys = min(MIN_SPLIT_KEYS, keys_seen(tuned_for) / splits)
    want = max(1.0, min(want, keys_seen(problem) / split_keys))
    fitted = dict(config, NUM_SPLITS=min(PARAMS["NUM_SPLITS"],
                                         key=lambda s: (abs(math.log2(s / want)), s)))
    while fitted["NUM_SPLITS"] > 1 and "NUM_SPLITS" in (check(fitted, problem, device) or ""):
        fitted["NUM_SPLITS"] = max(s for s in PARAMS["NUM_SPLITS"] if s < fitted["NUM_SPLITS"])
    return fitted

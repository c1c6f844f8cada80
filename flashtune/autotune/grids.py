"""Problem grids shared by the benchmarks, the tuner's presets and ``flashtune bench``."""

from __future__ import annotations

from flashtune.core.problem import AttentionProblem

STANDARD_TOKENS = 16384
STANDARD_HIDDEN = 2048
STANDARD_SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)


def standard_grid(head_dims: tuple[int, ...] = (64, 128), causal: tuple[bool, ...] = (False, True),
                  seqlens: tuple[int, ...] = STANDARD_SEQLENS,
                  dtype: str = "bf16") -> list[AttentionProblem]:
    """The FlashAttention papers' grid: for each head dim, causal flag and sequence length,
    batch x seqlen = 16384 tokens and heads x head dim = 2048 (the hidden size); ``flashtune
    bench``'s default problems."""
    grid = []
    for d in head_dims:
        heads = STANDARD_HIDDEN // d
        for c in causal:
            for n in seqlens:
                grid.append(AttentionProblem(STANDARD_TOKENS // n, heads, heads, n, n, d, c, dtype))
    return grid

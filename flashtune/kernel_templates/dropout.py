"""Attention dropout (FlashAttention-2's ``dropout_p``) as the kernels apply it: the keep
threshold of a dropout probability, the per-call seed, and a debug launcher that
materialises the keep mask the kernels regenerate (never stored by them).

The mask is :func:`~flashtune.kernel_templates.score_mods.dropout_keep`'s: score ``(i, j)``
(query row ``i``, key column ``j``, positions within the sequence) of sequence ``b`` and
query head ``h`` is kept iff an 8-bit draw of Philox-4x32-7 keyed by the seed, at counter
``(b * H_Q + h, 8 * (i // 16) + i % 8, 0, 4 * (j // 32) + (j // 2) % 4)`` (one call for
rows ``r, r + 8`` against keys ``c + {0, 1, 8, 9, 16, 17, 24, 25}``), is below the
threshold; a pure function of the seed and ``(b, h, i, j)``, so the forward, the dK/dV and
the dQ kernels (each with its own tiles, the dK/dV kernel's transposed) regenerate the same
mask, and :func:`dropout_mask` (any tile) materialises it.

Keep probability: ``threshold / 256`` with ``threshold = round((1 - dropout_p) * 256)``
clamped to ``[1, 256]`` (:func:`dropout_threshold`), so ``dropout_p`` is quantised to
multiples of 1/256 (0.1 drops 26/256 = 0.1016, the rate of FlashAttention-2's 8-bit
threshold); kept probabilities are scaled by the exact inverse ``256 / threshold``, so the
output's expectation is the attention without dropout (FlashAttention-2 scales by
``1 / (1 - dropout_p)``, 0.2% short at 0.1).

Seeds: one int64 per call from torch's generator on the call's device (:func:`draw_seed`,
as Inductor seeds its random ops): it advances the CUDA generator's Philox offset, so
``torch.manual_seed`` reproduces a call and each CUDA-graph replay draws a fresh mask; the
kernels read it from the tensor, and the backward reuses the forward's.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from flashtune.kernel_templates.score_mods import dropout_keep

__all__ = ["SEED_HIGH", "draw_seed", "dropout_mask", "dropout_threshold", "keep_probability"]

# seeds are drawn in [0, SEED_HIGH): any 64-bit key works, a non-negative int64 prints well
SEED_HIGH = 1 << 62


def dropout_threshold(dropout_p: float) -> int:
    """The kernels' 8-bit keep threshold of ``dropout_p`` in ``[0, 1)``: a score is kept
    iff its byte is below it, ``round((1 - dropout_p) * 256)`` in ``[1, 256]``."""
    return min(256, max(1, round((1.0 - float(dropout_p)) * 256)))


def keep_probability(dropout_p: float) -> float:
    """The probability that a score is kept, ``dropout_threshold(dropout_p) / 256``: what
    the kept scores are divided by."""
    return dropout_threshold(dropout_p) / 256


def draw_seed(device: Any) -> torch.Tensor:
    """A fresh seed, int64 ``(1,)`` on ``device``, from torch's generator there (graph-safe:
    a CUDA graph replays the draw, not its value)."""
    return torch.randint(SEED_HIGH, (1,), device=device, dtype=torch.int64)


@triton.jit
def dropout_mask_kernel(Seed, Mask, stride_mb, stride_mh, stride_mm, H_Q, HEADS, N_Q, N_K,
                        DROPOUT_T, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        TRANS: tl.constexpr):
    """Tile ``(program 0, program 1)`` of the keep mask of query head ``off_h`` of sequence
    ``off_b`` (program 2 = ``off_b * HEADS + off_h``: the first HEADS of H_Q heads); with
    ``TRANS`` built as the dK/dV kernel builds it, keys by queries, and stored transposed."""
    off_b = tl.program_id(2) // HEADS
    off_h = tl.program_id(2) % HEADS
    start_m = tl.program_id(0) * BLOCK_M
    start_n = tl.program_id(1) * BLOCK_N
    seed = tl.load(Seed)
    base = Mask + off_b.to(tl.int64) * stride_mb + off_h.to(tl.int64) * stride_mh
    if TRANS:
        offs_m = start_m + tl.arange(0, BLOCK_M)
        offs_n = start_n + tl.arange(0, BLOCK_N)
        keep_t = dropout_keep(seed, off_b * H_Q + off_h, start_m, start_n, DROPOUT_T,
                              BLOCK_M, BLOCK_N, True)
        ptrs = base + offs_m[None, :].to(tl.int64) * stride_mm + offs_n[:, None]
        tl.store(ptrs, keep_t.to(tl.int8),
                 mask=(offs_m < N_Q)[None, :] & (offs_n < N_K)[:, None])
    else:
        offs_m = start_m + tl.arange(0, BLOCK_M)
        offs_n = start_n + tl.arange(0, BLOCK_N)
        keep = dropout_keep(seed, off_b * H_Q + off_h, start_m, start_n, DROPOUT_T,
                            BLOCK_M, BLOCK_N)
        ptrs = base + offs_m[:, None].to(tl.int64) * stride_mm + offs_n[None, :]
        tl.store(ptrs, keep.to(tl.int8),
                 mask=(offs_m < N_Q)[:, None] & (offs_n < N_K)[None, :])


def dropout_mask(seed: torch.Tensor, batch: int, heads_q: int, seqlen_q: int, seqlen_k: int,
                 dropout_p: float, *, batches: int | None = None, heads: int | None = None,
                 block: tuple[int, int] = (32, 32), transposed: bool = False) -> torch.Tensor:
    """The keep mask the kernels use for ``seed`` and ``dropout_p``, materialised.

    Arguments:
        seed: the call's int64 seed tensor ``(1,)`` (:func:`draw_seed`), on the device the
            mask is computed on.
        batch, heads_q, seqlen_q, seqlen_k: the scores' shape. For a packed batch pass the
            longest lengths: sequence ``b``'s mask is ``[b, :, :len_q(b), :len_k(b)]``.
        dropout_p: the dropout probability in ``[0, 1)``.
        batches, heads: only the first ``batches`` sequences and ``heads`` query heads
            (None: all), for a reference on a slice of a big problem.
        block: the ``(rows, columns)`` tile of the debug kernel (powers of two >= 16); the
            mask does not depend on it.
        transposed: build each tile keys by queries, as the dK/dV kernel does (the same
            mask: a check of that path).
    Returns:
        bool ``(batches, heads, seqlen_q, seqlen_k)``: True where a score is kept.
    """
    bm, bn = block
    batches = batch if batches is None else min(batch, batches)
    heads = heads_q if heads is None else min(heads_q, heads)
    mask = torch.empty((batches, heads, seqlen_q, seqlen_k), device=seed.device,
                       dtype=torch.int8)
    grid = (triton.cdiv(seqlen_q, bm), triton.cdiv(seqlen_k, bn), batches * heads)
    dropout_mask_kernel[grid](seed, mask, mask.stride(0), mask.stride(1), mask.stride(2),
                              heads_q, heads, seqlen_q, seqlen_k, dropout_threshold(dropout_p),
                              BLOCK_M=bm, BLOCK_N=bn, TRANS=transposed)
    return mask.view(torch.bool)

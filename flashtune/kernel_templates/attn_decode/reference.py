"""Float64/float32 reference for attn_decode: gather each sequence's keys, plain softmax."""

from __future__ import annotations

import torch

from flashtune.kernel_templates.attn_fwd.reference import attn_fwd_reference


def gather_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, b: int, length: int,
              block_table: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequence ``b``'s first ``length`` keys and values as ``(1, heads_kv, length, D)``."""
    if block_table is None:
        return k_cache[b:b + 1, :, :length], v_cache[b:b + 1, :, :length]
    page_size = k_cache.shape[2]
    pages = block_table[b, :-(-length // page_size)].long()

    def take(cache: torch.Tensor) -> torch.Tensor:
        # (n, Hkv, page_size, D) -> (Hkv, n * page_size, D)
        t = cache[pages].permute(1, 0, 2, 3).reshape(cache.shape[1], -1, cache.shape[3])
        return t[None, :, :length]

    return take(k_cache), take(v_cache)


def attn_decode_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    cache_seqlens: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    causal: bool = False,
    scale: float | None = None,
    dtype: torch.dtype = torch.float64,
    window: tuple[int, int] = (-1, -1),
    softcap: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``(out, lse)`` computed in ``dtype`` with the kernel's conventions.

    ``k``/``v`` are dense ``(B, Hkv, Nk, D)`` (every sequence of length ``Nk``), or a cache:
    contiguous with ``cache_seqlens``, or paged with ``cache_seqlens`` and ``block_table``
    (shapes as in ``attn_decode_kvcache``). Causal masks, windows and ALiBi distances are
    bottom-right aligned against each sequence's own length (``window``, ``softcap``,
    ``alibi_slopes`` ``(Hq,)`` or ``(B, Hq)`` as in
    :func:`~flashtune.kernel_templates.attn_fwd.reference.attn_fwd_reference`); rows that
    see no key give ``out = 0`` and ``lse = -inf``.
    """
    if cache_seqlens is None:
        if block_table is not None:
            raise ValueError("block_table needs cache_seqlens")
        return attn_fwd_reference(q, k, v, causal=causal, scale=scale, dtype=dtype,
                                  window=window, softcap=softcap, alibi_slopes=alibi_slopes)
    batch, heads_q, seqlen_q, head_dim = q.shape
    outs, lses = [], []
    for b, length in enumerate(cache_seqlens.tolist()):
        if length == 0:
            outs.append(torch.zeros((1, heads_q, seqlen_q, head_dim), dtype=dtype,
                                    device=q.device))
            lses.append(torch.full((1, heads_q, seqlen_q), float("-inf"), dtype=dtype,
                                   device=q.device))
            continue
        kb, vb = gather_kv(k, v, b, length, block_table)
        slopes = alibi_slopes
        if slopes is not None and slopes.dim() == 2:
            slopes = slopes[b]
        out, lse = attn_fwd_reference(q[b:b + 1], kb, vb, causal=causal, scale=scale,
                                      dtype=dtype, window=window, softcap=softcap,
                                      alibi_slopes=slopes)
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)

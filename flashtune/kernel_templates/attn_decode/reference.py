"""Float64/float32 reference for attn_decode: gather each sequence's keys, plain softmax.

:func:`attn_decode_kvcache_reference` adds FlashAttention-2's cache options the way its test
(``tests/test_flash_attn.py::test_flash_attn_kvcache``) builds its reference: rotate q and
the new keys (:func:`rotary_reference`, FA2's ``apply_rotary_emb``: fp32 math, rounded to the
input dtype), write the new keys and values into copies of the caches, then attend to each
sequence's keys ``[cache_leftpad[b], cache_seqlens[b] + seqlen_new)``.
"""

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


def rotary_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     positions: torch.Tensor, *, interleaved: bool) -> torch.Tensor:
    """FlashAttention-2's ``apply_rotary_emb`` on ``x`` ``(B, H, N, D)``: the first
    ``rotary_dim = 2 * cos.shape[1]`` dims of row ``(b, n)`` turn by the angles of row
    ``positions[b, n]`` of ``cos``/``sin`` ``(seqlen_ro, rotary_dim / 2)``; GPT-J pairs
    ``(2t, 2t + 1)`` if ``interleaved``, GPT-NeoX halves ``(t, t + rotary_dim / 2)``
    otherwise. fp32 math, the result in ``x``'s dtype."""
    rd = 2 * cos.shape[1]
    pos = positions.long()
    c = cos.float()[pos][:, None]  # (B, 1, N, rd / 2)
    s = sin.float()[pos][:, None]
    xf = x.float()
    xr = xf[..., :rd]
    if interleaved:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
        out = torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).flatten(-2)
    else:
        x1, x2 = xr[..., :rd // 2], xr[..., rd // 2:]
        out = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
    return torch.cat((out, xf[..., rd:]), dim=-1).to(x.dtype)


def _slots(b: int, positions: torch.Tensor, block_table: torch.Tensor | None,
           page_size: int, cache_row: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(cache index along dim 0, slot along dim 2) of sequence ``b``'s key ``positions``."""
    if block_table is None:
        return torch.full_like(positions, cache_row), positions
    return block_table[b, positions // page_size].long(), positions % page_size


def attn_decode_kvcache_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    *,
    k: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
    rotary_cos: torch.Tensor | None = None,
    rotary_sin: torch.Tensor | None = None,
    rotary_interleaved: bool = True,
    cache_batch_idx: torch.Tensor | None = None,
    cache_leftpad: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    causal: bool = True,
    scale: float | None = None,
    dtype: torch.dtype = torch.float32,
    window: tuple[int, int] = (-1, -1),
    softcap: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(out, lse, k_cache_after, v_cache_after)`` of
    :func:`~flashtune.kernel_templates.attn_decode.launcher.attn_decode_kvcache` with the same
    arguments (shapes as there), computed in ``dtype`` on copies of the caches (the inputs
    are not modified).

    Sequence ``b``: cache row ``cache_batch_idx[b]`` (or ``b``; or pages through
    ``block_table``), ``L = cache_seqlens[b] + seqlen_new`` keys after writing the new ones
    at ``cache_seqlens[b] ..``, of which ``[cache_leftpad[b], L)`` are attended to. The new
    keys are rotated at their positions; q at ``cache_seqlens[b] + i`` when
    ``rotary_q_per_position`` (causal or local, FA2's rule), else at ``cache_seqlens[b]``.
    """
    from flashtune.kernel_templates.attn_decode.launcher import rotary_q_per_position

    batch, heads_q, seqlen_q, head_dim = q.shape
    lens = cache_seqlens.long()
    n_new = 0 if k is None else k.shape[2]
    paged = block_table is not None
    page_size = k_cache.shape[2] if paged else 1
    capacity = block_table.shape[1] * page_size if block_table is not None else k_cache.shape[2]
    k_after, v_after = k_cache.clone(), v_cache.clone()
    if rotary_cos is not None:
        assert k is not None and rotary_sin is not None, "rotary comes with new keys"
        qpos = lens[:, None] + (torch.arange(seqlen_q, device=q.device)[None, :]
                                if rotary_q_per_position(causal, window, capacity)
                                else 0 * torch.arange(seqlen_q, device=q.device)[None, :])
        q = rotary_reference(q, rotary_cos, rotary_sin, qpos, interleaved=rotary_interleaved)
        kpos = lens[:, None] + torch.arange(n_new, device=q.device)[None, :]
        k = rotary_reference(k, rotary_cos, rotary_sin, kpos, interleaved=rotary_interleaved)
    rows = (cache_batch_idx.long() if cache_batch_idx is not None
            else torch.arange(batch, device=q.device))
    if k is not None:
        assert v is not None
        for b in range(batch):
            pos = int(lens[b]) + torch.arange(n_new, device=q.device)
            idx, slot = _slots(b, pos, block_table, page_size, int(rows[b]))
            # (n_new, Hkv, D) into [idx, :, slot]
            k_after[idx, :, slot] = k[b].transpose(0, 1).to(k_after.dtype)
            v_after[idx, :, slot] = v[b].transpose(0, 1).to(v_after.dtype)
    outs, lses = [], []
    for b in range(batch):
        length = int(lens[b]) + n_new
        start = int(cache_leftpad[b]) if cache_leftpad is not None else 0
        if length - start <= 0:
            outs.append(torch.zeros((1, heads_q, seqlen_q, head_dim), dtype=dtype,
                                    device=q.device))
            lses.append(torch.full((1, heads_q, seqlen_q), float("-inf"), dtype=dtype,
                                   device=q.device))
            continue
        pos = torch.arange(start, length, device=q.device)
        idx, slot = _slots(b, pos, block_table, page_size, int(rows[b]))
        # (n, Hkv, D) -> (1, Hkv, n, D); positions are translation invariant for the masks
        # and ALiBi (query i at i + L - seqlen_q, key j at j), so the slice [start, L) serves
        kb = k_after[idx, :, slot].transpose(0, 1)[None]
        vb = v_after[idx, :, slot].transpose(0, 1)[None]
        slopes = alibi_slopes
        if slopes is not None and slopes.dim() == 2:
            slopes = slopes[b]
        out, lse = attn_fwd_reference(q[b:b + 1], kb, vb, causal=causal, scale=scale,
                                      dtype=dtype, window=window, softcap=softcap,
                                      alibi_slopes=slopes)
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses), k_after, v_after

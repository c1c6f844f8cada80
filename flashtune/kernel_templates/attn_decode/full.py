"""attn_decode over dense K/V as flashtune runs and tunes it: the cache variant of the split
kernel, every sequence's length full.

The split kernel compiles two ways for the same keys: with the keys' count a launch
argument (:func:`~flashtune.kernel_templates.attn_decode.launcher.attn_decode`, dense K/V,
``HAS_SEQLENS`` off) or read per sequence from a lengths tensor
(:func:`~flashtune.kernel_templates.attn_decode.launcher.attn_decode_kvcache`). Same
source, same results, not the same machine code: on an H200 one config ran 0.87-1.49x as
long one way as the other (46 configs x 8 GQA decode shapes, geomean 1.015, ranks agreeing
0.86-0.99; ``benchmarks/results/decode_variants_h200.json``), so a config the tuner timed
one way was not the best the other way (Llama-3 8B's heads, 32:8, batch 64 over 4k keys: the
tuned config ran 1.08x the default's time on the cache path, where the tuner, timing dense
K/V, had measured a tie). The KV-cache path cannot do without lengths; so the template's
launcher (what the tuner times and the router's unplanned calls run), the dense decode
route's launch plans and the precompiler all run the cache variant with full lengths, and
what is tuned is what runs. At each shape's best config the two variants measured the
same (within 1%).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping

import torch

from flashtune.kernel_templates.attn_decode.launcher import attn_decode_kvcache
from flashtune.kernel_templates.direct import capturing

__all__ = ["attn_decode_full", "full_lengths"]

# (device, batch, seqlen_k) -> int32 (batch,) filled with seqlen_k; never written after it is
# made, so every caller on the device may read it (a plan holds its own reference, so
# starting again past MEMO_LIMIT entries frees nothing that is in use)
_FULL: dict[tuple[torch.device, int, int], torch.Tensor] = {}
_LOCK = threading.Lock()
MEMO_LIMIT = 256


def full_lengths(batch: int, seqlen_k: int, device: torch.device) -> torch.Tensor:
    """An int32 ``(batch,)`` tensor on ``device`` holding ``seqlen_k`` everywhere, made once
    per (device, batch, seqlen_k) and kept. Under CUDA-graph capture a missing one is made
    in the graph (its fill replays with it) and not kept: memory of the graph's pool must not
    outlive the graph."""
    key = (device, batch, seqlen_k)
    lens = _FULL.get(key)
    if lens is not None:
        return lens
    lens = torch.full((batch,), seqlen_k, dtype=torch.int32, device=device)
    if device.type == "cuda" and capturing():
        return lens
    with _LOCK:
        if len(_FULL) >= MEMO_LIMIT:
            _FULL.clear()
        return _FULL.setdefault(key, lens)


def attn_decode_full(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    config: Mapping[str, int],
    *,
    causal: bool = False,
    scale: float | None = None,
    return_lse: bool = False,
    out: torch.Tensor | None = None,
    window: tuple[int, int] = (-1, -1),
    softcap: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """:func:`~flashtune.kernel_templates.attn_decode.launcher.attn_decode` (same arguments,
    returns and results) through the cache variant of the split kernel, every sequence
    ``seqlen_k`` keys long: the kernel :func:`attention_with_kvcache` runs, so a config
    timed here is timed as the KV-cache path runs it."""
    lens = full_lengths(q.shape[0], k.shape[2], q.device)
    return attn_decode_kvcache(q, k, v, lens, config, causal=causal, scale=scale,
                               return_lse=return_lse, out=out, window=window,
                               softcap=softcap, alibi_slopes=alibi_slopes)

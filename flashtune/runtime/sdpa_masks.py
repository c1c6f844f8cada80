"""The boolean ``attn_mask`` patterns :func:`flashtune.scaled_dot_product_attention` serves.

A model hands torch's SDPA a mask tensor where flashtune takes arguments. Two kinds of mask
say something flashtune's kernels compute without reading a mask:

* a causal or local-window pattern: the mask, the same for every batch element and head,
  equals :func:`~flashtune.kernel_templates.attn_fwd.reference.visible` ``(Lq, Lk,
  window=(left, right))`` for some bounds (bottom-right aligned: query ``i`` sits at key
  position ``i + Lk - Lq``; -1 unbounded; ``right`` 0 is causal), so it runs as
  :func:`flashtune.attention` with ``causal`` and ``window`` (an all-True mask is plain
  attention). The bounds are read from the first row's last kept key and the last row's
  first kept key, then the pattern they give is built once and compared with the mask;
* key padding: ``(B, 1, 1, Lk)`` (or ``(B, 1, Lq, Lk)`` whose rows are equal, or one row
  for the whole batch) keeping one contiguous run of keys ``[s_b, e_b)`` per batch element
  (left or right padding), so it runs as a packed batch through
  :func:`~flashtune.runtime.scored.varlen`: the queries packed ``(B * Lq, Hq, E)``, the kept
  keys and values gathered, the output viewed back as ``(B, Hq, Lq, E)``.

A mask under which some query sees no key is neither (torch decides what such rows give),
nor is one that differs between heads.

Recognising a mask reads it on the device (a few small reads and comparisons: a sync). The
verdict is memoised per mask object: the last :data:`MEMO_SIZE` masks are held by weak
reference with their version counter (``mask._version``, which every in-place write bumps)
and the call sizes they were read for, so the layers of a model, which pass one mask tensor
each, pay the read once, and a call with a mask seen before reads nothing on the device. An
inference tensor (made under ``torch.inference_mode``) has no version counter, so nothing
proves it unchanged: it is recognised at every call.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from dataclasses import dataclass
from typing import cast

import torch

from flashtune.kernel_templates.attn_fwd.reference import visible
from flashtune.runtime.ops import attention
from flashtune.runtime.scored import varlen

__all__ = ["MEMO_SIZE", "KeyPadding", "Verdict", "Window", "mask_verdict", "recognise",
           "reset_masks"]

MEMO_SIZE = 8  # masks whose verdicts are kept

# fallback_reason's words for the masks recognised as neither pattern
BAD_SHAPE = "an attn_mask that does not broadcast to (B, Hq, Lq, Lk), or broadcasts over keys"
PER_HEAD = "an attn_mask that differs between heads (flashtune serves one pattern for all)"
NO_KEY = "an attn_mask under which some query sees no key (torch decides what such rows give)"
OTHER = ("a boolean attn_mask that is neither a causal/local window nor one contiguous run "
         "of keys per batch element")


@dataclass(frozen=True)
class Window:
    """A mask equal to ``visible(Lq, Lk, window=(left, right))`` (``right`` 0: causal)."""

    left: int
    right: int

    def describe(self) -> str:
        if self.right == 0:
            return "causal" if self.left == -1 else f"causal, window ({self.left}, 0)"
        if (self.left, self.right) == (-1, -1):
            return "every key"
        return f"window ({self.left}, {self.right})"

    def run(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
            scale: float | None, dropout_p: float = 0.0) -> torch.Tensor:
        return attention(query, key, value, causal=self.right == 0,
                         window=(self.left, self.right), scale=scale, dropout_p=dropout_p)


@dataclass(frozen=True, eq=False)
class KeyPadding:
    """A mask keeping keys ``[s_b, e_b)`` of batch element ``b``: the packed batch's
    index tensors, on the mask's device."""

    lengths: tuple[int, ...]      # kept keys per batch element
    batch_index: torch.Tensor     # (total_k,) int64: the batch element of each kept key
    key_index: torch.Tensor       # (total_k,) int64: its position in the batch element
    cu_seqlens_q: torch.Tensor    # (B + 1,) int32: b * Lq
    cu_seqlens_k: torch.Tensor    # (B + 1,) int32: cumulative kept keys

    def describe(self) -> str:
        return "key padding, packed batch"

    def run(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
            scale: float | None, dropout_p: float = 0.0) -> torch.Tensor:
        b, hq, lq, e = query.shape
        q = query.transpose(1, 2).reshape(b * lq, hq, e)
        k = key.transpose(1, 2)[self.batch_index, self.key_index]
        v = value.transpose(1, 2)[self.batch_index, self.key_index]
        out = varlen(q, k, v, self.cu_seqlens_q, self.cu_seqlens_k, lq, max(self.lengths),
                     scale=scale, dropout_p=dropout_p, read_lengths=False)
        return cast(torch.Tensor, out).view(b, lq, hq, e).transpose(1, 2)


Verdict = Window | KeyPadding | str  # a pattern, or why the mask is neither

_LOCK = threading.Lock()
# newest first: (mask, its version then, (B, Hq, Lq, Lk), verdict)
_SEEN: list[tuple[weakref.ref[torch.Tensor], int, tuple[int, int, int, int], Verdict]] = []


def mask_verdict(mask: torch.Tensor, b: int, hq: int, lq: int, lk: int) -> Verdict:
    """:func:`recognise`'s verdict on ``mask`` for a call of these sizes, memoised (the
    module doc): a mask seen before, unchanged since, costs no device read."""
    shape = (b, hq, lq, lk)
    if mask.is_inference():
        return recognise(mask, b, hq, lq, lk)
    version = mask._version
    with _LOCK:
        for ref, seen_version, seen_shape, verdict in _SEEN:
            if ref() is mask and seen_version == version and seen_shape == shape:
                return verdict
    verdict = recognise(mask, b, hq, lq, lk)
    with _LOCK:
        alive = [entry for entry in _SEEN if entry[0]() is not None]
        _SEEN[:] = [(weakref.ref(mask), version, shape, verdict), *alive[:MEMO_SIZE - 1]]
    return verdict


def reset_masks() -> None:
    """Forget the memoised verdicts."""
    with _LOCK:
        _SEEN.clear()


def recognise(mask: torch.Tensor, b: int, hq: int, lq: int, lk: int) -> Verdict:
    """What the boolean ``mask`` is for a call with queries ``(b, hq, lq, E)`` and ``lk``
    keys: a :class:`Window`, a :class:`KeyPadding`, or the reason it is neither (one of
    this module's constants). Reads the mask on its device."""
    if not 1 <= mask.dim() <= 4:
        return BAD_SHAPE
    m = mask[(None,) * (4 - mask.dim())]
    mb, mh, mq, mk = m.shape
    if mb not in (1, b) or mh not in (1, hq) or mq not in (1, lq) or mk != lk:
        return BAD_SHAPE
    if mh > 1 and not torch.equal(m, m[:, :1].expand_as(m)):
        return PER_HEAD
    m3 = m[:, 0]  # (mb, mq, lk)
    if not bool(m3.any(-1).all()):
        return NO_KEY
    if mb == 1 or torch.equal(m3, m3[:1].expand_as(m3)):
        window = _window(m3[0].expand(lq, lk), lq, lk)
        if window is not None:
            return window
    return _key_padding(m3, b, lq, lk) or OTHER


def _window(m: torch.Tensor, lq: int, lk: int) -> Window | None:
    """The window ``m`` (``(lq, lk)``, every row keeping a key) is, if any: the bounds from
    the first row's last kept key and the last row's first, checked on the whole mask."""
    first_last, last_first = torch.stack(
        (lk - 1 - m[0].int().flip(0).argmax(), m[-1].int().argmax())).tolist()
    shift = lk - lq  # query i sits at key position i + shift
    if first_last == lk - 1:
        right = -1  # every row reaches the last key: no right bound
    elif first_last >= shift:
        right = first_last - shift
    else:
        return None  # the first row stops left of its own position: no bottom-right window
    left = -1 if last_first == 0 else lk - 1 - last_first
    if not torch.equal(m, visible(lq, lk, window=(left, right), device=m.device)):
        return None
    return Window(left, right)


def _key_padding(m: torch.Tensor, b: int, lq: int, lk: int) -> KeyPadding | None:
    """The key padding ``m`` (``(1 or b, 1 or lq, lk)``, every row keeping a key) is, if
    its rows are equal within each batch element and each keeps one contiguous run."""
    if m.shape[1] > 1 and not torch.equal(m, m[:, :1].expand_as(m)):
        return None
    rows = m[:, 0].int()
    firsts, lasts, counts = torch.stack(
        (rows.argmax(-1), lk - 1 - rows.flip(-1).argmax(-1), rows.sum(-1))).tolist()
    if any(c != e - s + 1 for s, e, c in zip(firsts, lasts, counts)):
        return None
    if len(firsts) == 1:
        firsts, lasts = firsts * b, lasts * b
    lengths = [e - s + 1 for s, e in zip(firsts, lasts)]
    device = m.device
    key_index = torch.cat([torch.arange(s, e + 1) for s, e in zip(firsts, lasts)])
    batch_index = torch.repeat_interleave(torch.arange(b), torch.tensor(lengths))
    cu_k = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
    cu_q = torch.arange(b + 1, dtype=torch.int32) * lq
    return KeyPadding(tuple(lengths), batch_index.to(device), key_index.to(device),
                      cu_q.to(device), cu_k.to(device))

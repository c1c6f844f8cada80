"""Problem keys: what a tuned config is keyed on, and the one bucketing scheme.

The tuner stores results under :meth:`AttentionProblem.key`; the dispatcher looks them up
by the same key, then by :meth:`AttentionProblem.bucket`, then by distance. Both sides
call these functions, so the two can never drift apart.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

DTYPES = ("fp16", "bf16")
# the largest head dim flashtune serves: every head dim 1..MAX_HEAD_DIM, as
# FlashAttention-2 (the public ops refuse others, naming the range)
MAX_HEAD_DIM = 256


def _pow2_ceil(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def dtype_name(dtype: Any) -> str:
    """``torch.float16`` -> ``'fp16'``, ``torch.bfloat16`` -> ``'bf16'``."""
    text = str(dtype).replace("torch.", "")
    names = {"float16": "fp16", "half": "fp16", "fp16": "fp16",
             "bfloat16": "bf16", "bf16": "bf16"}
    if text not in names:
        raise ValueError(f"dtype must be fp16 or bf16, got {dtype!r}")
    return names[text]


@dataclass(frozen=True)
class AttentionProblem:
    """One attention shape: q ``(batch, heads_q, seqlen_q, head_dim)``, k/v with ``heads_kv``."""

    batch: int
    heads_q: int
    heads_kv: int
    seqlen_q: int
    seqlen_k: int
    head_dim: int
    causal: bool
    dtype: str  # "fp16" | "bf16"
    # FlashAttention-2's score modifications (see MODS): a local window (-1: unbounded on
    # that side; with ``causal`` the right bound is the causal one, so it stays -1), a
    # logit softcap (0: none), ALiBi slopes (whether there are any; their values are data)
    window_left: int = -1
    window_right: int = -1
    softcap: float = 0.0
    alibi: bool = False
    # a packed batch (FlashAttention-2's varlen, :func:`flashtune.attention_varlen`): the
    # total query and key tokens of ``batch`` sequences whose longest have ``seqlen_q`` /
    # ``seqlen_k`` tokens; 0: a dense batch of ``batch x seqlen`` (see PACKED)
    tokens_q: int = 0
    tokens_k: int = 0
    # attention dropout's probability (FlashAttention-2's ``dropout_p``; 0: none): the
    # kernels draw and apply its mask, so it is part of what is tuned (see DROPOUT)
    dropout: float = 0.0

    def __post_init__(self) -> None:
        for name in ("batch", "heads_q", "heads_kv", "seqlen_q", "seqlen_k", "head_dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.heads_q % self.heads_kv:
            raise ValueError(f"heads_q ({self.heads_q}) must be a multiple of heads_kv "
                             f"({self.heads_kv})")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        for name in ("window_left", "window_right"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < -1:
                raise ValueError(f"{name} must be an int >= -1 (-1: unbounded), got {value!r}")
        if self.causal and self.window_right != -1:
            raise ValueError(f"window_right must be -1 for a causal problem (causal is the "
                             f"right bound 0), got {self.window_right}")
        if self.seqlen_q == 1 and not self.causal:
            # one query row, bottom-right aligned, sees every key with the causal mask or
            # without it, and no key past the last with any right bound: one problem, keyed
            # causal as decode steps are tuned (a model's decode step calls without the
            # mask: transformers passes is_causal only for several query rows)
            object.__setattr__(self, "causal", True)
            object.__setattr__(self, "window_right", -1)
        cap = self.softcap
        if isinstance(cap, bool) or not isinstance(cap, (int, float)) \
                or not math.isfinite(cap) or cap < 0:
            raise ValueError(f"softcap must be a finite number >= 0 (0: none), got {cap!r}")
        object.__setattr__(self, "softcap", float(cap))
        if not isinstance(self.alibi, bool):
            raise ValueError(f"alibi must be true or false, got {self.alibi!r}")
        for name, longest in (("tokens_q", self.seqlen_q), ("tokens_k", self.seqlen_k)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an int >= 0 (0: a dense batch), got "
                                 f"{value!r}")
            if value > self.batch * longest:
                raise ValueError(f"{name} = {value} tokens cannot be {self.batch} sequences "
                                 f"of at most {longest} tokens each")
        if (self.tokens_q == 0) != (self.tokens_k == 0):
            raise ValueError(f"tokens_q and tokens_k are set together (a packed batch) or "
                             f"both 0, got {self.tokens_q} and {self.tokens_k}")
        drop = self.dropout
        if isinstance(drop, bool) or not isinstance(drop, (int, float)) \
                or not 0 <= drop < 1:
            raise ValueError(f"dropout must be a probability in [0, 1) (0: none), got "
                             f"{drop!r}")
        object.__setattr__(self, "dropout", float(drop))

    @classmethod
    def from_tensors(cls, q: Any, k: Any, *, causal: bool,
                     window: tuple[int, int] = (-1, -1), softcap: float | None = None,
                     alibi: bool = False, dropout: float = 0.0) -> AttentionProblem:
        """The problem of ``attention(q, k, v, causal=causal, ...)`` (metadata only);
        ``window``, ``softcap``, ``dropout`` as :func:`flashtune.attention` takes them (a
        causal call's right bound is dropped: causal is it)."""
        b, hq, nq, d = q.shape
        left, right = window
        return cls(int(b), int(hq), int(k.shape[1]), int(nq), int(k.shape[2]), int(d),
                   bool(causal), dtype_name(q.dtype), int(left), -1 if causal else int(right),
                   float(softcap or 0.0), bool(alibi), dropout=float(dropout))

    @classmethod
    def from_lengths(cls, lengths_q: Sequence[int], lengths_k: Sequence[int] | None, *,
                     heads_q: int, heads_kv: int, head_dim: int, causal: bool, dtype: str,
                     **mods: Any) -> AttentionProblem:
        """The packed problem of sequences with these lengths (keys: ``lengths_k``, or the
        queries' when None); ``mods``: the score modification fields. Its key keeps the
        count, the longest and the total of each side (:meth:`packed_lengths`)."""
        lengths_k = lengths_q if lengths_k is None else lengths_k
        for name, lengths in (("lengths_q", lengths_q), ("lengths_k", lengths_k)):
            if not lengths or any(isinstance(n, bool) or not isinstance(n, int) or n < 0
                                  for n in lengths) or not sum(lengths):
                raise ValueError(f"{name} must be a non-empty list of token counts >= 0 "
                                 f"with at least one token, got {list(lengths)!r}")
        if len(lengths_q) != len(lengths_k):
            raise ValueError(f"{len(lengths_q)} query lengths but {len(lengths_k)} key "
                             f"lengths: one each per sequence")
        return cls(len(lengths_q), heads_q, heads_kv, max(lengths_q), max(lengths_k),
                   head_dim, causal, dtype, tokens_q=sum(lengths_q), tokens_k=sum(lengths_k),
                   **mods)

    @classmethod
    def from_key(cls, key: Mapping[str, Any]) -> AttentionProblem:
        """The problem whose :meth:`key` is ``key`` (extra keys are ignored; a missing
        score modification, packed count or dropout is the default: keys written before
        they existed stay valid)."""
        return cls(**{f: key[f] for f in cls.__dataclass_fields__
                      if f in key or f not in OPTIONAL})

    def key(self) -> dict[str, Any]:
        """The problem as a dict of its fields, the score modifications, a packed batch's
        token counts and dropout only where set (a plain problem's key is what it was
        before they existed): what the store and config files key on."""
        key = asdict(self)
        for name, default in OPTIONAL.items():
            if key[name] == default:
                del key[name]
        return key

    @property
    def has_mods(self) -> bool:
        """Whether any score modification (window, softcap, ALiBi) is set."""
        return (self.window_left, self.window_right, self.softcap, self.alibi) != _NO_MODS

    @property
    def packed(self) -> bool:
        """Whether this is a packed batch (:attr:`tokens_q` set)."""
        return self.tokens_q > 0

    def packed_lengths(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The sequence lengths (queries, keys) a packed problem stands for, as the tuner
        builds its batch: the first sequence as long as the tokens allow up to
        ``seqlen``, the others sharing the rest as evenly as possible (its work is close
        to any batch of the same count, longest and total; the key keeps no more). A dense
        problem: ``batch`` sequences of ``seqlen``."""
        if not self.packed:
            return (self.seqlen_q,) * self.batch, (self.seqlen_k,) * self.batch
        return (_spread(self.tokens_q, self.batch, self.seqlen_q),
                _spread(self.tokens_k, self.batch, self.seqlen_k))

    def mods(self) -> tuple[str, ...]:
        """The names of the score modifications set: ``"window"``, ``"softcap"``,
        ``"alibi"`` (what an implementation's ``Limits.score_mods`` must hold)."""
        names = []
        if self.window_left != -1 or self.window_right != -1:
            names.append("window")
        if self.softcap:
            names.append("softcap")
        if self.alibi:
            names.append("alibi")
        return tuple(names)

    def _mods_label(self) -> str:
        parts = []
        if self.window_left != -1 or self.window_right != -1:
            parts.append(f"w{self.window_left}_{self.window_right}")
        if self.softcap:
            parts.append(f"cap{self.softcap:g}")
        if self.alibi:
            parts.append("alibi")
        return "".join(f"-{p}" for p in parts)

    def bucket(self) -> str:
        """Sequence lengths and batch rounded up to powers of two; everything else exact."""
        return (f"{self.dtype}-d{self.head_dim}-{'causal' if self.causal else 'full'}"
                f"-hq{self.heads_q}-hkv{self.heads_kv}-b{_pow2_ceil(self.batch)}"
                f"-nq{_pow2_ceil(self.seqlen_q)}-nk{_pow2_ceil(self.seqlen_k)}"
                f"{self._mods_label()}"
                f"{f'-packed{_pow2_ceil(self.tokens_q)}' if self.packed else ''}"
                f"{f'-drop{self.dropout:g}' if self.dropout else ''}")

    def distance(self, other: AttentionProblem, *, across_groups: bool = False) -> float:
        """How far apart two problems are, for the nearest-tuned-shape lookup.

        ``inf`` unless dtype, head_dim, causal and the GQA group size agree (a config for
        one of those does not transfer); otherwise the sum of |log2| ratios of the sequence
        lengths, the batch x heads (the grid's other axis), weighted so that sequence
        length dominates. ``across_groups``: GQA groups of another size are at
        :data:`GROUP_DISTANCE` plus the |log2| ratio of the sizes instead of ``inf`` (a
        forward's config or choice: the same kernels, K/V shared by another number of query
        heads, so a shape whose group no table holds, MQA 32:1 say, takes its nearest
        neighbour of another group rather than the default; a backward's is tied to its
        group, see the lookup).
        """
        if (self.dtype, self.head_dim, self.causal) != (other.dtype, other.head_dim, other.causal):
            return math.inf
        return features_distance(self.near_features(), other.near_features(),
                                 across_groups=across_groups)

    def near_features(self) -> NearFeatures:
        """What :meth:`distance` reads of this problem beside dtype, head_dim and causal,
        computed once: a table of tuned problems keeps each entry's, so ranking them for a
        shape not seen before (every decoding step over a growing cache) is arithmetic."""
        mods = self.mods()
        return (self.heads_q // self.heads_kv, math.log2(self.seqlen_q),
                math.log2(self.seqlen_k), math.log2(self._rows() * self.heads_q), mods,
                math.log2(self._window_span()) if "window" in mods else 0.0, self.packed,
                bool(self.dropout))

    def _rows(self) -> float:
        """How many sequences of ``seqlen_q`` the batch's queries amount to."""
        return self.tokens_q / self.seqlen_q if self.packed else float(self.batch)

    def _window_span(self) -> int:
        """How many keys a row of the window sees at most (for the distance)."""
        left = self.seqlen_k if self.window_left < 0 else self.window_left
        right = 0 if self.causal else (self.seqlen_k if self.window_right < 0
                                       else self.window_right)
        return max(1, min(self.seqlen_k, left + right + 1))

    def flops(self, *, backward: bool = False) -> float:
        """ANCHORS.md: ``4 B Hq Nq Nk D``, halved when causal; backward is 2.5x forward.

        For causal with Nq != Nk the count is the number of (query, key) pairs actually
        visible under bottom-right alignment, which equals the half for square shapes. A
        packed problem counts the pairs of :meth:`packed_lengths`' sequences.
        """
        if self.packed:
            f = 4.0 * self.heads_q * self.head_dim * sum(
                replace(self, batch=1, seqlen_q=nq, seqlen_k=nk, tokens_q=0,
                        tokens_k=0)._pairs()
                for nq, nk in zip(*self.packed_lengths()) if nq and nk)
            return f * 2.5 if backward else f
        f = 4.0 * self.batch * self.heads_q * self._pairs() * self.head_dim
        return f * 2.5 if backward else f

    def _pairs(self) -> float:
        """The (query, key) pairs one sequence's row of heads computes."""
        pairs = float(self.seqlen_q) * self.seqlen_k
        if self.window_left != -1 or self.window_right != -1:
            pairs = float(visible_pairs(self.seqlen_q, self.seqlen_k, self.window_left,
                                        0 if self.causal else self.window_right))
        elif self.causal:
            if self.seqlen_q == self.seqlen_k:
                pairs /= 2
            else:
                pairs = float(visible_pairs(self.seqlen_q, self.seqlen_k, -1, 0))
        return pairs

    def keys_read(self) -> float:
        """The share of the keys (and values) that some query can see: a kernel must read
        those and no others. 1 but for a window that a short query block cannot span (a
        decode step under a 4096 window sees 4096 keys of a 32k cache)."""
        if self.window_left == -1 and self.window_right == -1:
            return 1.0
        right = 0 if self.causal else self.window_right
        lengths = zip(*self.packed_lengths()) if self.packed \
            else [(self.seqlen_q, self.seqlen_k)]
        seen = total = 0
        for nq, nk in lengths:
            seen += visible_keys(nq, nk, self.window_left, right) if nq else 0
            total += nk
        return seen / total if total else 1.0

    def describe(self) -> str:
        """One line for messages: ``B=.. Hq=.. Hkv=.. Nq=.. Nk=.. D=.. dtype [causal]``."""
        causal = " causal" if self.causal else ""
        mods = ""
        if self.window_left != -1 or self.window_right != -1:
            mods += f" window=({self.window_left},{self.window_right})"
        if self.softcap:
            mods += f" softcap={self.softcap:g}"
        if self.alibi:
            mods += " alibi"
        if self.packed:
            mods += f" packed({self.tokens_q}/{self.tokens_k} tokens)"
        if self.dropout:
            mods += f" dropout={self.dropout:g}"
        return (f"B={self.batch} Hq={self.heads_q} Hkv={self.heads_kv} Nq={self.seqlen_q} "
                f"Nk={self.seqlen_k} D={self.head_dim} {self.dtype}{causal}{mods}")


# the score modifications' fields and their defaults (off); a key omits those at default
MODS: dict[str, Any] = {"window_left": -1, "window_right": -1, "softcap": 0.0, "alibi": False}
_NO_MODS = tuple(MODS.values())
# a packed batch's fields and their defaults (dense); a key omits them when dense
PACKED: dict[str, Any] = {"tokens_q": 0, "tokens_k": 0}
# attention dropout's field and its default (none); a key omits it when 0
DROPOUT: dict[str, Any] = {"dropout": 0.0}
# every field a key may omit, at its default
OPTIONAL: dict[str, Any] = {**MODS, **PACKED, **DROPOUT}
# what a packed problem's distance to a dense one adds (one doubling of both lengths: the
# same kernels serve both, and tuning for a packed batch moved its tiles little)
PACKED_DISTANCE = 2.0
# what dropout against none adds to the distance (as packed against dense: the same
# kernels, with the mask's integer work beside the dots)
DROPOUT_DISTANCE = 2.0
# what a GQA group of another size adds to a forward's distance, beside the |log2| ratio of
# the two sizes (as packed against dense: the same kernels, each K/V head read for another
# number of query heads)
GROUP_DISTANCE = 2.0
# what differing score modifications add to the nearest-problem distance (as much as four
# doublings of both sequence lengths)
MODS_DISTANCE = 8.0


# :meth:`AttentionProblem.near_features`: GQA group, log2 of seqlen_q, seqlen_k and the
# rows x heads_q, the score modifications, log2 of the window's span (0 without a window),
# packed, dropout
NearFeatures = tuple[int, float, float, float, tuple[str, ...], float, bool, bool]


def features_distance(a: NearFeatures, b: NearFeatures, *,
                      across_groups: bool = False) -> float:
    """:meth:`AttentionProblem.distance` of two problems of the same dtype, head_dim and
    causal, from their :meth:`~AttentionProblem.near_features`."""
    group, lq, lk, rows, mods, span, packed, dropout = a
    o_group, o_lq, o_lk, o_rows, o_mods, o_span, o_packed, o_dropout = b
    if group != o_group:
        if not across_groups:
            return math.inf
        grouped = GROUP_DISTANCE + abs(math.log2(group) - math.log2(o_group))
    else:
        grouped = 0.0
    # other score modifications: a config still runs them, and tiles tuned without a
    # window are a better start than the template's default, but any problem with the
    # same ones is nearer
    if mods != o_mods:
        modded = MODS_DISTANCE
    else:
        modded = 0.5 * abs(span - o_span) if "window" in mods else 0.0
    # a packed batch: its grid's other axis is the work of tokens / longest sequences of
    # the longest's length; a dense config serves it (the same kernels) but a packed one is
    # nearer. Dropout: the same kernels with the mask's work added; any rate is as near as
    # another (the work does not depend on it), none against some is farther
    return (abs(lq - o_lq) + abs(lk - o_lk) + 0.5 * abs(rows - o_rows) + modded
            + (0.0 if packed == o_packed else PACKED_DISTANCE)
            + (0.0 if dropout == o_dropout else DROPOUT_DISTANCE) + grouped)


def _spread(tokens: int, count: int, longest: int) -> tuple[int, ...]:
    """``count`` lengths summing to ``tokens``, the first as long as the others' at least
    one token each allow (at most ``longest``), the rest as even as possible (empty ones
    where there are fewer tokens than sequences)."""
    first = min(longest, max(1, tokens - (count - 1)))
    rest, extra = divmod(tokens - first, count - 1) if count > 1 else (0, 0)
    return (first, *(rest + (i < extra) for i in range(count - 1)))


def visible_keys(seqlen_q: int, seqlen_k: int, left: int, right: int) -> int:
    """How many keys some query sees under :func:`visible_pairs`' window: the windows of
    consecutive queries overlap, so their union runs from query 0's first key to the last
    query's last."""
    shift = seqlen_k - seqlen_q
    lo = 0 if left < 0 else max(0, shift - left)
    hi = seqlen_k - 1 if right < 0 else min(seqlen_k - 1, seqlen_q - 1 + shift + right)
    return max(0, hi - lo + 1)


@functools.lru_cache(maxsize=256)
def visible_pairs(seqlen_q: int, seqlen_k: int, left: int, right: int) -> int:
    """How many (query, key) pairs a bottom-right aligned window ``(left, right)`` (-1:
    unbounded; causal is right 0) lets through: query ``i`` at key position
    ``i + seqlen_k - seqlen_q`` sees keys ``[pos - left, pos + right]`` within ``[0, seqlen_k)``."""
    total = 0
    shift = seqlen_k - seqlen_q
    for i in range(seqlen_q):
        pos = i + shift
        lo = 0 if left < 0 else max(0, pos - left)
        hi = seqlen_k - 1 if right < 0 else min(seqlen_k - 1, pos + right)
        total += max(0, hi - lo + 1)
    return total

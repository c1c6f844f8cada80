"""Problem keys: what a tuned config is keyed on, and the one bucketing scheme.

The tuner stores results under :meth:`AttentionProblem.key`; the dispatcher looks them up
by the same key, then by :meth:`AttentionProblem.bucket`, then by distance. Both sides
call these functions, so the two can never drift apart.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

DTYPES = ("fp16", "bf16")
# the head dims every kernel serves (the public ops refuse others, naming them)
SUPPORTED_HEAD_DIMS = (16, 32, 64, 96, 128, 192, 256)


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

    @classmethod
    def from_tensors(cls, q: Any, k: Any, *, causal: bool) -> AttentionProblem:
        """The problem of ``attention(q, k, v, causal=causal)`` (metadata only)."""
        b, hq, nq, d = q.shape
        return cls(int(b), int(hq), int(k.shape[1]), int(nq), int(k.shape[2]), int(d),
                   bool(causal), dtype_name(q.dtype))

    @classmethod
    def from_key(cls, key: Mapping[str, Any]) -> AttentionProblem:
        """The problem whose :meth:`key` is ``key`` (extra keys are ignored)."""
        return cls(**{f: key[f] for f in cls.__dataclass_fields__})

    def key(self) -> dict[str, Any]:
        """The problem as a dict of its fields: what the store and config files key on."""
        return asdict(self)

    def bucket(self) -> str:
        """Sequence lengths and batch rounded up to powers of two; everything else exact."""
        return (f"{self.dtype}-d{self.head_dim}-{'causal' if self.causal else 'full'}"
                f"-hq{self.heads_q}-hkv{self.heads_kv}-b{_pow2_ceil(self.batch)}"
                f"-nq{_pow2_ceil(self.seqlen_q)}-nk{_pow2_ceil(self.seqlen_k)}")

    def distance(self, other: AttentionProblem) -> float:
        """How far apart two problems are, for the nearest-tuned-shape lookup.

        ``inf`` unless dtype, head_dim, causal and the GQA group size agree (a config for
        one of those does not transfer); otherwise the sum of |log2| ratios of the sequence
        lengths, the batch x heads (the grid's other axis), weighted so that sequence
        length dominates.
        """
        if (self.dtype, self.head_dim, self.causal) != (other.dtype, other.head_dim, other.causal):
            return math.inf
        if self.heads_q // self.heads_kv != other.heads_q // other.heads_kv:
            return math.inf

        def lg(a: float, b: float) -> float:
            return abs(math.log2(a) - math.log2(b))

        return (lg(self.seqlen_q, other.seqlen_q) + lg(self.seqlen_k, other.seqlen_k)
                + 0.5 * lg(self.batch * self.heads_q, other.batch * other.heads_q))

    def flops(self, *, backward: bool = False) -> float:
        """ANCHORS.md: ``4 B Hq Nq Nk D``, halved when causal; backward is 2.5x forward.

        For causal with Nq != Nk the count is the number of (query, key) pairs actually
        visible under bottom-right alignment, which equals the half for square shapes.
        """
        pairs = float(self.seqlen_q) * self.seqlen_k
        if self.causal:
            if self.seqlen_q == self.seqlen_k:
                pairs /= 2
            else:
                pairs = float(sum(max(0, min(self.seqlen_k, i + 1 + self.seqlen_k - self.seqlen_q))
                                  for i in range(self.seqlen_q)))
        f = 4.0 * self.batch * self.heads_q * pairs * self.head_dim
        return f * 2.5 if backward else f

    def describe(self) -> str:
        """One line for messages: ``B=.. Hq=.. Hkv=.. Nq=.. Nk=.. D=.. dtype [causal]``."""
        causal = " causal" if self.causal else ""
        return (f"B={self.batch} Hq={self.heads_q} Hkv={self.heads_kv} Nq={self.seqlen_q} "
                f"Nk={self.seqlen_k} D={self.head_dim} {self.dtype}{causal}")

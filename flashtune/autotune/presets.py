"""Named problem sets for ``flashtune tune --preset NAME``.

Model presets take the attention geometry of one published model (query heads, key/value
heads, head dim, read from the model's Hugging Face ``config.json``) and sweep a ladder of
sequence lengths for causal prefill (``Nq == Nk``), with the batch chosen so that
``batch x seqlen`` stays at :data:`PRESET_TOKENS` tokens (at least batch 1). Heads are the
model's full counts: tensor parallelism (which divides them per GPU) is NOT applied.

``standard`` is :func:`flashtune.autotune.grids.standard_grid` (the FlashAttention papers'
grid: hidden 2048, 16k tokens, head dims 64 and 128, causal and not).

Light to import: no torch or triton.
"""

from __future__ import annotations

from dataclasses import dataclass

from flashtune.autotune.grids import standard_grid
from flashtune.core.errors import FlashtuneError
from flashtune.core.problem import AttentionProblem

__all__ = ["MODELS", "PRESET_SEQLENS", "PRESET_TOKENS", "ModelGeometry", "UnknownPresetError",
           "preset", "presets"]

PRESET_SEQLENS = (512, 2048, 8192, 16384)  # x4 steps from 512, plus the 16k top
PRESET_TOKENS = 16384


class UnknownPresetError(FlashtuneError, KeyError):
    """A preset name that is not defined; the message lists the known ones."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


@dataclass(frozen=True)
class ModelGeometry:
    """Attention geometry of one model and where the numbers come from."""

    heads_q: int
    heads_kv: int
    head_dim: int
    source: str


MODELS: dict[str, ModelGeometry] = {
    # meta-llama/Meta-Llama-3-8B config.json: num_attention_heads 32,
    # num_key_value_heads 8, hidden_size 4096 -> head_dim 4096 / 32 = 128.
    "llama3-8b": ModelGeometry(32, 8, 128, "meta-llama/Meta-Llama-3-8B config.json"),
    # meta-llama/Meta-Llama-3-70B config.json: num_attention_heads 64,
    # num_key_value_heads 8, hidden_size 8192 -> head_dim 128. Full head counts (no TP split).
    "llama3-70b": ModelGeometry(64, 8, 128, "meta-llama/Meta-Llama-3-70B config.json"),
    # mistralai/Mistral-7B-v0.1 config.json: num_attention_heads 32,
    # num_key_value_heads 8, hidden_size 4096 -> head_dim 128.
    "mistral-7b": ModelGeometry(32, 8, 128, "mistralai/Mistral-7B-v0.1 config.json"),
    # Qwen/Qwen2.5-7B config.json: num_attention_heads 28, num_key_value_heads 4,
    # hidden_size 3584 -> head_dim 3584 / 28 = 128.
    "qwen2.5-7b": ModelGeometry(28, 4, 128, "Qwen/Qwen2.5-7B config.json"),
    # google/gemma-2-9b config.json: num_attention_heads 16, num_key_value_heads 8,
    # head_dim 256 (explicit; hidden_size 3584 is not heads x head_dim).
    "gemma2-9b": ModelGeometry(16, 8, 256, "google/gemma-2-9b config.json"),
}


def presets() -> list[str]:
    """The known preset names: the model presets, then ``standard``."""
    return [*MODELS, "standard"]


def _model_ladder(geo: ModelGeometry, dtype: str,
                  seqlens: tuple[int, ...]) -> list[AttentionProblem]:
    return [AttentionProblem(max(1, PRESET_TOKENS // n), geo.heads_q, geo.heads_kv, n, n,
                             geo.head_dim, True, dtype) for n in seqlens]


def preset(name: str, *, dtype: str = "bf16",
           seqlens: tuple[int, ...] = PRESET_SEQLENS) -> list[AttentionProblem]:
    """The problems of preset ``name`` (case-insensitive); raises :class:`UnknownPresetError`.

    ``dtype`` and ``seqlens`` apply to model presets; ``standard`` uses the standard grid's
    own sequence lengths with ``dtype``.
    """
    key = name.strip().lower()
    if key == "standard":
        return standard_grid(dtype=dtype)
    if key not in MODELS:
        raise UnknownPresetError(f"unknown preset {name!r}; known presets: "
                                 f"{', '.join(presets())}")
    return _model_ladder(MODELS[key], dtype, seqlens)

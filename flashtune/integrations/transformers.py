"""Hugging Face transformers: ``import flashtune.integrations.transformers`` registers the
attention implementation ``"flashtune"``.

    import flashtune.integrations.transformers  # noqa: F401
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="flashtune")

It registers :func:`flashtune_attention_forward` in transformers' ``AttentionInterface`` and
transformers' SDPA mask builder under the same name in ``AttentionMaskInterface``, so a model
hands flashtune exactly what it would hand SDPA: no mask when the pattern is plain causal (or
one query row, decoding with a KV cache), a boolean mask otherwise (padding, sliding
windows, chunked prefill). Calls without a mask run flashtune's kernel (tuned lookup
included); calls with one run torch SDPA (see :mod:`flashtune.runtime.sdpa`, which logs the
reason once at DEBUG level).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from flashtune.runtime.sdpa import scaled_dot_product_attention

__all__ = ["NAME", "flashtune_attention_forward", "sdpa_arguments"]

NAME = "flashtune"


def flashtune_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                                value: torch.Tensor, attention_mask: torch.Tensor | None,
                                dropout: float = 0.0, scaling: float | None = None,
                                is_causal: bool | None = None, **kwargs: Any
                                ) -> tuple[torch.Tensor, None]:
    """The attention function transformers calls for ``attn_implementation="flashtune"``.

    Arguments:
        module: the attention layer (its ``training`` and ``is_causal`` are read).
        query: ``(B, Hq, Lq, D)``.
        key, value: ``(B, Hkv, Lk, D)`` (the KV cache already updated).
        attention_mask: the model's mask (from transformers' SDPA mask builder) or None;
            a mask sends the call to torch's SDPA.
        dropout: attention dropout, applied in training only.
        scaling: softmax scale (None: ``1 / sqrt(D)``).
        is_causal: None: the module's ``is_causal`` (default True).
        kwargs: the rest of transformers' contract; ``softcap`` and ``position_bias`` are
            refused.
    Returns:
        ``(out, None)``: ``out`` of shape ``(B, Lq, Hq, D)``, no attention weights.
    Raises:
        ValueError for ``softcap`` or ``position_bias`` (the message names the
        implementation to use instead).
    """
    out = scaled_dot_product_attention(**sdpa_arguments(module, query, key, value,
                                                        attention_mask, dropout, scaling,
                                                        is_causal, **kwargs))
    return out.transpose(1, 2).contiguous(), None


def sdpa_arguments(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                   value: torch.Tensor, attention_mask: torch.Tensor | None,
                   dropout: float = 0.0, scaling: float | None = None,
                   is_causal: bool | None = None, **kwargs: Any) -> dict[str, Any]:
    """The keyword arguments :func:`flashtune_attention_forward` hands
    :func:`flashtune.scaled_dot_product_attention` for one of transformers' calls
    (``flashtune bench --model`` asks :func:`~flashtune.runtime.sdpa.describe_route` where
    they go).

    Arguments:
        module, query, key, value, attention_mask, dropout, scaling, is_causal, kwargs: as
            for :func:`flashtune_attention_forward`.
    Returns:
        ``query``, ``key``, ``value``, ``attn_mask``, ``dropout_p`` (0 outside training),
        ``is_causal`` (as transformers' SDPA path decides it), ``scale`` and ``enable_gqa``.
    Raises:
        ValueError for ``softcap`` or ``position_bias``, as
        :func:`flashtune_attention_forward`.
    """
    if kwargs.get("softcap") is not None:
        raise ValueError("flashtune attention does not support `softcap`; use "
                         "attn_implementation='eager' for this model")
    if kwargs.get("position_bias") is not None:
        raise ValueError("flashtune attention does not support `position_bias`; use "
                         "attn_implementation='sdpa' or 'eager' for this model")
    q_length = query.shape[2]
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    # As transformers' SDPA path: causal only for several query rows and no explicit mask
    # (one row decoding against the cache sees every cached key).
    causal = bool(q_length > 1 and attention_mask is None and causal)
    return {"query": query, "key": key, "value": value, "attn_mask": attention_mask,
            "dropout_p": dropout if module.training else 0.0, "is_causal": causal,
            "scale": scaling, "enable_gqa": query.shape[1] != key.shape[1]}


def _skip_flash_package_import() -> None:
    """transformers 5.x takes every implementation name containing "flash" for a
    flash-attention package and imports that package (or a hub kernel) when a model is
    built; "flashtune" is neither, and needs none of what it would load. Wrap that import in
    ``transformers.modeling_utils`` so it returns at once for "flashtune" and behaves as
    before for every other name. A transformers without the hook needs nothing."""
    import transformers.modeling_utils as mu

    original = getattr(mu, "lazy_import_flash_attention", None)
    if original is None or getattr(original, "_flashtune_wrapped", False):
        return

    def lazy_import_flash_attention(implementation: Any, *args: Any, **kwargs: Any) -> Any:
        if implementation == NAME:
            return None
        return original(implementation, *args, **kwargs)

    lazy_import_flash_attention._flashtune_wrapped = True  # type: ignore[attr-defined]
    # setattr: modeling_utils imports the name from modeling_flash_attention_utils without
    # re-exporting it, so to a type checker (no implicit re-exports) the module lacks it
    setattr(mu, "lazy_import_flash_attention", lazy_import_flash_attention)  # noqa: B010


AttentionInterface.register(NAME, flashtune_attention_forward)
AttentionMaskInterface.register(NAME, sdpa_mask)
_skip_flash_package_import()

"""Hugging Face transformers: ``import flashtune.integrations.transformers`` registers the
attention implementation ``"flashtune"``.

    import flashtune.integrations.transformers  # noqa: F401
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="flashtune")

It registers :func:`flashtune_attention_forward` in transformers' ``AttentionInterface`` and
transformers' flash-attention mask builder under the same name in ``AttentionMaskInterface``,
so a model hands flashtune what it hands FlashAttention-2: no mask for plain causal (or one
query row against a KV cache), else the 2-D padding mask, and the layer's
``sliding_window`` and ``softcap``. As transformers' own flash-attention path
(``modeling_flash_attention_utils``) does, a padded batch is unpadded, run as a packed batch
(:func:`flashtune.attention_varlen`) and padded back; a padding-free batch (one row of
several sequences whose ``position_ids`` restart, ``DataCollatorWithFlattening``'s) runs as
a packed batch too, no token attending across sequences; a sliding window becomes
``window=(sliding_window - 1, sliding_window - 1)`` (its right bound is the causal one).
Plain calls go through :func:`flashtune.scaled_dot_product_attention` (tuned routing,
fallback counting). Every head dim up to 256 runs flashtune's kernels (Phi-2's 80 and odd
ones alike). Attention dropout while training (BERT-family configs: 0.1) runs flashtune's
kernels too, padded and packed batches included (flashtune's own mask, drawn per call
from torch's generator; see :func:`flashtune.attention`). What flashtune cannot serve (a
head dim over 256) runs torch's SDPA with the equivalent boolean mask, counted and logged
once there; a softcap it cannot serve (that head dim) is an error naming the way out.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

from flashtune.core.problem import MAX_HEAD_DIM
from flashtune.kernel_templates.attn_fwd.reference import visible
from flashtune.runtime import scored
from flashtune.runtime.checks import autocast_inputs
from flashtune.runtime.ops import attention
from flashtune.runtime.sdpa import scaled_dot_product_attention
from flashtune.runtime.static_cache import attention_static_cache, one_run

__all__ = ["NAME", "STEP_ROWS", "flashtune_attention_forward", "flashtune_attention_mask",
           "chunk_against_cache", "is_generation_step", "layer_window", "sdpa_arguments"]

NAME = "flashtune"
# a call of at most this many query rows with a padding mask over the whole cache is a
# generation step: it runs over the cache as it is, lengths from the mask on the device
# (runtime.static_cache), no sync and no copy, so a CUDA graph can hold it
STEP_ROWS = 16


def flashtune_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                                value: torch.Tensor, attention_mask: torch.Tensor | None,
                                dropout: float = 0.0, scaling: float | None = None,
                                is_causal: bool | None = None, **kwargs: Any
                                ) -> tuple[torch.Tensor, None]:
    """The attention function transformers calls for ``attn_implementation="flashtune"``.

    Arguments:
        module: the attention layer (its ``training`` and ``is_causal`` are read; for
            float32 inputs, as under autocast, the half dtype to run in: see
            :func:`_half_dtype`).
        query: ``(B, Hq, Lq, D)``.
        key, value: ``(B, Hkv, Lk, D)`` (the KV cache already updated); value's head dim
            may be narrower (MLA), then zero-padded to ``D`` and the output cropped to it.
        attention_mask: None, or the 2-D padding mask ``(B, Lk)`` (True: a real token)
            from transformers' flash-attention mask builder (shorter than ``Lk`` with a
            static cache, whose slots past it are empty: K/V are sliced to it, as
            transformers' flash path does); any other mask (a model that builds its own)
            runs torch's SDPA with it.
        dropout: attention dropout, applied in training only (``module.training``; the
            call's ``dropout_p`` is 0 otherwise), by flashtune's kernels.
        scaling: softmax scale (None: ``1 / sqrt(D)``).
        is_causal: None: the module's ``is_causal`` (default True).
        kwargs: the rest of transformers' contract: ``sliding_window``, ``softcap``,
            ``position_ids`` (a padding-free batch), ``cu_seq_lens_q``/``cu_seq_lens_k``
            with ``max_length_q``/``max_length_k`` (a collator's packed batch);
            ``position_bias`` and ``s_aux`` (attention sinks) are refused.
    Returns:
        ``(out, None)``: ``out`` of shape ``(B, Lq, Hq, Dv)`` (value's head dim), no
        attention weights.
    Raises:
        ValueError for ``position_bias`` or ``s_aux``, or a ``softcap`` with a head dim
        over 256 (the message names the implementation to use instead).
    """
    _refuse_unsupported(kwargs)
    query, key, value = autocast_inputs(query, key, value)  # mixed-precision training
    target = _half_dtype(query, module)
    if target is not None:
        query, key, value = query.to(target), key.to(target), value.to(target)
    head_dim, v_head_dim = query.shape[-1], value.shape[-1]
    if v_head_dim < head_dim:
        # a value head narrower than the query's (MLA: DeepSeek-V2/V3): padded with zeros
        # to the query's, the output's extra columns (zeros) cropped, as transformers' FA2
        # path does
        value = torch.nn.functional.pad(value, (0, head_dim - v_head_dim))
        out, _ = _forward(module, query, key, value, attention_mask, dropout, scaling,
                          is_causal, **kwargs)
        return out[..., :v_head_dim], None
    return _forward(module, query, key, value, attention_mask, dropout, scaling, is_causal,
                    **kwargs)


def _forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
             value: torch.Tensor, attention_mask: torch.Tensor | None, dropout: float,
             scaling: float | None, is_causal: bool | None, **kwargs: Any
             ) -> tuple[torch.Tensor, None]:
    """:func:`flashtune_attention_forward` with value's head dim the query's."""
    lq, lk = query.shape[2], key.shape[2]
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    causal = bool(causal and lq > 1)  # one row against the cache sees every cached key
    sliding = kwargs.get("sliding_window")
    window = layer_window(sliding, lk)
    softcap = kwargs.get("softcap")
    dropout_p = dropout if module.training else 0.0
    mask = attention_mask
    if mask is not None and is_generation_step(query, key, mask, dropout_p):
        out = attention_static_cache(query, key, value, mask, causal=causal, scale=scaling,
                                     window=window, softcap=softcap)
        return out.transpose(1, 2).contiguous(), None
    if mask is not None and mask.dim() == 2 and mask.shape[1] < lk:
        # a static cache: the slots past the mask hold no token yet; sliced off, as
        # transformers' flash path (_upad_input) does
        key, value = key[:, :, :mask.shape[1]], value[:, :, :mask.shape[1]]
        lk = mask.shape[1]
        window = layer_window(sliding, lk)
    if mask is not None and (mask.dim() != 2 or mask.shape[1] != lk):
        # not a padding mask of these keys (a model's own mask)
        if softcap is not None or window is not None:
            raise ValueError("flashtune attention got a mask it cannot read with "
                             "`softcap`/`sliding_window`; use attn_implementation='eager'")
        out = scaled_dot_product_attention(**sdpa_arguments(
            module, query, key, value, mask, dropout, scaling, is_causal, **kwargs))
        return out.transpose(1, 2).contiguous(), None
    packed = _packed(query, mask, kwargs)
    if mask is None and packed is None and window is None and softcap is None \
            and not chunk_against_cache(query, key, causal):
        out = scaled_dot_product_attention(**sdpa_arguments(
            module, query, key, value, None, dropout, scaling, is_causal, **kwargs))
        return out.transpose(1, 2).contiguous(), None
    if query.shape[-1] > MAX_HEAD_DIM:
        if softcap is not None:
            raise ValueError("flashtune attention cannot run `softcap` with this head dim; "
                             "use attn_implementation='eager'")
        dense = _dense_mask(query, key, mask, packed, causal, window)
        out = scaled_dot_product_attention(
            query, key, value, attn_mask=dense, dropout_p=dropout_p, scale=scaling,
            enable_gqa=query.shape[1] != key.shape[1])
        return out.transpose(1, 2).contiguous(), None
    options: dict[str, Any] = {"causal": causal, "scale": scaling, "window": window,
                               "softcap": softcap, "dropout_p": dropout_p}
    if packed is not None:  # one row of several sequences
        cu, longest = packed
        q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))
        out = _varlen(q, k, v, cu, cu, longest, longest, **options)
        return out[None], None
    if mask is None:
        out = attention(query, key, value, causal=causal, scale=scaling, window=window,
                        softcap=softcap, dropout_p=dropout_p)
        return out.transpose(1, 2).contiguous(), None
    # a causal call's queries are the mask's last Lq tokens (FA2's reading); a non-causal
    # one's only in self-attention: cross-attention's queries are another sequence's
    rows = causal or (lq == lk and not _cross_attention(module))
    return _padded(query, key, value, mask, options, rows), None


def layer_window(sliding: int | None, lk: int) -> tuple[int, int] | None:
    """A layer's sliding window as flashtune's ``window``.

    Arguments:
        sliding: the ``sliding_window`` transformers hands the call (None: the layer has
            none).
        lk: the call's key count.
    Returns:
        ``(sliding - 1, sliding - 1)`` (FlashAttention-2's reading; the right bound is the
        causal one), or None where the keys do not outrun the window.
    """
    return (sliding - 1, sliding - 1) if sliding is not None and lk > sliding else None


def _half_dtype(query: torch.Tensor, module: torch.nn.Module) -> torch.dtype | None:
    """The half dtype float32 inputs outside autocast run in, as transformers' FA2 path
    casts them (under autocast :func:`~flashtune.runtime.checks.autocast_inputs` has cast
    them to its dtype: the rotary embedding's float32 cos/sin turn queries float32 again):
    a quantized model's dtype, else that of the layer's first linear weight. None where the
    inputs are not float32 or the answer is not a half dtype (a float32 model: flashtune's
    checks refuse it on the paths that reach its kernels)."""
    if query.dtype != torch.float32:
        return None
    if hasattr(getattr(module, "config", None), "_is_quantized"):
        target = getattr(module.config, "dtype", None)
    else:
        target = next((m.weight.dtype for m in module.modules()
                       if isinstance(m, torch.nn.Linear)), None)
    return target if target in (torch.float16, torch.bfloat16) else None


def _refuse_unsupported(kwargs: dict[str, Any]) -> None:
    """A score term flashtune's kernels do not add: T5's ``position_bias``, and the
    attention sinks (``s_aux``: a learned logit per head in every row's softmax) of gpt-oss
    and its kin. Refused rather than dropped, which would change the model's output."""
    for name in ("position_bias", "s_aux"):
        if kwargs.get(name) is not None:
            raise ValueError(f"flashtune attention does not support `{name}`; use "
                             "attn_implementation='sdpa' or 'eager' for this model")


def chunk_against_cache(query: torch.Tensor, key: torch.Tensor, causal: bool) -> bool:
    """Whether a causal call without a mask is several query rows against more keys: a
    prompt's later chunk (chunked prefill, a second turn, assisted generation's candidates)
    over a dynamic cache that holds the tokens before it. FlashAttention-2's mask builder
    hands it no mask, and FA2 aligns its causal mask bottom-right: query ``i`` sees the
    cache and the chunk's first ``i + 1`` tokens. torch's ``is_causal`` is top-left (it
    would see the first ``i + 1`` keys), so this call goes to :func:`flashtune.attention`,
    not to the SDPA drop-in.

    Arguments:
        query: ``(B, Hq, Lq, D)``.
        key: ``(B, Hkv, Lk, D)``.
        causal: the call's causal flag as :func:`flashtune_attention_forward` decides it.
    Returns:
        True for a causal call of several query rows against more keys.
    """
    return causal and 1 < query.shape[2] < key.shape[2]


def is_generation_step(query: torch.Tensor, key: torch.Tensor, mask: torch.Tensor | None,
                     dropout_p: float) -> bool:
    """Whether a call is a generation step over the whole cache: a few query rows against
    more keys (a cache), a 2-D padding mask of every key (the cache's slots included:
    :func:`flashtune_attention_mask` makes it so for a static cache), no dropout, a head
    dim flashtune takes. While compiling
    or capturing a CUDA graph the mask is taken as generation makes it (left padding, the
    tokens, then empty slots); eagerly it is checked once per mask tensor (a sync) and one
    with holes takes the unpadded path.

    Arguments:
        query: ``(B, Hq, Lq, D)``.
        key: ``(B, Hkv, Lk, D)``.
        mask: what transformers hands the attention function (None, 2-D or not).
        dropout_p: the call's dropout (0 outside training).
    Returns:
        True where :func:`~flashtune.runtime.static_cache.attention_static_cache` serves
        the call.
    """
    if mask is None or mask.dim() != 2 or query.shape[2] > STEP_ROWS or dropout_p > 0 \
            or key.shape[2] <= query.shape[2] or mask.shape != (query.shape[0], key.shape[2]) \
            or query.shape[-1] > MAX_HEAD_DIM:
        return False
    if torch.compiler.is_compiling() or (mask.is_cuda and
                                         torch.cuda.is_current_stream_capturing()):
        return True
    memo = _RUN_MEMO.get("last")
    if memo is not None and memo[0] is mask and memo[1] == mask._version:
        return memo[2]
    found = one_run(mask)
    _RUN_MEMO["last"] = (mask, mask._version, found)
    return found


# the last step mask seen and whether it is one run per row (every layer shares it)
_RUN_MEMO: dict[str, tuple[torch.Tensor, int, bool]] = {}


def flashtune_attention_mask(batch_size: int, q_length: int, kv_length: int,
                             q_offset: Any = None, kv_offset: int = 0,
                             mask_function: Any = None,
                             attention_mask: torch.Tensor | None = None,
                             **kwargs: Any) -> torch.Tensor | None:
    """transformers' mask builder for ``"flashtune"``: FlashAttention-2's
    (``flash_attention_mask``: None for plain causal, else the 2-D padding mask), except
    for a generation step (at most :data:`STEP_ROWS` query rows), whose mask covers the
    whole cache and keeps its shape from step to step: a static cache's empty slots are
    padded in as False (FA2's builder returns the mask of the tokens so far, one column
    longer each step, and K/V get sliced to it), and while compiling or capturing a CUDA
    graph the mask is returned without FA2's ``mask.all()`` (a sync).

    Arguments:
        batch_size, q_length, kv_length, q_offset, kv_offset, mask_function, kwargs:
            transformers' mask-builder arguments (``masking_utils``).
        attention_mask: the 2-D padding mask ``(B, tokens so far)`` (1: a real token), or
            None.
    Returns:
        None (plain causal) or a boolean 2-D padding mask; for a generation step over a
        static cache ``(B, kv_length)``.
    """
    if attention_mask is None and q_offset is not None:  # (a caller that gives no
        # offset gets no mask made up: its cache's keys are taken as tokens, as FA2's)
        attention_mask = _cache_tokens(batch_size, q_length, kv_length, q_offset,
                                       kwargs.get("device"))
    if attention_mask is not None and q_length <= STEP_ROWS:
        mask = attention_mask[:, -kv_length:].bool()
        if mask.shape[1] < kv_length:  # a static cache: slots past the tokens are empty
            return torch.nn.functional.pad(mask, (0, kv_length - mask.shape[1]), value=False)
        if torch.compiler.is_compiling() or (mask.is_cuda and
                                             torch.cuda.is_current_stream_capturing()):
            return mask
    built: torch.Tensor | None = flash_attention_mask(
        batch_size, q_length, kv_length, 0 if q_offset is None else q_offset, kv_offset,
        **({} if mask_function is None else {"mask_function": mask_function}),
        attention_mask=attention_mask, **kwargs)
    return built


def _cache_tokens(batch_size: int, q_length: int, kv_length: int, q_offset: Any,
                  device: Any) -> torch.Tensor | None:
    """The padding mask a call without one stands for where the cache has empty slots (a
    static cache before it fills: ``q_offset + q_length`` of its ``kv_length`` slots hold
    tokens), else None. FA2's builder returns None there, and the call would attend the
    empty slots; with this mask the call sees the tokens only, as one with generate's mask
    of ones does. A static cache's offset is a tensor: a step's mask (at most
    :data:`STEP_ROWS` rows) is the whole cache's, compared on the device (no sync, so it
    compiles and captures); a longer chunk's is the tokens' (the offset read once)."""
    if isinstance(q_offset, torch.Tensor):
        if q_length <= STEP_ROWS:
            slots = torch.arange(kv_length, device=q_offset.device)
            return (slots < q_offset + q_length).expand(batch_size, kv_length)
        q_offset = int(q_offset)
    tokens = q_offset + q_length
    if tokens >= kv_length:
        return None
    return torch.ones(batch_size, tokens, dtype=torch.bool, device=device)


def _packed(query: torch.Tensor, mask: torch.Tensor | None,
            kwargs: dict[str, Any]) -> tuple[torch.Tensor, int] | None:
    """``(cu_seqlens, longest)`` of a padding-free batch (one row holding several
    sequences), else None: from a collator's ``cu_seq_lens_q`` where given (with
    ``max_length_q``), else where ``position_ids`` restart (transformers'
    ``_is_packed_sequence``); remembered for the tensor the layers share."""
    if mask is not None or query.shape[0] != 1:
        return None
    cu = kwargs.get("cu_seq_lens_q")
    if cu is not None:
        cu_k = kwargs.get("cu_seq_lens_k")
        if cu_k is not None and not torch.equal(cu_k, cu):
            return None  # different query and key splits: not a plain packed batch
        longest = kwargs.get("max_length_q")
        if longest is None:
            longest = int((cu[1:] - cu[:-1]).max())
        return cu.to(torch.int32), int(longest)
    positions = kwargs.get("position_ids")
    if positions is None or positions.shape[-1] == 1 or positions.shape[-1] != query.shape[2]:
        return None
    last = _PACKED_MEMO.get("last")
    if last is not None and last[0] is positions and last[1] == positions._version:
        return last[2]
    flat = positions.reshape(-1)
    starts = (flat == flat.min()).nonzero().view(-1).to(torch.int32)
    found: tuple[torch.Tensor, int] | None = None
    if starts.numel() > 1:  # positions restart: several sequences in the row
        cu = torch.cat((starts, torch.tensor([flat.numel()], dtype=torch.int32,
                                             device=flat.device)))
        found = (cu, int((cu[1:] - cu[:-1]).max()))
    _PACKED_MEMO["last"] = (positions, positions._version, found)
    return found


# the last position_ids seen and what they said (every layer of a forward passes the same)
_PACKED_MEMO: dict[str, tuple[torch.Tensor, int, tuple[torch.Tensor, int] | None]] = {}


def _padded(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
            mask: torch.Tensor, options: dict[str, Any], rows: bool = True) -> torch.Tensor:
    """A padded batch (``mask`` ``(B, Lk)``, True: a real token) as transformers' flash
    path runs it: the real tokens packed, the packed kernel, then put back. With ``rows``
    the queries are the last ``Lq`` positions of the mask, and padded query rows are zeros;
    without (cross-attention: the mask is the keys' only), every query row attends to its
    sequence's real keys, as eager attention runs it."""
    b, hq, lq, d = query.shape
    lk = key.shape[2]
    idx_q, idx_k, cu_q, cu_k, longest_q, longest_k = _unpadding(mask, lq)
    k = key.transpose(1, 2).reshape(b * lk, -1, d)[idx_k]
    v = value.transpose(1, 2).reshape(b * lk, -1, d)[idx_k]
    q = query.transpose(1, 2).reshape(b * lq, hq, d)
    if not rows:
        cu_q = torch.arange(0, (b + 1) * lq, lq, dtype=torch.int32, device=query.device)
        every: torch.Tensor = _varlen(q, k, v, cu_q, cu_k, lq, longest_k, **options)
        return every.view(b, lq, hq, d)
    out = _varlen(q[idx_q], k, v, cu_q, cu_k, longest_q, longest_k, **options)
    full: torch.Tensor = out.new_zeros(b * lq, hq, d)
    full[idx_q] = out
    return full.view(b, lq, hq, d)


def _cross_attention(module: torch.nn.Module) -> bool:
    """Whether transformers' attention layer attends another sequence (an encoder's, in an
    encoder-decoder model), as its modules say it: ``is_cross_attention`` (BERT's, and
    most), a class named so (``BertCrossAttention``), or a decoder's layer that is not
    causal (BART's, Whisper's ``encoder_attn``)."""
    if getattr(module, "is_cross_attention", False) or "CrossAttention" in type(module).__name__:
        return True
    return bool(getattr(module, "is_decoder", False)) and not getattr(module, "is_causal", True)


def _unpadding(mask: torch.Tensor, lq: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                      torch.Tensor, int, int]:
    """``(query indices, key indices, cu_seqlens_q, cu_seqlens_k, longest query, longest
    key)`` of a padding mask (transformers' ``_get_unpad_data``), remembered for the mask
    tensor every layer of one forward shares: one read back to the host per forward, not
    one per layer."""
    memo = _UNPAD_MEMO.get("last")
    if memo is not None and memo[0] is mask and memo[1] == (mask._version, lq):
        return memo[2]  # type: ignore[no-any-return]
    keep_k = mask.bool()
    lens_k = keep_k.sum(-1, dtype=torch.int32)
    keep_q = keep_k[:, -lq:]
    lens_q = keep_q.sum(-1, dtype=torch.int32)
    cu_k = torch.nn.functional.pad(lens_k.cumsum(0, dtype=torch.int32), (1, 0))
    cu_q = torch.nn.functional.pad(lens_q.cumsum(0, dtype=torch.int32), (1, 0))
    idx_k = keep_k.flatten().nonzero().view(-1)
    idx_q = keep_q.flatten().nonzero().view(-1)
    longest_q, longest_k = (max(int(x), 1) for x in
                            torch.stack((lens_q.max(), lens_k.max())).tolist())
    found = (idx_q, idx_k, cu_q, cu_k, longest_q, longest_k)
    _UNPAD_MEMO["last"] = (mask, (mask._version, lq), found)
    return found


_UNPAD_MEMO: dict[str, tuple[torch.Tensor, tuple[int, int], Any]] = {}  # mask, version, data
# the packed kernel without reading cu_seqlens back per call (built here, valid), eagerly
# under torch.compile
_varlen = functools.partial(torch.compiler.disable(scored.varlen),  # type: ignore[no-untyped-call]
                            read_lengths=False)


def _dense_mask(query: torch.Tensor, key: torch.Tensor, mask: torch.Tensor | None,
                packed: tuple[torch.Tensor, int] | None, causal: bool,
                window: tuple[int, int] | None) -> torch.Tensor:
    """The boolean ``(B, 1, Lq, Lk)`` mask torch's SDPA needs for what flashtune would have
    run: padding, bottom-right causal and window per sequence (left-padded rows aligned to
    their real tokens, as the unpadded run aligns them), packed sequences kept apart. A
    row that sees nothing (a padding row) sees every key instead: SDPA needs one visible
    key per row, and those rows' outputs are not used."""
    b, lq, lk = query.shape[0], query.shape[2], key.shape[2]
    device = query.device
    pattern = visible(lq, lk, causal=causal, window=window or (-1, -1), device=device)
    dense = pattern[None].expand(b, lq, lk).clone()
    if mask is not None:
        dense &= mask.bool()[:, None, :]
    if packed is not None:  # lq == lk: the pattern's offsets are those inside a sequence
        seq = torch.bucketize(torch.arange(lk, device=device), packed[0][1:].to(torch.int64),
                              right=True)
        dense &= seq[None, -lq:, None] == seq[None, None, :]
    dense |= ~dense.any(-1, keepdim=True)  # padding rows: anything, their output is dropped
    return dense[:, None]


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
        ValueError for ``position_bias`` or ``s_aux``, as
            :func:`flashtune_attention_forward`.
    """
    _refuse_unsupported(kwargs)
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
    ``transformers.modeling_utils`` so it returns at once for "flashtune" (and names that
    start with it, as ``bench --model``'s probe) and behaves as before for every other
    name. A transformers without the hook needs nothing."""
    import transformers.modeling_utils as mu

    original = getattr(mu, "lazy_import_flash_attention", None)
    if original is None or getattr(original, "_flashtune_wrapped", False):
        return

    def lazy_import_flash_attention(implementation: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(implementation, str) and implementation.startswith(NAME):
            return None
        return original(implementation, *args, **kwargs)

    lazy_import_flash_attention._flashtune_wrapped = True  # type: ignore[attr-defined]
    # setattr: modeling_utils imports the name from modeling_flash_attention_utils without
    # re-exporting it, so to a type checker (no implicit re-exports) the module lacks it
    setattr(mu, "lazy_import_flash_attention", lazy_import_flash_attention)  # noqa: B010


AttentionInterface.register(NAME, flashtune_attention_forward)
AttentionMaskInterface.register(NAME, flashtune_attention_mask)
_skip_flash_package_import()

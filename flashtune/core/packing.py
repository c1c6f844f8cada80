"""Packed batches (FlashAttention-2's varlen layout): the checks of their cumulative lengths
that need no device read, shared by the runtime's entry (which also reads the values) and
the launchers that take ``cu_seqlens`` directly."""

from __future__ import annotations

from typing import Any

import torch

from flashtune.core.errors import InputError, InputTypeError

__all__ = ["check_cu_seqlens"]


def check_cu_seqlens(name: str, cu: Any, device: torch.device) -> None:
    """``cu`` as cumulative sequence lengths, by its metadata alone: an int32 tensor (as
    ``flash_attn_varlen_func``'s), 1-D with ``batch + 1 >= 2`` entries, on ``device`` (q's).

    Raises:
        InputTypeError or InputError naming ``name``. The values (starting at 0, not
        decreasing, ending at the token count) live on the device: reading them is the
        caller's to decide.
    """
    if not isinstance(cu, torch.Tensor):
        raise InputTypeError(f"{name} must be a torch.Tensor of int32, got {type(cu).__name__}")
    if cu.dtype != torch.int32:
        raise InputTypeError(f"{name} must be int32 (as flash_attn_varlen_func's), got "
                             f"{cu.dtype}")
    if cu.dim() != 1 or cu.numel() < 2:
        raise InputError(f"{name} must be 1-D with batch + 1 >= 2 entries, got shape "
                         f"{tuple(cu.shape)}")
    if cu.device != device:
        raise InputError(f"{name} is on {cu.device}, q on {device}; they must share a device")

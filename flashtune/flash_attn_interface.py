"""FlashAttention-2's public API over flashtune (``flash_attn.flash_attn_interface``'s
functions, names, signatures, layouts and return values), so that code written for it
switches by changing its import:

    from flashtune.flash_attn_interface import flash_attn_func, flash_attn_varlen_func

The code lives in :mod:`flashtune.integrations.flash_attn` (its docstring says which
FlashAttention-2 commit it follows and where flashtune differs).
"""

from __future__ import annotations

from flashtune.integrations.flash_attn import (
    FA2_COMMIT,
    FlashAttnInputError,
    FlashAttnInputTypeError,
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
    flash_attn_with_kvcache,
)

__all__ = [
    "FA2_COMMIT",
    "FlashAttnInputError",
    "FlashAttnInputTypeError",
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_with_kvcache",
]

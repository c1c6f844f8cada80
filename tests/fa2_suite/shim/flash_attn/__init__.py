"""A stand-in for the ``flash_attn`` package, for FlashAttention-2's own test file only
(``tests/fa2_suite/conftest.py`` puts it first on ``sys.path`` during collection): its seven
functions are flashtune's (:mod:`flashtune.flash_attn_interface`); ``bert_padding``,
``layers.rotary`` and ``ops.triton.rotary`` are FlashAttention-2's own helpers, vendored."""

from flash_attn.flash_attn_interface import (  # noqa: F401
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
    flash_attn_with_kvcache,
)

__version__ = "2.8.4+flashtune"

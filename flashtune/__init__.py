"""flashtune: autotuned Triton flash-attention kernels.

``import flashtune`` is light: torch and triton are imported on first use of an op, so the
CLI's ``--help`` and the database tools start fast.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from flashtune._version import __version__
from flashtune.core.errors import (
    ConfigError,
    DeviceError,
    FlashtuneError,
    ImportRejected,
    InputError,
    InputTypeError,
    SchemaError,
    StoreError,
    UnknownTemplateError,
)

if TYPE_CHECKING:  # pragma: no cover
    from flashtune.runtime.kvcache import attention_with_kvcache
    from flashtune.runtime.lookup import ConfigChoice
    from flashtune.runtime.ops import (
        attention,
        attention_varlen,
        lookup_config,
        reload_configs,
        warmup,
    )
    from flashtune.runtime.sdpa import scaled_dot_product_attention

__all__ = [
    "__version__",
    "attention",
    "attention_varlen",
    "attention_with_kvcache",
    "lookup_config",
    "reload_configs",
    "scaled_dot_product_attention",
    "warmup",
    "ConfigChoice",
    "ConfigError",
    "DeviceError",
    "FlashtuneError",
    "ImportRejected",
    "InputError",
    "InputTypeError",
    "SchemaError",
    "StoreError",
    "UnknownTemplateError",
]

_LAZY = {
    "attention": ("flashtune.runtime.ops", "attention"),
    "attention_varlen": ("flashtune.runtime.ops", "attention_varlen"),
    "attention_with_kvcache": ("flashtune.runtime.kvcache", "attention_with_kvcache"),
    "lookup_config": ("flashtune.runtime.ops", "lookup_config"),
    "reload_configs": ("flashtune.runtime.ops", "reload_configs"),
    "warmup": ("flashtune.runtime.ops", "warmup"),
    "scaled_dot_product_attention": ("flashtune.runtime.sdpa", "scaled_dot_product_attention"),
    "ConfigChoice": ("flashtune.runtime.lookup", "ConfigChoice"),
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        value = getattr(importlib.import_module(module), attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'flashtune' has no attribute {name!r}")

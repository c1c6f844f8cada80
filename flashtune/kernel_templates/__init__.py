"""Triton kernel templates, one folder per family, and their registry.

Importing this package imports torch and triton and registers every template.
"""

from __future__ import annotations

from flashtune.kernel_templates.registry import (
    TemplateSpec,
    catalog,
    get_template,
    register_template,
    template_names,
    unregister_template,
)
from flashtune.kernel_templates import attn_fwd  # noqa: F401  (registers "attn_fwd")
from flashtune.kernel_templates import attn_bwd  # noqa: F401  (registers "attn_bwd")
from flashtune.kernel_templates import attn_decode  # noqa: F401  (registers "attn_decode")

__all__ = ["TemplateSpec", "catalog", "get_template", "register_template", "template_names",
           "unregister_template"]

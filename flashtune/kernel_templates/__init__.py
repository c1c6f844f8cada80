"""Kernel implementations, one folder per template, and their registry.

Importing this package is light: the registry imports the template folders (and so torch
and triton) the first time it is asked for a template; ``from
flashtune.kernel_templates.attn_fwd import ...`` imports one directly.
"""

from __future__ import annotations

from flashtune.kernel_templates.registry import (
    TemplateSpec,
    catalog,
    get_template,
    implementations,
    known_names,
    register_template,
    template_names,
    unregister_template,
)

__all__ = ["TemplateSpec", "catalog", "get_template", "implementations", "known_names",
           "register_template", "template_names", "unregister_template"]

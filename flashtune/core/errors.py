"""flashtune's exception hierarchy: one root, focused subclasses.

Every error says what was wrong, what was expected and, where it helps, what to do.
Subclasses also derive from the matching builtin (``ValueError``, ``KeyError``...) so
callers that catch the builtin keep working.
"""

from __future__ import annotations


class FlashtuneError(Exception):
    """Root of every exception flashtune raises on purpose."""


class InputError(FlashtuneError, ValueError):
    """A tensor or argument given to a public op is not acceptable."""


class InputTypeError(FlashtuneError, TypeError):
    """A tensor or argument has the wrong type or dtype."""


class ConfigError(FlashtuneError, ValueError):
    """A kernel config has unknown keys or values outside the template's search space."""


class UnknownTemplateError(FlashtuneError, KeyError):
    """A template name that is not registered."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class DeviceError(FlashtuneError, RuntimeError):
    """The requested device cannot run the kernel (e.g. CPU tensors without the interpreter)."""


class StoreError(FlashtuneError):
    """A database operation failed; the message names the database and the operation."""


class SchemaError(StoreError):
    """The database schema is older (upgrade it) or newer (upgrade flashtune) than this code."""


class ImportRejected(FlashtuneError, ValueError):
    """A config file failed validation; nothing was written."""

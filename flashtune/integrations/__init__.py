"""Integrations with other libraries; each submodule registers flashtune on import."""

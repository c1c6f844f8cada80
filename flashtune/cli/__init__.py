"""flashtune's command line (``flashtune ...``); the root group is :mod:`flashtune.cli.main`.

Importing this package imports nothing heavy (no torch, no triton).
"""

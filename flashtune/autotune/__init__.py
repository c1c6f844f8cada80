"""Search: problems, devices, spaces, strategies, runners and jobs.

Importing this package is light; optuna and torch load only in the modules that need them.
"""

"""Plots and an HTML page of what the tuning database holds (``flashtune report``).

:func:`~flashtune.report.studies.collect_studies` reads the studies from a store (no
matplotlib needed); :func:`~flashtune.report.page.write_report` draws the PNGs with
matplotlib's Agg backend and writes ``index.html`` beside them. matplotlib is optional:
``pip install matplotlib`` (or the ``report`` extra).

:mod:`~flashtune.report.headroom` reads exhaustive sweeps (JSON from the benchmarks) rather
than the store: the ceilings any tuner could reach in a space (``python -m
flashtune.report.headroom``).
"""

from __future__ import annotations

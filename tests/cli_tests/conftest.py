"""CLI test set-up: the package's shipped tables are replaced by an empty folder, so what a
command prints does not depend on whether the files in flashtune/configs/ are current for
this checkout's kernels (``flashtune show``, ``db info`` and ``db verify`` list stale ones).
Tests of that listing put their own files in a folder of their own."""

from __future__ import annotations

from pathlib import Path

import pytest

from flashtune.runtime import sources


@pytest.fixture(autouse=True)
def no_shipped_tables(tmp_path_factory: pytest.TempPathFactory,
                      monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path_factory.mktemp("package-configs")
    real = sources.source_dirs
    monkeypatch.setattr(sources, "source_dirs",
                        lambda: [(k, folder if k == "package" else p) for k, p in real()])
    return folder

"""Test set-up: run kernels under the Triton interpreter on CPU unless a GPU is asked for.

``TRITON_INTERPRET`` must be decided before triton is imported, so it happens here, first.
On a GPU machine run ``FLASHTUNE_TEST_DEVICE=cuda pytest`` to run the same tests compiled.
"""

from __future__ import annotations

import os

_WANT = os.environ.get("FLASHTUNE_TEST_DEVICE", "cpu")
if _WANT == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

DEVICE = "cuda" if _WANT == "cuda" else "cpu"


def pytest_configure(config: pytest.Config) -> None:
    if DEVICE == "cuda" and not torch.cuda.is_available():
        raise pytest.UsageError("FLASHTUNE_TEST_DEVICE=cuda but torch sees no CUDA device")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if DEVICE == "cuda":
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run with FLASHTUNE_TEST_DEVICE=cuda)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def device() -> str:
    return DEVICE

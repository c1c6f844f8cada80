"""DeviceFingerprint helpers."""

from __future__ import annotations

import dataclasses

from flashtune.core.device import DeviceFingerprint, interpreter_device

H100 = DeviceFingerprint("NVIDIA_H100_80GB_HBM3", "9.0", 132, 232448, 85 << 30)


def test_capability_parses_major_minor_and_is_none_for_the_interpreter():
    assert H100.capability == (9, 0)
    assert dataclasses.replace(H100, compute_capability="12.1").capability == (12, 1)
    assert interpreter_device().capability is None
    assert dataclasses.replace(H100, compute_capability="sm90").capability is None

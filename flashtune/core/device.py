"""Device descriptions: what a template's validity predicate and the store key on.

A :class:`DeviceFingerprint` names a GPU (or the CPU interpreter) and carries the limits
that decide whether a config can run there. Tuned results are keyed by the hardware fields
(``name``, ``compute_capability``, ``sm_count``, ``shared_mem_per_block``,
``total_memory``); software versions travel with each tuning run.
"""

from __future__ import annotations

import functools
import os
import re
from dataclasses import asdict, dataclass, field
from typing import Any

CPU_INTERPRETER = "cpu-interpreter"


def normalize_gpu_name(name: str) -> str:
    """``'NVIDIA H100 80GB HBM3'`` -> ``'NVIDIA_H100_80GB_HBM3'`` (safe in file names)."""
    cleaned = re.sub(r"[^0-9A-Za-z.+-]+", "_", name.strip()).strip("_")
    return cleaned or "unknown_device"


@dataclass(frozen=True)
class DeviceFingerprint:
    """Hardware identity and limits of one device, plus the software it was read under."""

    name: str
    compute_capability: str  # "9.0"; "cpu" for the interpreter
    sm_count: int
    shared_mem_per_block: int  # bytes a block may opt in to
    total_memory: int  # bytes
    cuda_version: str = ""
    driver_version: str = ""
    torch_version: str = ""
    triton_version: str = ""
    extra: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    @property
    def is_interpreter(self) -> bool:
        return self.name == CPU_INTERPRETER

    @property
    def capability(self) -> tuple[int, int] | None:
        """``compute_capability`` as ``(major, minor)``; None where it is not one ("cpu")."""
        try:
            major, minor = self.compute_capability.split(".")
            return int(major), int(minor)
        except ValueError:
            return None

    def hardware_key(self) -> tuple[str, str, int, int, int]:
        """The fields that identify the hardware; software versions are not part of it."""
        return (self.name, self.compute_capability, self.sm_count,
                self.shared_mem_per_block, self.total_memory)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@functools.cache
def sm_count(index: int) -> int:
    """Streaming multiprocessors of CUDA device ``index`` (asked once): what a persistent
    launch sizes its grid by."""
    import torch

    return int(torch.cuda.get_device_properties(index).multi_processor_count)


def interpreter_device() -> DeviceFingerprint:
    """The Triton CPU interpreter as a device: no shared-memory limit worth pruning on."""
    import triton

    try:
        import torch

        torch_version = str(torch.__version__)
    except ImportError:  # pragma: no cover - torch is a dependency
        torch_version = ""
    return DeviceFingerprint(
        name=CPU_INTERPRETER,
        compute_capability="cpu",
        sm_count=os.cpu_count() or 1,
        shared_mem_per_block=1 << 30,
        total_memory=0,
        torch_version=torch_version,
        triton_version=triton.__version__,
    )


def cuda_device(index: int | None = None) -> DeviceFingerprint:
    """Fingerprint of a CUDA device (the current one when ``index`` is None)."""
    import torch
    import triton

    if index is None:
        index = torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    smem = int(getattr(props, "shared_memory_per_block_optin", 0) or 0)
    if smem == 0:  # older torch: ask triton's driver
        smem = int(triton.runtime.driver.active.utils.get_device_properties(index)["max_shared_mem"])
    driver = ""
    try:
        driver = str(torch.cuda.driver_version()) if hasattr(torch.cuda, "driver_version") else ""
    except Exception:  # pragma: no cover - informational only
        driver = ""
    return DeviceFingerprint(
        name=normalize_gpu_name(props.name),
        compute_capability=f"{props.major}.{props.minor}",
        sm_count=int(props.multi_processor_count),
        shared_mem_per_block=smem,
        total_memory=int(props.total_memory),
        cuda_version=str(torch.version.cuda or ""),
        driver_version=driver,
        torch_version=str(torch.__version__),
        triton_version=triton.__version__,
    )


def interpreting() -> bool:
    """True when Triton kernels run under the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def current_device(tensor_device: Any = None) -> DeviceFingerprint:
    """The device a launch on ``tensor_device`` (a ``torch.device``) would run on."""
    if tensor_device is not None and getattr(tensor_device, "type", "cuda") == "cpu":
        return interpreter_device()
    if interpreting():
        return interpreter_device()
    index = getattr(tensor_device, "index", None) if tensor_device is not None else None
    return cuda_device(index)

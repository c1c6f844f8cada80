"""``direct.RawLaunch``: the argument list it hands Triton's compiled C launcher is the one
Triton's own Python layer (``CudaLauncher.__call__`` and ``wrap_handle_tensordesc``) builds
for the same call, tensor descriptors (leading, fixed and late ones) expanded in place;
where the launcher is not the object it knows, it steps aside. On CPU: Triton's real
wrappers around a recording stand-in for the C function."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from flashtune.kernel_templates.direct import HostDesc, RawLaunch

driver = pytest.importorskip("triton.backends.nvidia.driver")


class _Recorder:
    """Stands in for the compiled C launcher (a builtin: no ``__code__``)."""

    def __init__(self) -> None:
        self.calls: list[list[Any]] = []

    def __call__(self, *args: Any) -> None:
        self.calls.append(list(args))


# (name, Triton signature type): two leading tensors and a descriptor, a fixed descriptor,
# scalars and a constexpr, and a late descriptor between fixed arguments
SIGNATURE = {"q": "*bf16", "out": "*bf16", "q_desc": "tensordesc<bf16[64, 64]>",
             "k_desc": "tensordesc<bf16[64, 64]>", "seqlen": "i32", "scale": "fp32",
             "o_desc": "tensordesc<bf16[64, 64]>", "stride": "i64", "BLOCK": "constexpr"}
N_VARYING = 3


def _launcher(recorder: _Recorder, **changes: Any) -> Any:
    run = object.__new__(driver.CudaLauncher)
    values = dict(num_ctas=1, launch=driver.wrap_handle_tensordesc(recorder, SIGNATURE, None),
                  global_scratch_size=0, global_scratch_align=1, profile_scratch_size=0,
                  profile_scratch_align=1, launch_cooperative_grid=False, launch_pdl=True)
    values.update(changes)
    for name, value in values.items():
        setattr(run, name, value)
    return run


def _desc(rows: int) -> HostDesc:
    return HostDesc(torch.zeros(rows, 64), [rows, 64], [64, 1])


def test_the_raw_launch_hands_the_c_launcher_what_triton_would() -> None:
    triton_side, raw_side = _Recorder(), _Recorder()
    k_desc, o_build = _desc(256), _desc(128)
    tail = (k_desc, 1000, 0.125, o_build, 4096, 64)  # fixed, except o_desc (late)
    late = (6 - N_VARYING,)
    raw = RawLaunch.of(_launcher(raw_side), N_VARYING, tail, late)
    assert raw is not None
    for call in range(2):  # new tensors each call, as a plan's calls bring
        q, out, o = torch.zeros(128, 64), torch.zeros(128, 64), _desc(128 + call)
        q_desc = HostDesc(q, [128, 64], [64, 1])
        _launcher(triton_side)(4, 2, 1, 77, "fn", "packed", None, None, None, q, out, q_desc,
                               k_desc, 1000, 0.125, o, 4096, 64)
        raw(4, 2, 1, 77, "fn", "packed", (q, out, q_desc), (o,))
        assert raw_side.calls[-1] == triton_side.calls[-1]
    assert len(raw_side.calls[-1]) > 13 + len(SIGNATURE)  # descriptors were expanded


def test_without_descriptors_or_late_arguments_too() -> None:
    plain = {"q": "*bf16", "n": "i32", "BLOCK": "constexpr"}
    triton_side, raw_side = _Recorder(), _Recorder()
    run = _launcher(raw_side, launch=driver.wrap_handle_tensordesc(raw_side, plain, None))
    assert run.launch is raw_side  # Triton leaves a kernel without descriptors unwrapped
    raw = RawLaunch.of(run, 1, (5, 32), ())
    assert raw is not None
    q = torch.zeros(4)
    _launcher(triton_side, launch=triton_side)(1, 1, 1, 0, "fn", "p", None, None, None,
                                               q, 5, 32)
    raw(1, 1, 1, 0, "fn", "p", (q,), ())
    assert raw_side.calls == triton_side.calls


def test_it_steps_aside_where_triton_is_not_as_it_knows() -> None:
    tail = (_desc(256), 1000, 0.125, _desc(128), 4096, 64)
    assert RawLaunch.of(lambda *a: None, N_VARYING, tail, (3,)) is None  # not a CudaLauncher
    # scratch memory is allocated by the launcher per launch
    assert RawLaunch.of(_launcher(_Recorder(), global_scratch_size=16), N_VARYING, tail,
                        (3,)) is None
    # a Python launcher that is not Triton's descriptor closure
    assert RawLaunch.of(_launcher(_Recorder(), launch=lambda *a: None), N_VARYING, tail,
                        (3,)) is None
    # a late argument that is no descriptor
    assert RawLaunch.of(_launcher(_Recorder()), N_VARYING, tail, (1,)) is None

"""``direct.RawLaunch``: the argument list it hands Triton's compiled C launcher is the one
Triton's own Python layer (``CudaLauncher.__call__`` and ``wrap_handle_tensordesc``) builds
for the same call, tensor descriptors (leading, fixed and late ones) expanded in place;
where the launcher is not the object it knows, it steps aside. On CPU: Triton's real
wrappers around a recording stand-in for the C function."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from flashtune.kernel_templates import direct
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
    """A call passes each changing descriptor's base tensor; the launcher gets what
    Triton's layer gives for a descriptor of the build call's geometry over that base."""
    triton_side, raw_side = _Recorder(), _Recorder()
    k_desc, o_build = _desc(256), _desc(128)
    tail = (k_desc, 1000, 0.125, o_build, 4096, 64)  # fixed, except o_desc (late)
    late = (6 - N_VARYING,)
    lead = (torch.zeros(128, 64), torch.zeros(128, 64), _desc(128))
    raw = RawLaunch.of(_launcher(raw_side), lead, tail, late)
    assert raw is not None
    for _ in range(2):  # new tensors each call, as a plan's calls bring
        q, out, o = torch.zeros(128, 64), torch.zeros(128, 64), torch.zeros(128, 64)
        _launcher(triton_side)(4, 2, 1, 77, "fn", "packed", None, None, None, q, out,
                               HostDesc(q, [128, 64], [64, 1]), k_desc, 1000, 0.125,
                               HostDesc(o, [128, 64], [64, 1]), 4096, 64)
        raw(4, 2, 1, 77, "fn", "packed", (q, out, q), (o,))
        assert raw_side.calls[-1] == triton_side.calls[-1]
        assert raw_side.calls[-1][15] is q  # the base itself, as Triton hands it
    assert len(raw_side.calls[-1]) > 13 + len(SIGNATURE)  # descriptors were expanded


def test_the_fallback_wraps_each_base_in_its_slots_geometry() -> None:
    """Where the raw launch steps aside, DirectLaunch hands Triton's launcher descriptors
    again: the base of each descriptor slot in the build call's shape, strides and padding."""
    q = torch.zeros(8, 64)
    geometry = ([8, 64], [64, 1], "nan")
    plain, desc = direct._described((q, q), (None, geometry))
    assert plain is q and isinstance(desc, HostDesc)
    assert (desc.base, desc.shape, desc.strides, desc.padding) == (q, *geometry)
    assert direct._geometry(q) is None and direct._geometry(3) is None
    assert direct._geometry(_desc(8)) == ([8, 64], [64, 1], "zero")


def test_without_descriptors_or_late_arguments_too() -> None:
    plain = {"q": "*bf16", "n": "i32", "BLOCK": "constexpr"}
    triton_side, raw_side = _Recorder(), _Recorder()
    run = _launcher(raw_side, launch=driver.wrap_handle_tensordesc(raw_side, plain, None))
    assert run.launch is raw_side  # Triton leaves a kernel without descriptors unwrapped
    raw = RawLaunch.of(run, (torch.zeros(4),), (5, 32), ())
    assert raw is not None
    q = torch.zeros(4)
    _launcher(triton_side, launch=triton_side)(1, 1, 1, 0, "fn", "p", None, None, None,
                                               q, 5, 32)
    raw(1, 1, 1, 0, "fn", "p", (q,), ())
    assert raw_side.calls == triton_side.calls


def test_it_steps_aside_where_triton_is_not_as_it_knows() -> None:
    tail = (_desc(256), 1000, 0.125, _desc(128), 4096, 64)
    lead = (torch.zeros(128, 64), torch.zeros(128, 64), _desc(128))
    assert RawLaunch.of(lambda *a: None, lead, tail, (3,)) is None  # not a CudaLauncher
    # scratch memory is allocated by the launcher per launch
    assert RawLaunch.of(_launcher(_Recorder(), global_scratch_size=16), lead, tail,
                        (3,)) is None
    # a Python launcher that is not Triton's descriptor closure
    assert RawLaunch.of(_launcher(_Recorder(), launch=lambda *a: None), lead, tail,
                        (3,)) is None
    # a late argument that is no descriptor
    assert RawLaunch.of(_launcher(_Recorder()), lead, tail, (1,)) is None
    # a host decomposition that does not start with the base
    assert RawLaunch.build(_Recorder(), False, False, lead, tail, (3,), {2, 3, 6}, (),
                           lambda d, m: [*d.shape, d.base]) is None


def test_device_descriptors_are_encoded_once_per_slot_and_address() -> None:
    """A device descriptor (Triton's metadata set) is a tensor map encoded on the host from
    the base address and the slot's fixed geometry: kept by slot and base address, so a call
    whose tensors sit where an earlier call's did reuses it; a new address or another slot
    encodes anew, and the launcher gets what a fresh encoding gives each time."""
    encoded: list[tuple[int, tuple[int, ...], str]] = []

    def expand(desc: HostDesc, meta: Any) -> list[Any]:  # make_tensordesc_arg's shape
        encoded.append((desc.base.data_ptr(), tuple(desc.shape), meta))
        return [("map", desc.base.data_ptr(), meta), *desc.shape, *desc.strides]

    recorder = _Recorder()
    a, b, out = torch.zeros(64, 64), torch.zeros(64, 64), torch.zeros(64, 64)
    # leading: a tensor and a descriptor; tail: a scalar, a late descriptor, a scalar
    raw = RawLaunch.build(recorder, False, False, (a, HostDesc(a, [32, 64], [64, 1])),
                          (7, HostDesc(out, [64, 64], [64, 1]), 9), (1,), {1, 3},
                          ["meta-q", "meta-o"], expand)
    assert raw is not None
    assert not encoded  # both descriptors change per call: encoded at their first call

    def call(q: torch.Tensor, o: torch.Tensor) -> list[Any]:
        raw(1, 1, 1, 0, "fn", "p", (q, q), (o,))
        return recorder.calls[-1]

    first = call(a, out)
    assert first[13:] == [a, ("map", a.data_ptr(), "meta-q"), 32, 64, 64, 1, 7,
                          ("map", out.data_ptr(), "meta-o"), 64, 64, 64, 1, 9]
    assert len(encoded) == 2
    assert call(a, out) == first and len(encoded) == 2  # the same addresses: reused
    call(b, out)
    assert encoded[-1] == (b.data_ptr(), (32, 64), "meta-q") and len(encoded) == 3
    call(out, a)  # the same addresses in the other slots: encoded for each slot
    assert len(encoded) == 5
    for _ in range(2 * direct._MAPS):  # bounded: the cache starts again
        call(torch.zeros(64, 64), out)
    assert all(len(k._maps) <= direct._MAPS for k in raw._varying if hasattr(k, "_maps"))
    # Triton's host decomposition holds the tensor itself: the base goes in per call,
    # the rest was expanded once
    host: list[Any] = []

    def host_expand(desc: Any, meta: Any) -> list[Any]:
        host.append(desc)
        return list(driver.make_tensordesc_arg(desc, meta))

    plain = RawLaunch.build(recorder, False, False, (a, HostDesc(a, [64, 64], [64, 1])),
                            (7,), (), {1}, [None], host_expand)
    assert plain is not None and len(host) == 1
    for t in (a, b, a):
        plain(1, 1, 1, 0, "fn", "p", (t, t), ())
        assert recorder.calls[-1][13:] == [t, *driver.make_tensordesc_arg(
            HostDesc(t, [64, 64], [64, 1]), None), 7]
    assert len(host) == 1


def test_scratch_is_handed_out_again_only_where_launches_stay_in_order(monkeypatch) -> None:
    """A plan's scratch (a discarded LSE, split-KV partials) comes back to calls on the
    build's stream from the build's thread, outside CUDA-graph capture; every other call
    gets None (it allocates its own), and a plan over the limit or built under capture
    keeps nothing."""
    import threading

    capturing = [False]
    monkeypatch.setattr(direct, "current_stream", lambda index: 70 + index)
    monkeypatch.setattr(direct, "capturing", lambda: capturing[0])
    bufs = (torch.zeros(4), torch.zeros(2))
    scratch = direct.Scratch(1, bufs)
    assert scratch.get(71) is bufs
    assert scratch.get(70) is None  # another stream
    seen: list[Any] = []
    worker = threading.Thread(target=lambda: seen.append(scratch.get(71)))
    worker.start()
    worker.join()
    assert seen == [None]  # another thread: its launches may interleave with this one's
    capturing[0] = True
    assert scratch.get(71) is None  # a graph must not hold the plan's buffers
    assert direct.Scratch(1, bufs).get(71) is None  # built under capture: nothing kept
    capturing[0] = False
    assert direct.Scratch(1, bufs, limit=23).get(71) is None  # 24 bytes over a limit of 23
    assert direct.Scratch(1, bufs, limit=24).get(71) is bufs


@pytest.mark.parametrize("template", ["attn_fwd", "attn_fwd_gluon"])
def test_a_plan_binds_every_tensor_descriptor_per_call(template: str) -> None:
    """A launch plan replays its build call's fixed arguments: a tensor descriptor among
    them would keep the build call's tensor (attn_fwd's second head-dim tile did: its
    columns came from a buffer freed after the build). Every descriptor parameter of the
    kernel is one of the plan's leading arguments or one it may bind late."""
    import importlib
    import inspect

    plan = importlib.import_module(f"flashtune.kernel_templates.{template}.plan")
    kernel = plan.attn_fwd_kernel if template == "attn_fwd" else plan.gluon_attn_fwd_kernel
    names = kernel.arg_names
    late = set(getattr(plan, "_LATE", ()))
    source = inspect.getsource(plan)
    late |= {n for n in names if f'late=("{n}",)' in source}  # the Gluon plan's o_desc
    per_call = set(names[:plan._VARYING]) | late
    descriptors = {n for n in names if n.startswith("desc_") or n.endswith("_desc")}
    assert descriptors, names
    assert descriptors <= per_call, sorted(descriptors - per_call)

"""Shared data of the op choice tests: toy implementations beside the real catalog (an
extern with an empty space, a second Triton-like forward), stores filled with the store
API, documents."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from flashtune.core.case import forward_case
from flashtune.core.device import DeviceFingerprint
from flashtune.core.problem import AttentionProblem
from flashtune.core.space import SearchSpace
from flashtune.core.spec import TemplateSpec
from flashtune.db import SoftwareVersions, open_store
from flashtune.db.exchange import ChoiceDocument, ChoiceDocumentEntry, DeviceInfo
from flashtune.kernel_templates import catalog
from flashtune.kernel_templates.attn_fwd.reference import attn_fwd_reference

EXTERN = "sdpa_toy"  # an extern implementation: no knobs
EXTERN_HASH = "e0e1e2e3e4e5e6e7"


def _not_run(*args: Any, **kwargs: Any) -> Any:
    raise AssertionError("the exchange never runs an implementation")


def extern_spec(name: str = EXTERN, source_hash: str = EXTERN_HASH) -> TemplateSpec:
    """A toy extern implementation of fwd and decode (what torch SDPA's backends are)."""
    return TemplateSpec(
        name=name, op="fwd", source_hash=source_hash, launcher=_not_run,
        reference=attn_fwd_reference, space=SearchSpace({}, lambda c, p, d: None),
        default_config=lambda problem, device: {},
        make_case=lambda problem, device, **kw: forward_case(attn_fwd_reference, problem,
                                                             device, **kw),
        kind="extern", torch_bound=True, serves=("fwd", "decode"))


# the real attn_fwd (fwd, decode), attn_decode (decode) and attn_bwd (no user op), and the
# toy extern: what the exchange functions take as ``specs``
SPECS = {**catalog(), EXTERN: extern_spec()}
FWD = SPECS["attn_fwd"].source_hash
DECODE = SPECS["attn_decode"].source_hash
OLD = "0123456789abcdef"

FWD_PROBLEMS = (
    AttentionProblem(2, 8, 2, 256, 256, 64, True, "bf16"),
    AttentionProblem(1, 4, 4, 77, 133, 64, False, "fp16"),
    AttentionProblem(4, 32, 8, 4096, 4096, 128, True, "fp16"),
)
DECODE_PROBLEMS = (
    AttentionProblem(8, 32, 8, 1, 8192, 128, False, "bf16"),
    AttentionProblem(1, 16, 2, 4, 1000, 64, True, "fp16"),
)
FWD_CFG = {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3}
DECODE_CFG = {"BLOCK_N": 64, "NUM_SPLITS": 16, "num_warps": 4, "num_stages": 2}
UNDER = SoftwareVersions(cuda="12.6", driver="560.35.03", flashtune="0.5.0",
                         torch="2.6.0+cu126", triton="3.2.0")
T0 = datetime(2027, 1, 10, 12, 0, 0, tzinfo=timezone.utc)


def decide(url: str, device: DeviceFingerprint, op: str, problem: AttentionProblem,
           **kwargs: Any) -> None:
    """One decision, as the tuner records it (``put_choice``'s keywords)."""
    with open_store(url) as store:
        d = store.ensure_device(device)
        store.put_choice(d.id, op, problem.key(), **kwargs)


def fill(url: str, device: DeviceFingerprint, scale: float = 1.0) -> None:
    """Three fwd decisions (attn_fwd beats the extern; the extern wins alone; attn_fwd
    decided at an old source: stale) and two decode decisions on ``device``."""
    decide(url, device, "fwd", FWD_PROBLEMS[0], implementation="attn_fwd", source_hash=FWD,
           config=FWD_CFG, median_ms=1.0 * scale, tflops=300.0, runner_up=EXTERN,
           runner_up_ms=1.3 * scale, extern=EXTERN, extern_ms=1.3 * scale,
           candidates=[{"implementation": "attn_fwd", "config": FWD_CFG, "median_ms": 1.0},
                       {"implementation": EXTERN, "config": {}, "median_ms": 1.3}],
           software=UNDER)
    decide(url, device, "fwd", FWD_PROBLEMS[1], implementation=EXTERN,
           source_hash=EXTERN_HASH, config={}, median_ms=0.02 * scale, tflops=None,
           runner_up="attn_fwd", runner_up_ms=0.025 * scale, extern=EXTERN,
           extern_ms=0.02 * scale, software=UNDER)
    decide(url, device, "fwd", FWD_PROBLEMS[2], implementation="attn_fwd", source_hash=OLD,
           config=FWD_CFG, median_ms=3.0 * scale, tflops=400.0)
    decide(url, device, "decode", DECODE_PROBLEMS[0], implementation="attn_decode",
           source_hash=DECODE, config=DECODE_CFG, median_ms=0.05 * scale, tflops=2.0,
           runner_up="attn_fwd", runner_up_ms=0.09 * scale,
           software=SoftwareVersions(torch="2.7.0"))
    decide(url, device, "decode", DECODE_PROBLEMS[1], implementation="attn_fwd",
           source_hash=FWD, config={**FWD_CFG, "BLOCK_M": 16}, median_ms=0.04 * scale,
           tflops=1.0, runner_up="attn_decode", runner_up_ms=0.041 * scale, software=UNDER)


H100_INFO = DeviceInfo("NVIDIA_H100_80GB_HBM3", "9.0", 132, 232448, 85520809984)


def entry(problem: AttentionProblem = FWD_PROBLEMS[0], **changes: Any) -> ChoiceDocumentEntry:
    values: dict[str, Any] = dict(
        problem=problem.key(), implementation="attn_fwd", config=dict(FWD_CFG),
        median_ms=1.0, tflops=300.0, runner_up=EXTERN, runner_up_ms=1.3, extern=EXTERN,
        extern_ms=1.3, decided_at=T0)
    values.update(changes)
    return ChoiceDocumentEntry(**values)


def choice_document(*entries: ChoiceDocumentEntry, op: str = "fwd",
                    implementations: dict[str, str] | None = None,
                    device: DeviceInfo = H100_INFO) -> ChoiceDocument:
    """A document of ``entries`` (default: one attn_fwd win over the extern)."""
    entries = entries or (entry(),)
    names = implementations
    if names is None:
        named = {n for e in entries for n in (e.implementation, e.runner_up, e.extern) if n}
        names = {n: SPECS[n].source_hash if n in SPECS else OLD for n in named}
    return ChoiceDocument(device=device, software=UNDER.as_dict(), op=op,
                          implementations=names, entries=tuple(entries), exported_at=T0)

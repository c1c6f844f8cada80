"""Host cost of one :func:`flashtune.attention` call against torch's SDPA and a bare Triton
launch: what ``flashtune bench --dispatch`` runs.

Small shapes, so the GPU finishes each kernel before the CPU has issued the next: the wall
time per call of a long loop of calls is then the host's cost. Per shape, interleaved rounds
of ``calls`` calls each of:

* ``attention``: ``flashtune.attention(q, k, v, causal=...)`` after a first call (its checks,
  the memoised route, the routed implementation's launch);
* ``routed``: the routed implementation's launcher called directly with the routed config
  (what the call costs below flashtune's dispatch; for an SDPA backend, its aten op);
* ``triton``: ``attn_fwd_kernel[grid](*args)`` with the arguments built beforehand (Triton's
  own launch path for attn_fwd's default config, nothing of flashtune's);
* ``sdpa``: ``torch.nn.functional.scaled_dot_product_attention`` as torch picks its backend,
  and ``sdpa_flash`` / ``sdpa_cudnn`` with the backend forced (the ``sdpa_kernel`` context
  entered once, outside the loop).

* ``attention_new_shape`` and ``sdpa_new_shape``: the same calls without a mask and with
  one more key each time, as a decode step over a dynamic cache meets (K and V views of a
  longer buffer):
  every ``attention`` call is a signature not seen before, so it pays the route and the
  plan of a first call; each round runs a tenth of ``calls`` of them (the keys grow by that
  many a round).

Each is checked against ``sdpa`` once before it is timed (the growing ones against SDPA
without the mask at the same length). Reported per shape: microseconds
per call (wall and this thread's CPU time), ``attention`` over ``sdpa`` (issue 25's target: at
most 1.0) and ``attention - routed`` (flashtune's own dispatch cost), from the round medians;
and ``attention`` over ``sdpa`` from each one's fastest round (``best_us_per_call``): a
host's hiccups (another process, a clock change) only ever add time, and on a shared GPU
host they moved whole rounds of both by up to 60% (``dispatch_*_h200.json``), so the fastest
round is the steadier estimate of what a call costs.
"""

from __future__ import annotations

import contextlib
import platform
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from flashtune.runtime.bench import _first_line

__all__ = ["DEFAULT_SHAPES", "DispatchShape", "bench_dispatch", "render_dispatch"]


@dataclass(frozen=True)
class DispatchShape:
    """One call's shape: ``(batch, heads, seqlen, head_dim)`` queries, ``kv_heads`` key/value
    heads of ``kv_seqlen`` (0: ``seqlen``), causal or not."""

    batch: int
    heads: int
    seqlen: int
    head_dim: int
    causal: bool = False
    kv_heads: int = 0
    kv_seqlen: int = 0

    @property
    def label(self) -> str:
        hkv = self.kv_heads or self.heads
        nk = self.kv_seqlen or self.seqlen
        return (f"B{self.batch} H{self.heads}" + (f"/{hkv}" if hkv != self.heads else "")
                + f" N{self.seqlen}" + (f"/{nk}" if nk != self.seqlen else "")
                + f" D{self.head_dim}" + (" causal" if self.causal else ""))


# prefill-like and decode-like calls small enough that the host, not the GPU, sets the pace
DEFAULT_SHAPES = (DispatchShape(1, 8, 128, 64), DispatchShape(1, 8, 128, 128, True),
                  DispatchShape(4, 32, 256, 128, True),
                  DispatchShape(8, 32, 1, 128, False, kv_heads=8, kv_seqlen=512))


def _per_call_us(fn: Callable[[], Any], calls: int, cuda: bool) -> tuple[float, float]:
    """(wall us, this thread's CPU us) per call of a loop of ``calls`` calls."""
    if cuda:
        torch.cuda.synchronize()
    t, c = time.perf_counter(), time.thread_time()
    for _ in range(calls):
        fn()
    elapsed, cpu = time.perf_counter() - t, time.thread_time() - c
    if cuda:
        torch.cuda.synchronize()
    return elapsed / calls * 1e6, cpu / calls * 1e6


@contextlib.contextmanager
def _backend(name: str) -> Iterator[None]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    forced = {"sdpa_flash": SDPBackend.FLASH_ATTENTION,
              "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION}.get(name)
    if forced is None:
        yield
        return
    with sdpa_kernel(forced):
        yield


class _Growing:
    """``call(q, k, v)`` with one more key than the last call each time: the views
    ``k[:, :, :n]`` of a buffer holding ``extra`` keys past the shape's."""

    def __init__(self, call: Callable[..., Any], q: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor, extra: int, gen: torch.Generator) -> None:
        more = (k.shape[0], k.shape[1], extra, k.shape[3])
        self.q, self.call, self.n = q, call, k.shape[2]
        self.k, self.v = (torch.cat([t, torch.randn(more, device=t.device, dtype=t.dtype,
                                                    generator=gen)], dim=2) for t in (k, v))

    def __call__(self) -> Any:
        self.n += 1
        return self.call(self.q, self.k[:, :, :self.n], self.v[:, :, :self.n])

    def reference(self, sdpa: Callable[..., torch.Tensor]) -> torch.Tensor:
        """``sdpa`` at the length of the last call."""
        return sdpa(self.q, self.k[:, :, :self.n], self.v[:, :, :self.n])


def _growing_calls(calls: int) -> int:
    """How many calls a round of a growing contender makes."""
    return max(1, calls // 10)


def _contenders(s: DispatchShape, device: str, calls: int = 2000, rounds: int = 5) -> tuple[dict[str, Callable[[], Any]],
                                                         dict[str, Any]]:
    from flashtune.core.device import current_device
    from flashtune.core.problem import AttentionProblem
    from flashtune.kernel_templates import get_template
    from flashtune.kernel_templates.attn_fwd.launcher import kernel_args, tma_ok
    from flashtune.runtime.ops import attention, lookup_config

    dtype = torch.float16 if device == "cpu" else torch.bfloat16
    gen = torch.Generator(device=device).manual_seed(0)
    hkv, nk = s.kv_heads or s.heads, s.kv_seqlen or s.seqlen
    q = torch.randn(s.batch, s.heads, s.seqlen, s.head_dim, device=device, dtype=dtype,
                    generator=gen)
    k = torch.randn(s.batch, hkv, nk, s.head_dim, device=device, dtype=dtype, generator=gen)
    v = torch.randn_like(k)
    gqa = hkv != s.heads
    choice = lookup_config(q, k, v, causal=s.causal)
    routed = get_template(choice.template)
    cfg = dict(choice.config)
    fwd = get_template("attn_fwd")
    problem = AttentionProblem(s.batch, s.heads, hkv, s.seqlen, nk, s.head_dim, s.causal,
                               "fp16" if dtype == torch.float16 else "bf16")
    tcfg = fwd.default_config(problem, current_device(q.device))
    out = torch.empty_like(q)
    use_tma = bool(tcfg.get("USE_TMA")) and tma_ok(q, k, v, out)
    args, kwargs, grid = kernel_args(q, k, v, out, None, tcfg, causal=s.causal,
                                     scale=s.head_dim ** -0.5, use_tma=use_tma,
                                     upcast_dot=device == "cpu" and dtype == torch.bfloat16)
    kernel: Any = fwd.kernel

    def triton_launch() -> torch.Tensor:
        kernel[grid](*args, **kwargs)
        return out

    def sdpa_of(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=s.causal,
                                                                enable_gqa=gqa)

    def sdpa() -> torch.Tensor:
        return sdpa_of(q, k, v)

    def plain_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=gqa)

    # every call of every round and check a new length (two checks, three warm-up calls)
    extra = _growing_calls(calls) * rounds + 8
    fns: dict[str, Callable[[], Any]] = {
        "attention": lambda: attention(q, k, v, causal=s.causal),
        "routed": lambda: routed.launcher(q, k, v, cfg, causal=s.causal),
        "triton": triton_launch,
        "sdpa": sdpa,
        # without the mask: torch's is_causal is aligned top-left, flashtune's bottom-right,
        # and they differ once the keys outnumber the queries
        "attention_new_shape": _Growing(lambda q, k, v: attention(q, k, v), q, k, v, extra,
                                        gen),
        "sdpa_new_shape": _Growing(plain_sdpa, q, k, v, extra, gen),
    }
    if device == "cuda":
        fns["sdpa_flash"] = fns["sdpa_cudnn"] = sdpa
    return fns, {"route": f"{choice.template} ({choice.source})", "config": cfg,
                 "triton_config": dict(tcfg), "reference": plain_sdpa}


def bench_dispatch(shapes: Sequence[DispatchShape] = DEFAULT_SHAPES, *, calls: int = 2000,
                   rounds: int = 5, interpret: bool = False) -> dict[str, Any]:
    """Per shape, each contender of the module doc checked against ``sdpa`` and then timed
    over ``calls`` calls, ``rounds`` times in rotation (the median kept).

    Returns:
        The run as a JSON-ready dict: ``rows``, one per shape, with ``us_per_call`` and
        ``cpu_us_per_call`` per contender, ``attention_over_sdpa``, ``dispatch_us``
        (``attention - routed``), the route and configs, and ``errors`` for a contender
        that failed its check or raised (not timed).
    Raises:
        RuntimeError without a GPU unless ``interpret`` (CPU tensors under the interpreter:
        the pipeline, not the host cost of a GPU launch).
    """
    if not interpret and not torch.cuda.is_available():
        raise RuntimeError("no CUDA GPU: bench --dispatch measures the host cost of a GPU "
                           "launch (--interpret checks the pipeline on CPU)")
    device = "cpu" if interpret else "cuda"
    cuda = device == "cuda"
    rows = []
    for s in shapes:
        fns, meta = _contenders(s, device, calls, rounds)
        plain_sdpa = meta.pop("reference")
        errors: dict[str, str] = {}
        ref = fns["sdpa"]().float()
        for name, fn in fns.items():
            try:
                with _backend(name):
                    for _ in range(3 if cuda else 1):  # compile, route, warm the caches
                        got = fn()
                got = got[0] if isinstance(got, tuple) else got
                want = fn.reference(plain_sdpa).float() if isinstance(fn, _Growing) else ref
                err = float((got.float() - want).norm() / want.norm())
                if not err < 2e-2:
                    errors[name] = f"relative error {err:.2e} vs sdpa"
            except Exception as exc:  # a backend that cannot take the shape: data
                errors[name] = _first_line(exc)
        timed = [n for n in fns if n not in errors]
        wall: dict[str, list[float]] = {n: [] for n in timed}
        cpu: dict[str, list[float]] = {n: [] for n in timed}
        for _ in range(rounds):
            for name in timed:
                n = _growing_calls(calls) if isinstance(fns[name], _Growing) else calls
                with _backend(name):
                    w, c = _per_call_us(fns[name], n, cuda)
                wall[name].append(w)
                cpu[name].append(c)
        med = {n: statistics.median(xs) for n, xs in wall.items()}
        row: dict[str, Any] = {
            "shape": asdict(s), "label": s.label, **meta, "errors": errors,
            "us_per_call": med,
            "cpu_us_per_call": {n: statistics.median(xs) for n, xs in cpu.items()},
            "samples_us": wall}
        best = {n: min(xs) for n, xs in wall.items()}
        row["best_us_per_call"] = best
        if "attention" in med and "sdpa" in med:
            row["attention_over_sdpa"] = med["attention"] / med["sdpa"]
            row["attention_over_sdpa_best"] = best["attention"] / best["sdpa"]
        if "attention" in med and "routed" in med:
            row["dispatch_us"] = med["attention"] - med["routed"]
        if "attention_new_shape" in med and "sdpa_new_shape" in med:
            row["new_shape_over_sdpa"] = med["attention_new_shape"] / med["sdpa_new_shape"]
        rows.append(row)
    ratios = [r["attention_over_sdpa"] for r in rows if "attention_over_sdpa" in r]
    return {"benchmark": "dispatch", "device": torch.cuda.get_device_name() if cuda
            else "cpu-interpreter", "torch": torch.__version__, "host": platform.node(),
            "date": time.strftime("%Y-%m-%d %H:%M:%S"), "calls": calls, "rounds": rounds,
            "interpret": interpret, "rows": rows,
            "summary": {"attention_over_sdpa_max": max(ratios) if ratios else None}}


def render_dispatch(result: dict[str, Any]) -> str:
    """The closing table: us per call of each contender, attention over sdpa, dispatch."""
    names = ["attention", "routed", "triton", "sdpa", "sdpa_flash", "sdpa_cudnn",
             "attention_new_shape", "sdpa_new_shape"]
    names = [n for n in names if any(n in r["us_per_call"] or n in r["errors"]
                                     for r in result["rows"])]
    header = ["shape", "route", *names, "attention / sdpa", "(fastest rounds)", "dispatch us",
              "new shape / sdpa"]
    body = []
    for r in result["rows"]:
        m = r["us_per_call"]
        body.append([r["label"], r["route"],
                     *(f"{m[n]:.1f}" if n in m else "error" for n in names),
                     f"{r['attention_over_sdpa']:.2f}x" if "attention_over_sdpa" in r else "-",
                     f"{r['attention_over_sdpa_best']:.2f}x"
                     if "attention_over_sdpa_best" in r else "-",
                     f"{r['dispatch_us']:+.1f}" if "dispatch_us" in r else "-",
                     f"{r['new_shape_over_sdpa']:.2f}x" if "new_shape_over_sdpa" in r
                     else "-"])
    widths = [max(len(str(x)) for x in col) for col in zip(header, *body)]
    lines = [f"host us per call ({result['device']}, median of {result['rounds']} rounds of "
             f"{result['calls']} calls)"]
    lines += ["  ".join(str(x).ljust(w) if i < 2 else str(x).rjust(w)
                        for i, (x, w) in enumerate(zip(line, widths)))
              for line in [header, *body]]
    for r in result["rows"]:
        for n, e in r["errors"].items():
            lines.append(f"{r['label']}: {n} not timed: {e}")
    return "\n".join(lines)

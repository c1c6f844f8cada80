"""Attention under sustained load: each contender run back to back for seconds, the GPU's
SM clock and power sampled beside it (issues 23 and 24: interleaved rounds of the Gluon
forward drifted from 487 to 620 us within one run on an H200 while cuDNN's anchor did not
move, results/fwd_chain_causal_h200.json).

    python benchmarks/sustained_load.py [--shapes 4096:128:1,4096:64:1,2048:128:0 | grid]
        [--what fwd,train] [--seconds 4] [--cool 4] [--group 1] [--no-flash]
        [--config NAME=[PATH|]JSON ...] [--tuner-rounds 5]
        [--out benchmarks/results/sustained_load_h200.json]

A shape ``N:D:causal`` is the standard grid's (batch x N = 16384 tokens, 2048 / D heads,
bf16; ``--group G``: GQA); ``grid``: all of them (N 512-16k, D 64 and 128, causal and
not). Contenders: flashtune as a user calls it (``flashtune.attention``: the router's
choice, recorded; ``fwd`` under ``no_grad``, ``train`` through autograd), SDPA cuDNN and
SDPA flash (``--no-flash``: not flash, a budget's exception). The Gluon kernels the lookup gives are compiled in a process
pool first. Each contender is checked against fp32 on the first batch row and KV head
(relative Frobenius error under 2e-2; a failing one is not timed). Then, per contender:
``--cool`` seconds idle, then calls back to back for ``--seconds``, timed in chunks of
CUDA events (a chunk is about 20 ms of work), while ``nvidia-smi`` samples the SM clock,
the board's power, the temperature and the active clock-throttle reasons every 50 ms (NVML
through ``pynvml`` where there is no ``nvidia-smi``; neither: times only). Reported per
contender: ms per call "cool" (the fastest chunk of the first half second, before the power
cap's controller has pulled the clock down) and "hot" (the median of the last quarter's
chunks), their ratio, the mean clock and power over the last quarter, the energy per call
(hot power x hot time) and the throttle reasons seen; each contender's ratio to cuDNN,
cool and hot; and per mode the geomean of flashtune's ratios. ``--config NAME=JSON``
(forward): a contender of its own, the Gluon forward's launcher with the lookup's config
updated by JSON (the launcher's host cost shows at short N); ``NAME=PATH|JSON``: the same
with the kernel file ``PATH`` (a candidate change with the library kernel's parameters, as
``explore_fwd_ablation.py --variant`` takes it) in the library kernel's place, compiled in
the pool with the rest and checked like every contender. ``--tuner-rounds R``: after
the sustained runs, every contender timed again the way the tuner's side-by-side stage
times leaders (``timing.bench`` in rotation, R rounds), to set what the tuner sees beside
the cool and hot figures.

Without a CUDA GPU it prints "needs a CUDA GPU" and exits 0.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import platform
import re
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

TOL = 2e-2
QUERY = "clocks.sm,power.draw,temperature.gpu,clocks_throttle_reasons.active"


class Sampler:
    """The GPU's SM clock (MHz), power (W), temperature (C) and throttle-reason bit mask,
    every ``period_ms``, in a background process (``nvidia-smi``) or thread (NVML), each
    sample stamped with ``time.perf_counter()`` on arrival."""

    def __init__(self, index: int, period_ms: int = 50) -> None:
        self.index, self.period_ms = index, period_ms
        self.samples: list[tuple[float, float, float, float, int]] = []
        self.source = "nvidia-smi" if shutil.which("nvidia-smi") else None
        if self.source is None:
            try:
                import pynvml  # noqa: F401

                self.source = "nvml"
            except ImportError:
                self.source = None
        self._proc: Any = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self.samples = []
        self._stop.clear()
        if self.source == "nvidia-smi":
            self._proc = subprocess.Popen(
                ["nvidia-smi", "-i", str(self.index), f"--query-gpu={QUERY}",
                 "--format=csv,noheader,nounits", "-lms", str(self.period_ms)],
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            self._thread = threading.Thread(target=self._read_smi, daemon=True)
        elif self.source == "nvml":
            self._thread = threading.Thread(target=self._poll_nvml, daemon=True)
        if self._thread is not None:
            self._thread.start()

    def _read_smi(self) -> None:
        for line in self._proc.stdout:
            parts = [p.strip() for p in line.split(",")]
            try:
                clock, power, temp = float(parts[0]), float(parts[1]), float(parts[2])
                reasons = int(parts[3], 16)
            except (IndexError, ValueError):
                continue
            self.samples.append((time.perf_counter(), clock, power, temp, reasons))

    def _poll_nvml(self) -> None:
        import pynvml

        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(self.index)
        while not self._stop.is_set():
            self.samples.append((
                time.perf_counter(),
                float(pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM)),
                pynvml.nvmlDeviceGetPowerUsage(h) / 1e3,
                float(pynvml.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU)),
                int(pynvml.nvmlDeviceGetCurrentClocksThrottleReasons(h))))
            time.sleep(self.period_ms / 1e3)

    def stop(self) -> None:
        self._stop.set()
        if self._proc is not None:
            self._proc.terminate()
            self._proc.wait()
            self._proc = None
        if self._thread is not None:
            self._thread.join(timeout=2)
            self._thread = None


# nvidia-smi's clocks_throttle_reasons bits (nvml.h)
REASONS = {0x1: "idle", 0x2: "app_clocks", 0x4: "sw_power_cap", 0x8: "hw_slowdown",
           0x10: "sync_boost", 0x20: "sw_thermal", 0x40: "hw_thermal",
           0x80: "hw_power_brake", 0x100: "display_clocks"}


def reason_names(mask: int) -> list[str]:
    """The names of the bits set in a throttle-reason mask."""
    return [name for bit, name in REASONS.items() if mask & bit]


def summarise(chunks: list[tuple[float, float]], samples: list[tuple[float, ...]],
              t0: float, t1: float) -> dict[str, Any]:
    """``chunks``: (end time, ms per call) in order; ``samples``: the sampler's. The cool
    (the fastest chunk ending in the first half second) and hot (median of the last quarter's chunks) ms per call, their ratio,
    and the samples' means over the last quarter of ``[t0, t1]``."""
    early = [ms for t, ms in chunks if t <= t0 + 0.5] or [chunks[0][1]]
    cool = min(early)
    tail_from = t0 + 0.75 * (t1 - t0)
    hot_chunks = [ms for t, ms in chunks if t >= tail_from] or [chunks[-1][1]]
    hot = statistics.median(hot_chunks)
    out: dict[str, Any] = {"cool_ms": cool, "hot_ms": hot, "hot_over_cool": hot / cool,
                           "chunks": len(chunks)}
    tail = [s for s in samples if tail_from <= s[0] <= t1]
    if tail:
        out["hot_clock_mhz"] = statistics.mean(s[1] for s in tail)
        out["hot_power_w"] = statistics.mean(s[2] for s in tail)
        out["hot_temp_c"] = max(s[3] for s in tail)
        out["energy_mj_per_call"] = out["hot_power_w"] * hot  # W x ms = mJ
        mask = 0
        for s in samples:
            if t0 <= s[0] <= t1:
                mask |= int(s[4])
        out["throttle_reasons"] = reason_names(mask)
    first = [s for s in samples if t0 <= s[0] <= t0 + 0.25 * (t1 - t0)]
    if first:
        out["cool_clock_mhz"] = statistics.mean(s[1] for s in first)
    return out


def run_sustained(call: Any, seconds: float, sampler: Sampler,
                  chunk_ms: float = 20.0) -> dict[str, Any]:
    """``call()`` back to back for ``seconds``, timed in chunks of CUDA events sized to
    about ``chunk_ms`` of work; the sampler runs throughout."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    call()
    end.record()
    end.synchronize()
    per = max(1, int(chunk_ms / max(start.elapsed_time(end), 1e-3)))
    sampler.start()
    t0 = time.perf_counter()
    chunks: list[tuple[float, float]] = []
    while time.perf_counter() - t0 < seconds:
        start.record()
        for _ in range(per):
            call()
        end.record()
        end.synchronize()
        chunks.append((time.perf_counter(), start.elapsed_time(end) / per))
    t1 = time.perf_counter()
    sampler.stop()
    row = summarise(chunks, sampler.samples, t0, t1)
    row["calls_per_chunk"] = per
    row["chunk_ms"] = [[round(t - t0, 3), round(ms, 5)] for t, ms in chunks]
    row["samples"] = [[round(t - t0, 3), *rest] for t, *rest in sampler.samples
                      if t0 <= t <= t1]
    return row


def _contenders(sh: Any, what: str, device: Any, flash: bool,
                configs: dict[str, dict[str, Any]] | None = None,
                kernels: dict[str, Any] | None = None
                ) -> tuple[dict[str, Any], dict[str, Any]]:
    """``{name: call}`` for one shape (each call returns its outputs) and the route
    flashtune's router takes for it (implementation, config, source); ``configs``
    (forward only): contenders of their own, the Gluon forward's launcher with the
    lookup's config updated by each (keyed by head dim or not, as ``--config`` says),
    launching ``kernels[name]`` in the library kernel's place where it has one."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from train_breakdown import _sdpa_step

    import flashtune
    from flashtune.runtime import routing

    if what == "train":
        choice = routing._train_choice(sh.problem, device)
        leaves = [t.detach().requires_grad_(True) for t in (sh.q, sh.k, sh.v)]

        def ours() -> tuple[torch.Tensor, ...]:
            out = flashtune.attention(*leaves, causal=sh.causal)
            return (out, *torch.autograd.grad(out, leaves, sh.do))
        calls: dict[str, Any] = {"flashtune": ours}
        backends = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}
        for name, backend in backends.items():
            calls[name] = _sdpa_step(sh, backend)
    else:
        choice = routing._route(sh.problem, device)

        def ours() -> tuple[torch.Tensor, ...]:
            with torch.no_grad():
                return (flashtune.attention(sh.q, sh.k, sh.v, causal=sh.causal), )

        def sdpa(backend: Any) -> Any:
            def call() -> tuple[torch.Tensor, ...]:
                with sdpa_kernel(backend), torch.no_grad():
                    return (torch.nn.functional.scaled_dot_product_attention(
                        sh.q, sh.k, sh.v, is_causal=sh.causal, enable_gqa=sh.hkv != sh.h), )
            return call
        calls = {"flashtune": ours, "cudnn": sdpa(SDPBackend.CUDNN_ATTENTION),
                 "flash": sdpa(SDPBackend.FLASH_ATTENTION)}
    if not flash:
        del calls["flash"]
    route = {"implementation": choice.template, "config": dict(choice.config),
             "source": choice.source}
    if what == "fwd" and configs:
        from explore_fwd_ablation import variant_config
        from train_breakdown import _gluon_configs

        from flashtune.kernel_templates import get_template

        fwd = get_template("attn_fwd_gluon")
        lookup = _gluon_configs(sh.problem, device, "lookup")["fwd_config"]

        def launch(config: dict[str, int], kernel: Any = None) -> Any:
            def call() -> tuple[torch.Tensor, ...]:
                if kernel is None:
                    out, _ = fwd.launcher(sh.q, sh.k, sh.v, config, causal=sh.causal,
                                          return_lse=True)
                    return (out, )
                return (_launch_kernel(kernel, sh, config), )
            return call
        route["configs"] = {}
        for name, updates in configs.items():
            config = variant_config(lookup, updates, sh.d)
            route["configs"][name] = config
            calls[name] = launch(config, (kernels or {}).get(name))
    return calls, route


def _launch_kernel(kernel: Any, sh: Any, config: dict[str, int]) -> torch.Tensor:
    """The library launcher's launch (contiguous inputs, default scale, O and LSE
    allocated per call) with another kernel file's ``gluon_attn_fwd_kernel``."""
    from flashtune.kernel_templates.attn_fwd_gluon.launcher import kernel_args

    out = torch.empty_like(sh.q)
    lse = torch.empty(sh.q.shape[:3], device=sh.q.device, dtype=torch.float32)
    args, kwargs, grid = kernel_args(sh.q, sh.k, sh.v, out, lse, config, causal=sh.causal,
                                     scale=1.0 / math.sqrt(sh.d))
    kernel[grid](*args, **kwargs)
    return out


def parse_config(text: str) -> tuple[str, str, dict[str, Any]]:
    """``--config NAME=[PATH|]JSON`` -> ``(name, path or "", updates)``: explore_fwd_ablation's
    ``--variant`` syntax, its ``PATH|`` optional."""
    from explore_fwd_ablation import parse_variant

    name, sep, rest = text.partition("=")
    if not sep:
        raise ValueError(f"--config {text!r}: expected NAME=[PATH|]JSON")
    return parse_variant(text if "|" in rest else f"{name}=|{rest}")


def _kernel_files(paths: dict[str, str], shapes: list[tuple[int, int, bool]],
                  configs: dict[str, dict[str, Any]], device: Any, group: int,
                  precompile: bool, jobs: int = 16) -> dict[str, Any]:
    """Each ``--config``'s kernel file as a module of its own, ``{name: kernel}``; with
    ``precompile``, compiled first for every shape (MHA; a GQA group compiles at its first
    call) in a process pool sharing the Triton cache, a failure printed."""
    import tempfile

    from explore_bwd_ablation import _kernel, compile_all, write_modules
    from explore_fwd_ablation import ATTR, HIDDEN, KERNEL, PREFIX, TOKENS, variant_config
    from explore_fwd_ablation import _compile as compile_one
    from train_breakdown import _gluon_configs

    from flashtune.autotune.precompile import share_cache_dir
    from flashtune.core.problem import AttentionProblem

    if not paths:
        return {}
    share_cache_dir()
    where = tempfile.mkdtemp(prefix=PREFIX + "_")
    write_modules(Path(where), PREFIX, KERNEL, {}, {},
                  {name: Path(path) for name, path in paths.items()})
    work = []
    for n, d, causal in shapes if precompile and group == 1 else ():
        p = AttentionProblem(TOKENS // n, HIDDEN // d, HIDDEN // d, n, n, d, causal, "bf16")
        lookup = _gluon_configs(p, device, "lookup")["fwd_config"]
        work += [(where, name, (p.batch, p.heads_q, n, d), causal,
                  variant_config(lookup, configs[name], d)) for name in paths]
    if work:
        compile_all(compile_one, work, jobs)
    return {name: _kernel(where, name, PREFIX, ATTR) for name in paths}


def tuner_timing(calls: dict[str, Any], results: dict[str, dict[str, Any]],
                 rounds: int) -> None:
    """Each timed contender timed again as the tuner's side-by-side stage times leaders
    (``timing.bench`` round-robin, ``rounds`` rounds of ``round_rep_ms``, the median of the
    rounds' medians), into its result's ``tuner_ms`` (and ``tuner_rounds_ms``)."""
    from flashtune.autotune.runners import round_rep_ms
    from flashtune.autotune.timing import bench

    timed = [name for name in calls if "cool_ms" in results.get(name, {})]
    got: dict[str, list[float]] = {name: [] for name in timed}
    for _ in range(rounds):
        for name in timed:
            got[name].append(bench(calls[name], rep_ms=round_rep_ms(rounds)).median_ms)
    for name in timed:
        results[name]["tuner_ms"] = statistics.median(got[name])
        results[name]["tuner_rounds_ms"] = got[name]


def _shapes(spec: str) -> list[tuple[int, int, bool]]:
    """``N:D:causal,...`` or ``grid`` (the standard grid) as (N, D, causal)."""
    if spec == "grid":
        return [(n, d, c) for d in (64, 128) for n in (512, 1024, 2048, 4096, 8192, 16384)
                for c in (False, True)]
    out = []
    for one in spec.split(","):
        n, d, causal = (int(x) for x in one.split(":"))
        out.append((n, d, bool(causal)))
    return out


def _precompile(shapes: list[tuple[int, int, bool]], group: int, device: Any) -> None:
    """The Gluon pair's kernels the lookup gives each shape, compiled in a process pool
    (train_breakdown's), per head dim: what the runtime launches when it routes there."""
    from train_breakdown import _precompile as compile_pairs

    for d in sorted({d for _, d, _ in shapes}):
        mine = [s for s in shapes if s[1] == d]
        for causal in sorted({c for _, _, c in mine}):
            seqlens = ",".join(str(n) for n, _, c in mine if c == causal)
            compile_pairs(argparse.Namespace(head_dims=str(d), seqlens=seqlens, group=group,
                                             bwd_source="lookup", jobs=16), [], (causal, ),
                          device)


def _check(sh: Any, what: str, outs: tuple[torch.Tensor, ...]) -> float:
    from train_breakdown import _rel

    if what == "train":
        return sh.error(*outs)
    return _rel(outs[0][:1, :sh.group], sh.ref[0])


def compact_json(doc: Any) -> str:
    """``doc`` as JSON, indented, with each list of numbers on one line (the chunk and
    sample series)."""
    def one_line(m: re.Match[str]) -> str:
        inner = m.group(0)[1:-1].strip()
        return "[" + ", ".join(x.strip() for x in inner.split(",")) + "]" if inner else "[]"

    return re.sub(r"\[[^\[\]{}\"]*\]", one_line, json.dumps(doc, indent=1))


def _summary(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per mode, the geomean over shapes of flashtune's cool and hot ratio to cuDNN."""
    out: dict[str, dict[str, float]] = {}
    for what in sorted({r["what"] for r in rows}):
        mine = [r["contenders"].get("flashtune", {}) for r in rows if r["what"] == what]
        mine = [m for m in mine if "vs_cudnn_hot" in m]
        if mine:
            out[what] = {
                "cool": math.exp(statistics.mean(math.log(m["vs_cudnn_cool"]) for m in mine)),
                "hot": math.exp(statistics.mean(math.log(m["vs_cudnn_hot"]) for m in mine)),
                "shapes": len(mine)}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="4096:128:1,4096:64:1,2048:128:0")
    ap.add_argument("--what", default="fwd,train")
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--cool", type=float, default=4.0)
    ap.add_argument("--group", type=int, default=1)
    ap.add_argument("--config", action="append", default=[], metavar="NAME=[PATH|]JSON",
                    help="forward only: a contender NAME, the Gluon forward's launcher with "
                         "the lookup's config updated by JSON (one object, or one per head "
                         "dim: {\"64\": {...}}; {} is the lookup's own), launching the "
                         "kernel file PATH instead of the library's if given (repeatable)")
    ap.add_argument("--tuner-rounds", type=int, default=0,
                    help="also time the contenders the tuner's way afterwards: this many "
                         "rounds in rotation of timing.bench (L2 flushed, round_rep_ms)")
    ap.add_argument("--no-flash", action="store_true",
                    help="leave SDPA flash out (the anchors are cuDNN and flash; a budget's "
                         "exception, said in the JSON)")
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 0
    from train_breakdown import Shape

    from flashtune.core.device import cuda_device

    device = cuda_device()
    index = torch.cuda.current_device()
    sampler = Sampler(index)
    print(f"sampling with {sampler.source or 'nothing (times only)'}", flush=True)
    parsed = [parse_config(c) for c in args.config]
    configs = {name: updates for name, _, updates in parsed}
    paths = {name: path for name, path, _ in parsed if path}
    shapes = _shapes(args.shapes)
    hopper = torch.cuda.get_device_capability() == (9, 0)
    if hopper:
        _precompile(shapes, args.group, device)
    kernels = _kernel_files(paths, shapes, configs, device, args.group, hopper)
    rows = []
    for n, d, causal in shapes:
        sh = Shape(n, d, causal, args.group)
        for what in args.what.split(","):
            calls, route = _contenders(sh, what, device, not args.no_flash, configs,
                                       kernels)
            row: dict[str, Any] = {"shape": sh.name, "what": what, "seqlen": n, "head_dim": d,
                                   "causal": causal, "group": args.group, "route": route,
                                   "contenders": {}}
            print(f"\n== {sh.name} {what}: {route}", flush=True)
            for name, call in calls.items():
                err = _check(sh, what, call())
                if not err < TOL:
                    row["contenders"][name] = {"error": err, "skipped": "failed the check"}
                    print(f"   {name}: error {err:.3g}, not timed", flush=True)
                    continue
                torch.cuda.synchronize()
                time.sleep(args.cool)
                res = run_sustained(call, args.seconds, sampler)
                res["error"] = err
                row["contenders"][name] = res
            if args.tuner_rounds:
                tuner_timing(calls, row["contenders"], args.tuner_rounds)
            base = row["contenders"].get("cudnn", {})
            for name, res in row["contenders"].items():
                if "cool_ms" not in res:
                    continue
                if "cool_ms" in base:
                    res["vs_cudnn_cool"] = base["cool_ms"] / res["cool_ms"]
                    res["vs_cudnn_hot"] = base["hot_ms"] / res["hot_ms"]
                    if "tuner_ms" in res and "tuner_ms" in base:
                        res["vs_cudnn_tuner"] = base["tuner_ms"] / res["tuner_ms"]
                print(f"   {name:9s} cool {res['cool_ms'] * 1e3:8.1f} us  hot "
                      f"{res['hot_ms'] * 1e3:8.1f} us  x{res['hot_over_cool']:.3f}  "
                      f"vs cuDNN cool {res.get('vs_cudnn_cool', float('nan')):.3f} hot "
                      f"{res.get('vs_cudnn_hot', float('nan')):.3f}  clock "
                      f"{res.get('cool_clock_mhz', float('nan')):.0f}->"
                      f"{res.get('hot_clock_mhz', float('nan')):.0f} MHz  "
                      f"{res.get('hot_power_w', float('nan')):.0f} W  "
                      f"{res.get('energy_mj_per_call', float('nan')):.2f} mJ/call  "
                      f"{','.join(res.get('throttle_reasons', []))}"
                      + (f"  tuner's timing {res['tuner_ms'] * 1e3:.1f} us, vs cuDNN "
                         f"{res.get('vs_cudnn_tuner', float('nan')):.3f}"
                         if "tuner_ms" in res else ""), flush=True)
            rows.append(row)
        del sh
        torch.cuda.empty_cache()
    summary = _summary(rows)
    for what, figures in summary.items():
        print(f"{what}: flashtune / cuDNN geomean cool {figures['cool']:.3f}, hot "
              f"{figures['hot']:.3f} over {figures['shapes']} shapes")
    if args.out:
        doc = {"benchmark": "sustained_load", "device": torch.cuda.get_device_name(),
               "torch": torch.__version__, "python": platform.python_version(),
               "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
               "seconds": args.seconds, "cool": args.cool, "sampler": sampler.source,
               "flash": not args.no_flash, "configs": configs, "kernels": paths,
               "tuner_rounds": args.tuner_rounds,
               "summary": summary, "rows": rows}
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(compact_json(doc))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

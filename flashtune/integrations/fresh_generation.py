"""``bench --model llama``'s ``generate_new`` phase: greedy generation from prompt lengths
the process has not run, each contender in a process of its own.

torch's cuDNN SDPA builds a graph the first time it meets a shape (40-68 ms on an H200:
``benchmarks/results/new_shape_h200.json``) and keeps it for the life of the process. A
benchmark that generates the same lengths round after round so times cuDNN warm, which a
request with a new prompt length never finds it: each of its decoding steps over a growing
cache is a new shape. Here each contender runs in a fresh Python process (the graph cache is
the process's), warms up (compiles, routes) at a length none of its timed rounds meets, then
times ``rounds`` generations, round ``r`` from a prompt of ``prompt + r * (new + 1)`` tokens
(:func:`fresh_lengths`): no key length of a decoding step repeats, and every contender meets
the same lengths. The prompts are the same tokens for every contender (prefixes of one
seeded draw), the weights the same seeded initialisation as the other phases'.

The child is ``python -m flashtune.integrations.model_bench`` (its ``fresh_child``): the
job as JSON on its standard input, the result as JSON on the last line of its standard
output.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from typing import Any

import torch

from flashtune.runtime.bench import _first_line

__all__ = ["fresh_generation_row", "fresh_lengths", "round_stats"]

# a child's wall-clock limit: importing torch and transformers, building the model, a warm-up
# and the rounds
CHILD_TIMEOUT_S = 900


def fresh_lengths(prompt: int, new_tokens: int, rounds: int) -> tuple[int, list[int]]:
    """The warm-up's prompt length and each timed round's: a generation from ``n`` tokens
    calls attention with ``n`` to ``n + new_tokens`` keys, so lengths ``new_tokens + 1``
    apart never share a key length, and the warm-up's lies past every round's."""
    step = new_tokens + 1
    return prompt + rounds * step, [prompt + r * step for r in range(rounds)]


def round_stats(samples: Mapping[str, Sequence[float]]) -> dict[str, Any]:
    """A phase's timing fields from each contender's rounds (ms): ``ms`` (the median round),
    ``round_ms`` (the rounds), ``spread`` ((max - min) / median: a ratio closer to 1 than this
    is not resolved by the run) and ``speedup_fastest`` (each other contender's fastest round
    over flashtune's: where a host's rounds swing by tens of percent, as generation's do,
    what each costs in the rounds the host left alone, as ``timeit`` reads a loop).

    Arguments:
        samples: contender -> its rounds' times, in the order they ran.
    Returns:
        The fields, JSON-ready.
    """
    mine = samples.get("flashtune")
    return {"ms": {c: statistics.median(xs) for c, xs in samples.items()},
            "round_ms": {c: list(xs) for c, xs in samples.items()},
            "spread": {c: (max(xs) - min(xs)) / statistics.median(xs)
                       for c, xs in samples.items() if statistics.median(xs) > 0},
            "speedup_fastest": {c: min(xs) / min(mine) for c, xs in samples.items()
                                if mine and min(mine) > 0 and c != "flashtune"}}


def _run_child(job: dict[str, Any]) -> dict[str, Any]:
    """One contender's rounds in a new Python process; RuntimeError with its last line of
    error output if it fails."""
    done = subprocess.run([sys.executable, "-m", "flashtune.integrations.model_bench"],
                          input=json.dumps(job), capture_output=True, text=True,
                          timeout=CHILD_TIMEOUT_S, check=False)
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        why = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        raise RuntimeError(f"its process failed: {why}")
    result: dict[str, Any] = json.loads(lines[-1])
    return result


def fresh_generation_row(spec: Any, work: Any, contenders: Sequence[str], rounds: int,
                         device: str, reference: str = "sdpa") -> dict[str, Any]:
    """The ``generate_new`` row of :func:`~flashtune.integrations.model_bench.bench_model`:
    per contender (``reference`` first: ``sdpa``, or the family's) its rounds in a process
    of its own; the generated tokens of the first round compared with the reference's (the
    share that differ), not judged (one near-tie in bf16 changes the rest)."""
    warm, timed = fresh_lengths(work.gen_prompt, work.new_tokens, rounds)
    row: dict[str, Any] = {
        "phase": "generate_new",
        "label": (f"B{work.gen_batch} x {timed[0]}-{timed[-1]} + {work.new_tokens} new, "
                  f"new lengths, a process each"),
        "tokens": work.gen_batch * work.new_tokens, "errors": {}, "check": {},
        "lengths": timed, "warmup_length": warm}
    job = {"spec": asdict(spec), "work": asdict(work), "rounds": rounds, "device": device}
    samples: dict[str, list[float]] = {}
    ref = None
    for name in [reference, *(c for c in contenders if c != reference)]:
        try:
            got = _run_child({**job, "contender": name})
        except Exception as exc:  # a backend that cannot run the model: data
            row["errors"][name] = _first_line(exc)
            continue
        samples[name] = got["ms"]
        first = torch.tensor(got["first_tokens"])
        if name == reference:
            ref = first
        elif ref is not None:
            row["check"][name] = float((first != ref).float().mean())
    row.update(round_stats(samples))
    # each round's lengths are the same for every contender: its ratio is the fair one
    mine = samples.get("flashtune")
    row["speedup"] = {c: statistics.median(t / m for t, m in zip(xs, mine, strict=True))
                      for c, xs in samples.items() if mine and c != "flashtune"}
    best = [row["speedup"][c] for c in ("sdpa", "sdpa_cudnn") if c in row["speedup"]]
    if best:
        row["speedup_vs_best_of_sdpa_and_cudnn"] = min(best)
    return row

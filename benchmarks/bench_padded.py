"""Padded and padding-free batches in transformers (issue 29): a Llama-3-8B-shaped model (8
layers, random bf16 weights), 8 prompts of random lengths 512-2048 (seed 0), last-token
logits, one run.

    python benchmarks/bench_padded.py [--rounds 5] [--out benchmarks/results/padded_h100.json]

Contenders:

* ``sdpa``, ``flex_attention``, ``flashtune``: the batch left-padded to 2048 with its
  attention mask (flashtune unpads it and runs the packed kernel);
* ``sdpa_no_mask``: the same padded batch with no mask (causal over every position: a fast
  kernel, the same MLP work; an upper bound of what attention alone can gain);
* ``flashtune_packed`` and ``sdpa_packed``: the eight prompts in one row without padding,
  ``position_ids`` restarting at each (``DataCollatorWithFlattening``'s batch);
* ``sdpa_one_by_one``: the eight prompts run one after the other, unpadded.

Checks before timing: every contender's last-token logits of each prompt against
``sdpa_one_by_one``'s (relative error under 5e-2, the model benchmark's tolerance: SDPA's
own backends differ by 2e-2 through 8 layers). Timing: CUDA-synchronised wall time of one
forward, the contenders in rotation for ``--rounds`` rounds, median. Prints a table last.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import flashtune.integrations.transformers  # noqa: E402,F401  (registers "flashtune")
from flashtune.core.device import cuda_device  # noqa: E402
from flashtune.integrations.model_bench import PRESETS  # noqa: E402

TOL = 5e-2


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--max-len", type=int, default=2048)
    ap.add_argument("--min-len", type=int, default=512)
    ap.add_argument("--out", default="benchmarks/results/padded_h100.json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_padded needs a CUDA GPU")
    spec = PRESETS["llama"]
    torch.manual_seed(0)
    model = spec.build(torch.bfloat16, "cuda")
    gen = torch.Generator().manual_seed(0)
    lens = [int(x) for x in torch.randint(args.min_len, args.max_len + 1, (args.batch,),
                                          generator=gen)]
    lens[0] = args.max_len  # the batch is padded to its longest prompt
    prompts = [torch.randint(1, spec.vocab, (n,), generator=gen) for n in lens]
    ids = torch.zeros(args.batch, args.max_len, dtype=torch.long)
    mask = torch.zeros(args.batch, args.max_len, dtype=torch.long)
    for i, p in enumerate(prompts):  # left padding, as generation batches are
        ids[i, -len(p):] = p
        mask[i, -len(p):] = 1
    ids, mask = ids.cuda(), mask.cuda()
    row = torch.cat(prompts)[None].cuda()
    positions = torch.cat([torch.arange(n) for n in lens])[None].cuda()
    ends = torch.tensor(lens).cumsum(0) - 1

    def padded(impl, with_mask=True):
        def run():
            model.set_attn_implementation(impl)
            out = model(ids, attention_mask=mask if with_mask else None, logits_to_keep=1)
            return out.logits[:, -1]
        return run

    def packed(impl):
        def run():
            model.set_attn_implementation(impl)
            logits = model(row, position_ids=positions).logits[0]
            return logits[ends.cuda()]
        return run

    def one_by_one():
        model.set_attn_implementation("sdpa")
        return torch.cat([model(p[None].cuda(), logits_to_keep=1).logits[:, -1]
                          for p in prompts])

    contenders = {
        "sdpa": padded("sdpa"), "flex_attention": padded("flex_attention"),
        "flashtune": padded("flashtune"), "sdpa_no_mask": padded("sdpa", with_mask=False),
        "flashtune_packed": packed("flashtune"), "sdpa_packed": packed("sdpa"),
        "sdpa_one_by_one": one_by_one,
    }
    result = {"device": cuda_device().name, "torch": torch.__version__,
              "transformers": __import__("transformers").__version__,
              "host": platform.node(), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
              "lengths": lens, "real_tokens": sum(lens),
              "padded_tokens": args.batch * args.max_len, "errors": {}, "ms": {}}
    with torch.no_grad():
        ref = one_by_one().float()
        runnable = {}
        for name, fn in contenders.items():
            try:
                got = fn().float()
                if name == "sdpa_no_mask":  # attends to padding: not comparable, a bound
                    runnable[name] = fn
                    continue
                err = float((got - ref).norm() / ref.norm())
                result["errors"][name] = err
                if not err < TOL:
                    result["ms"][name] = f"wrong result: relative error {err:.2e}"
                    continue
                runnable[name] = fn
            except Exception as exc:  # noqa: BLE001 - a contender that cannot run is data
                result["ms"][name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
        for fn in runnable.values():  # warm: compile, autotune caches
            fn()
        per: dict[str, list[float]] = {n: [] for n in runnable}
        for _ in range(args.rounds):
            for name, fn in runnable.items():
                torch.cuda.synchronize()
                t = time.perf_counter()
                fn()
                torch.cuda.synchronize()
                per[name].append((time.perf_counter() - t) * 1e3)
    for name, times in per.items():
        result["ms"][name] = statistics.median(times)
    result["rounds"] = per
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2, default=str))
    ms = result["ms"]
    print(f"\n{result['device']}: 8 Llama-3-8B layers, {args.batch} prompts of {lens} tokens "
          f"({sum(lens)} real of {args.batch * args.max_len}), last-token logits, median of "
          f"{args.rounds} rounds")
    print("| contender | ms | vs padded sdpa | vs flex_attention | error vs one-by-one |")
    print("|---|---|---|---|---|")
    for name in contenders:
        t = ms.get(name)
        if not isinstance(t, float):
            print(f"| {name} | {t} | - | - | - |")
            continue
        vs = [f"{ms[b] / t:.3f}x" if isinstance(ms.get(b), float) else "-"
              for b in ("sdpa", "flex_attention")]
        err = result["errors"].get(name)
        print(f"| {name} | {t:.1f} | {vs[0]} | {vs[1]} | "
              f"{'-' if err is None else f'{err:.1e}'} |")


if __name__ == "__main__":
    main()

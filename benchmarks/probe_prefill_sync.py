"""Where a batch-1 prefill through flashtune loses time against ``sdpa`` when both run the
same attention kernel: host syncs, idle GPU, kernels.

    OUT=DIR python benchmarks/probe_prefill_sync.py   (writes DIR/prefill_sync.json)

Per model (8 random layers, bf16: Phi-3-mini's 32:32 heads of 96 and Llama-3-8B's 32:8 of
128) and prompt (1 x 2048, 1 x 8192), one prefill (``logits_to_keep=1``) run as
``sdpa`` (torch's pick), as ``flashtune``, and as ``flashtune`` with its per-forward check
of ``position_ids`` for packed sequences skipped (``nosync``: what the call would cost
without that read back to the host). Each contender is timed over rounds in rotation (wall
time between two device syncs, the median), then once under ``torch.cuda``'s sync debug
mode (the count of synchronising calls a prefill makes) and once under ``torch.profiler``:
device time in kernels, the kernel count, and the device's idle time inside the prefill
(wall minus busy).
"""
import json
import os
import statistics
import time
import warnings


def main():
    import torch
    from torch.profiler import ProfilerActivity, profile

    import flashtune.integrations.transformers as ft
    from flashtune.integrations.model_bench import ModelSpec

    models = {"phi3": ModelSpec("llama", 8, 3072, 32, 32, 8192, vocab=128256),
              "llama3": ModelSpec("llama", 8, 4096, 32, 8, 14336, vocab=128256)}
    lengths = [int(x) for x in os.environ.get("LENGTHS", "2048,8192").split(",")]
    rounds = int(os.environ.get("ROUNDS", "9"))
    original = ft._packed

    def no_position_check(query, mask, kwargs):
        return original(query, mask, {k: v for k, v in kwargs.items() if k != "position_ids"})

    def contender(model, name):
        ft._packed = no_position_check if name == "nosync" else original
        model.set_attn_implementation("sdpa" if name == "sdpa" else ft.NAME)

    rows = []
    for label, spec in models.items():
        torch.manual_seed(0)
        model = spec.build(torch.bfloat16, "cuda")
        gen = torch.Generator(device="cuda").manual_seed(1)
        for n in lengths:
            ids = torch.randint(1, spec.vocab, (1, n), device="cuda", generator=gen)

            def run():
                with torch.no_grad():
                    return model(input_ids=ids, logits_to_keep=1).logits

            names = ["sdpa", "flashtune", "nosync"]
            outs = {}
            for name in names:
                contender(model, name)
                for _ in range(3):
                    outs[name] = run().float()
            checks = {name: float((outs[name] - outs["sdpa"]).norm() / outs["sdpa"].norm())
                      for name in names}
            samples = {name: [] for name in names}
            for _ in range(rounds):
                for name in names:
                    contender(model, name)
                    torch.cuda.synchronize()
                    t = time.perf_counter()
                    run()
                    torch.cuda.synchronize()
                    samples[name].append((time.perf_counter() - t) * 1e3)
            row = {"model": label, "batch": 1, "seqlen": n, "check": checks,
                   "ms": {k: statistics.median(v) for k, v in samples.items()},
                   "rounds_ms": samples, "syncs": {}, "sync_sites": {}, "profile": {}}
            for name in names:
                contender(model, name)
                torch.cuda.synchronize()
                torch.cuda.set_sync_debug_mode("warn")
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    run()
                torch.cuda.set_sync_debug_mode(0)
                syncs = [w for w in caught if "synchroniz" in str(w.message)]
                row["syncs"][name] = len(syncs)
                row["sync_sites"][name] = sorted({f"{os.path.basename(w.filename)}:{w.lineno}"
                                                  for w in syncs})
                torch.cuda.synchronize()
                with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
                    t = time.perf_counter()
                    run()
                    torch.cuda.synchronize()
                    wall = (time.perf_counter() - t) * 1e3
                kernels = [e for e in prof.events()
                           if e.device_type == torch.autograd.DeviceType.CUDA]
                busy = sum(e.self_device_time_total for e in kernels) / 1e3
                by_name = {}
                for e in kernels:
                    by_name[e.name] = by_name.get(e.name, 0.0) + e.self_device_time_total / 1e3
                top = sorted(by_name.items(), key=lambda kv: -kv[1])[:12]
                row["profile"][name] = {"wall_ms": wall, "busy_ms": busy,
                                        "kernels": len(kernels),
                                        "top": [[k[:90], round(v, 4)] for k, v in top]}
            rows.append(row)
            ms = row["ms"]
            print(f"{label} 1x{n}: sdpa {ms['sdpa']:.3f} ms, flashtune {ms['flashtune']:.3f} "
                  f"({ms['sdpa'] / ms['flashtune']:.3f}x), nosync {ms['nosync']:.3f} "
                  f"({ms['sdpa'] / ms['nosync']:.3f}x); syncs {row['syncs']}; busy "
                  + ", ".join(f"{k} {v['busy_ms']:.3f}/{v['wall_ms']:.3f} ms "
                              f"{v['kernels']} kernels" for k, v in row["profile"].items()),
                  flush=True)
        del model
        torch.cuda.empty_cache()
    result = {"benchmark": "probe_prefill_sync", "device": torch.cuda.get_device_name(),
              "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M:%S"),
              "rows": rows}
    out = os.environ.get("OUT", ".")
    with open(os.path.join(out, "prefill_sync.json"), "w") as f:
        json.dump(result, f, indent=1)
    print()
    print("| model | prompt | flashtune / sdpa | no position check / sdpa | syncs sdpa / ft / "
          "nosync | idle ms sdpa / ft / nosync |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        ms, p = r["ms"], r["profile"]
        idle = " / ".join(f"{p[k]['wall_ms'] - p[k]['busy_ms']:.3f}" for k in p)
        print(f"| {r['model']} | 1 x {r['seqlen']} | {ms['sdpa'] / ms['flashtune']:.3f}x | "
              f"{ms['sdpa'] / ms['nosync']:.3f}x | {r['syncs']['sdpa']} / "
              f"{r['syncs']['flashtune']} / {r['syncs']['nosync']} | {idle} |")
    for r in rows:
        print(r["model"], r["seqlen"], json.dumps(r["sync_sites"]))


if __name__ == "__main__":
    main()

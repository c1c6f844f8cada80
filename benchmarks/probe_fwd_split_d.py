"""attn_fwd's ``SPLIT_D`` knob on one GPU: head dims 96 and 80 as one padded tile (128)
against two (64 + 32, 64 + 16), config by config, beside SDPA's cuDNN and FLASH.

    OUT=DIR python benchmarks/probe_fwd_split_d.py   (writes DIR/fwd_split_d.json)

Per shape (Phi-3's prefill, 32:32 heads of 96, B1 at 2048 and 4096 tokens causal; B4 at
2048 not causal; Phi-2's 32 heads of 80 at B4 x 2048 causal; bf16), a handful of configs
(the template default and BLOCK_N / stages / TMA variants of it, compiled first in a pool of
16 processes), each one tile and two,
each checked against the fp32 reference and timed with a cold L2 (``timing.bench``, the
tuner's method); cuDNN and FLASH timed the same way in the same run. TFLOP/s by
``AttentionProblem.flops`` (ANCHORS.md: causal counts half).
"""
import json
import os
import time


def main():
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from flashtune.autotune.precompile import precompile
    from flashtune.autotune.timing import bench
    from flashtune.core.device import cuda_device
    from flashtune.core.problem import AttentionProblem
    from flashtune.kernel_templates import get_template
    from flashtune.kernel_templates.attn_fwd import attn_fwd
    from flashtune.kernel_templates.attn_fwd.reference import attn_fwd_reference

    spec = get_template("attn_fwd")
    dev = cuda_device()
    shapes = [(1, 32, 2048, 96, True), (1, 32, 4096, 96, True), (4, 32, 2048, 96, False),
              (4, 32, 2048, 80, True)]
    rows = []
    for b, h, n, d, causal in shapes:
        p = AttentionProblem(b, h, h, n, n, d, causal, "bf16")
        base = {k: v for k, v in spec.default_config(p, dev).items() if k != "SPLIT_D"}
        variants = [base, dict(base, BLOCK_N=64), dict(base, num_stages=2),
                    dict(base, USE_TMA=0, BLOCK_N=64)]
        cfgs = [dict(c, SPLIT_D=s) for c in variants for s in (0, 1)]
        precompile(spec, p, [c for c in cfgs if spec.space.check(c, p, dev) is None],
                   workers=16)
        torch.manual_seed(0)
        q = torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16)
        k, v = torch.randn_like(q), torch.randn_like(q)
        ref, _ = attn_fwd_reference(q, k, v, causal=causal, dtype=torch.float32)
        flops = p.flops()
        row = {"shape": {"batch": b, "heads": h, "seqlen": n, "head_dim": d, "causal": causal},
               "configs": []}
        for backend, name in ((SDPBackend.CUDNN_ATTENTION, "sdpa_cudnn"),
                              (SDPBackend.FLASH_ATTENTION, "sdpa_flash")):
            def run(backend=backend):
                with sdpa_kernel(backend):
                    return torch.nn.functional.scaled_dot_product_attention(
                        q, k, v, is_causal=causal)
            try:
                rel = ((run().float() - ref).norm() / ref.norm()).item()
                ms = bench(run).median_ms
                row[name] = {"ms": ms, "tflops": flops / ms / 1e9, "relerr": rel}
            except Exception as exc:  # a backend that refuses the head dim
                row[name] = {"error": str(exc).splitlines()[0][:200]}
        seen = []
        for c in variants:
            for split in (0, 1):
                cfg = dict(c, SPLIT_D=split)
                if cfg in seen or spec.space.check(cfg, p, dev) is not None:
                    continue
                seen.append(cfg)
                try:
                    out = attn_fwd(q, k, v, cfg, causal=causal)
                    rel = ((out.float() - ref).norm() / ref.norm()).item()
                    if not rel < 1e-2:
                        row["configs"].append({"config": cfg, "error": f"relerr {rel:.3g}"})
                        continue
                    ms = bench(lambda cfg=cfg: attn_fwd(q, k, v, cfg, causal=causal)).median_ms
                    row["configs"].append({"config": cfg, "ms": ms, "tflops": flops / ms / 1e9,
                                           "relerr": rel})
                except Exception as exc:
                    row["configs"].append({"config": cfg,
                                           "error": str(exc).splitlines()[0][:200]})
        good = [r for r in row["configs"] if "ms" in r]
        best = {s: min((r for r in good if r["config"]["SPLIT_D"] == s),
                       key=lambda r: r["ms"], default=None) for s in (0, 1)}
        cu = row["sdpa_cudnn"].get("tflops", float("nan"))
        fl = row["sdpa_flash"].get("tflops", float("nan"))
        row["best"] = {str(s): r for s, r in best.items()}
        rows.append(row)
        pairs = []
        for r in good:
            if r["config"]["SPLIT_D"] == 1:
                one = next((x for x in good if x["config"] == dict(r["config"], SPLIT_D=0)),
                           None)
                if one:
                    pairs.append(f"{one['ms'] / r['ms']:.3f}")
        print(f"B{b} H{h} N{n} D{d} {'causal' if causal else 'full'}: cuDNN {cu:.0f}, FLASH "
              f"{fl:.0f} TFLOP/s | best one tile {best[0]['tflops']:.0f} "
              f"({best[0]['tflops'] / cu:.3f}x cuDNN) {best[0]['config']} | best two tiles "
              f"{best[1]['tflops']:.0f} ({best[1]['tflops'] / cu:.3f}x cuDNN) "
              f"{best[1]['config']} | two over one, config by config: {' '.join(pairs)}",
              flush=True)
    with open(os.path.join(os.environ.get("OUT", "."), "fwd_split_d.json"), "w") as f:
        json.dump({"benchmark": "probe_fwd_split_d", "device": torch.cuda.get_device_name(),
                   "torch": torch.__version__, "source_hash": spec.source_hash,
                   "date": time.strftime("%Y-%m-%d %H:%M:%S"),
                   "method": "timing.bench (cold L2, medians)", "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()

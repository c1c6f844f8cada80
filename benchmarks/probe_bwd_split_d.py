"""attn_bwd's ``SPLIT_D`` knob on one GPU: head dims 96 and 80 as one padded tile (128)
against two (64 + 32, 64 + 16), config by config, beside SDPA's cuDNN and FLASH backward.

    OUT=DIR python benchmarks/probe_bwd_split_d.py   (writes DIR/bwd_split_d.json)

Per shape (Phi-3-mini's training step, 32:32 heads of 96: B2 x 4096 and B4 x 2048 causal,
B4 x 2048 not causal; Phi-2's 32 heads of 80 at B4 x 2048 causal; bf16), the template
default (D128's tiles, one padded tile) and variants of it, each one tile and two, compiled
first in a pool of 16 processes; each one's gradients checked against the fp32 reference
(relative error under 1e-2 each) and the backward alone timed with a cold L2
(``timing.bench``, the tuner's method) on the forward's out and LSE; SDPA's cuDNN and FLASH
backward (``autograd.grad`` of their own forward) timed the same way in the same run.
TFLOP/s by ``AttentionProblem.flops(backward=True)`` (ANCHORS.md: 2.5x the forward).
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
    from flashtune.kernel_templates.attn_bwd import attn_bwd
    from flashtune.kernel_templates.attn_bwd.reference import attn_bwd_reference
    from flashtune.kernel_templates.attn_fwd import attn_fwd

    spec, fwd = get_template("attn_bwd"), get_template("attn_fwd")
    dev = cuda_device()
    shapes = [(2, 32, 4096, 96, True), (4, 32, 2048, 96, True), (4, 32, 2048, 96, False),
              (4, 32, 2048, 80, True)]
    rows = []
    for b, h, n, d, causal in shapes:
        p = AttentionProblem(b, h, h, n, n, d, causal, "bf16")
        base = {k: v for k, v in spec.default_config(p, dev).items() if k != "SPLIT_D"}
        variants = [base, dict(base, num_stages=4), dict(base, num_stages=2),
                    dict(base, ONE_LAUNCH=0, REVERSE_DQ=0), dict(base, SPLIT_LOOPS=1),
                    dict(base, BLOCK_N1=64), dict(base, BLOCK_M1=32, BLOCK_N2=32)]
        cfgs = [dict(c, SPLIT_D=s) for c in variants for s in (0, 1)]
        cfgs = [c for i, c in enumerate(cfgs) if c not in cfgs[:i]
                and spec.space.check(c, p, dev) is None]
        t0 = time.time()
        precompile(spec, p, cfgs, workers=16)
        print(f"precompiled {len(cfgs)} configs in {time.time() - t0:.0f} s", flush=True)
        torch.manual_seed(0)
        q = torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16)
        k, v, do = torch.randn_like(q), torch.randn_like(q), torch.randn_like(q)
        fcfg = fwd.default_config(p, dev)
        out, lse = attn_fwd(q, k, v, fcfg, causal=causal, return_lse=True)
        ref = attn_bwd_reference(q, k, v, do, causal=causal, dtype=torch.float32)

        def relerr(got):
            return max(((g.float() - r).norm() / r.norm()).item() for g, r in zip(got, ref))
        flops = p.flops(backward=True)
        row = {"shape": {"batch": b, "heads": h, "seqlen": n, "head_dim": d, "causal": causal},
               "forward_config": fcfg, "configs": []}
        for backend, name in ((SDPBackend.CUDNN_ATTENTION, "sdpa_cudnn"),
                              (SDPBackend.FLASH_ATTENTION, "sdpa_flash")):
            try:
                leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
                with sdpa_kernel(backend):
                    o = torch.nn.functional.scaled_dot_product_attention(*leaves,
                                                                         is_causal=causal)

                def run(o=o, leaves=leaves):
                    return torch.autograd.grad(o, leaves, do, retain_graph=True)
                rel = relerr(run())
                ms = bench(run).median_ms
                row[name] = {"ms": ms, "tflops": flops / ms / 1e9, "relerr": rel}
            except Exception as exc:  # a backend that refuses the head dim
                row[name] = {"error": str(exc).splitlines()[0][:200]}
        for cfg in cfgs:
            try:
                rel = relerr(attn_bwd(q, k, v, out, lse, do, cfg, causal=causal))
                if not rel < 1e-2:
                    row["configs"].append({"config": cfg, "error": f"relerr {rel:.3g}"})
                    continue
                ms = bench(lambda cfg=cfg: attn_bwd(q, k, v, out, lse, do, cfg,
                                                    causal=causal)).median_ms
                row["configs"].append({"config": cfg, "ms": ms, "tflops": flops / ms / 1e9,
                                       "relerr": rel})
            except Exception as exc:
                row["configs"].append({"config": cfg, "error": str(exc).splitlines()[0][:200]})
        del ref
        good = [r for r in row["configs"] if "ms" in r]
        best = {s: min((r for r in good if r["config"]["SPLIT_D"] == s),
                       key=lambda r: r["ms"], default=None) for s in (0, 1)}
        default = next((r for r in good if r["config"] == dict(base, SPLIT_D=0)), None)
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
        lines = [f"B{b} H{h} N{n} D{d} {'causal' if causal else 'full'}: cuDNN {cu:.0f}, "
                 f"FLASH {fl:.0f} TFLOP/s"]
        if default:
            lines.append(f"  default (one tile) {default['tflops']:.0f} "
                         f"({default['tflops'] / cu:.3f}x cuDNN)")
        for s in (0, 1):
            if best[s]:
                lines.append(f"  best {'two tiles' if s else 'one tile'} "
                             f"{best[s]['tflops']:.0f} ({best[s]['tflops'] / cu:.3f}x cuDNN) "
                             f"{best[s]['config']}")
        lines.append(f"  two over one, config by config: {' '.join(pairs)}")
        errors = [r for r in row["configs"] if "error" in r]
        if errors:
            lines.append(f"  errors: {errors}")
        print("\n".join(lines), flush=True)
    with open(os.path.join(os.environ.get("OUT", "."), "bwd_split_d.json"), "w") as f:
        json.dump({"benchmark": "probe_bwd_split_d", "device": torch.cuda.get_device_name(),
                   "torch": torch.__version__, "source_hash": spec.source_hash,
                   "date": time.strftime("%Y-%m-%d %H:%M:%S"),
                   "method": "timing.bench (cold L2, medians), backward alone", "rows": rows},
                  f, indent=1)


if __name__ == "__main__":
    main()

"""The layout a model hands attention: `attn_fwd` and SDPA's backends on q/k/v as
transformers passes them, ``(B, N, H, D)`` projections viewed as ``(B, H, N, D)``, against
the contiguous ``(B, H, N, D)`` tensors the tuner and ``bench`` time.

    OUT=DIR python benchmarks/probe_layout.py   (writes DIR/layout.json)

Phi-3-mini's prefill ended 0.98x cuDNN in the model at 1 x 8192 (`model_phi3_prefill_8k_
tuned_h200.json`) where its tuned `attn_fwd` entry is 1.02x cuDNN in `bench`. Per shape and
layout: cuDNN, FLASH, the routed `flashtune.attention`, `attn_fwd` at the stored config with
its output contiguous (as today) and in q's layout, and variants of that config (keys,
stages, TMA, rows), each checked against the fp32 reference and timed with a cold L2
(``timing.bench``, the tuner's method); then what the transformers integration returns,
each contender followed by ``transpose(1, 2).contiguous()`` (free where the output already
lies in ``(B, N, H, D)`` order). TFLOP/s by ``AttentionProblem.flops`` (ANCHORS.md).
"""
import json
import os
import time


def main():
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import flashtune
    from flashtune.autotune.precompile import precompile
    from flashtune.autotune.timing import bench
    from flashtune.core.device import cuda_device
    from flashtune.core.problem import AttentionProblem
    from flashtune.kernel_templates import get_template
    from flashtune.kernel_templates.attn_fwd import attn_fwd
    from flashtune.kernel_templates.attn_fwd.reference import attn_fwd_reference
    from flashtune.runtime.ops import lookup_config

    spec = get_template("attn_fwd")
    dev = cuda_device()
    # (name, batch, heads_q, heads_kv, tokens, head_dim): causal prefills
    shapes = [("Phi-3-mini", 1, 32, 32, 8192, 96), ("Phi-3-mini", 1, 32, 32, 2048, 96),
              ("Llama-3-8B", 1, 32, 8, 8192, 128)]
    rows = []
    for model, b, hq, hkv, n, d in shapes:
        p = AttentionProblem(b, hq, hkv, n, n, d, True, "bf16")
        torch.manual_seed(0)
        dense = [torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16)
                 for h in (hq, hkv, hkv)]
        choice = lookup_config(*dense, causal=True)
        if choice.template == "attn_fwd":
            base = dict(choice.config)
        else:
            base = dict(spec.default_config(p, dev))
        variants = [base, dict(base, BLOCK_N=128), dict(base, num_stages=2),
                    dict(base, num_stages=4), dict(base, USE_TMA=0), dict(base, BLOCK_M=64,
                                                                          num_warps=4)]
        variants = [c for i, c in enumerate(variants)
                    if c not in variants[:i] and spec.space.check(c, p, dev) is None]
        precompile(spec, p, variants, workers=16)
        flops = p.flops()
        for layout in ("bhnd", "bnhd"):
            if layout == "bhnd":
                q, k, v = dense
            else:  # what transformers passes: projections (B, N, H * D) viewed per head
                q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in dense)
            ref, _ = attn_fwd_reference(q, k, v, causal=True, dtype=torch.float32)
            row = {"model": model, "shape": {"batch": b, "heads_q": hq, "heads_kv": hkv,
                                             "seqlen": n, "head_dim": d, "causal": True},
                   "layout": layout, "route": f"{choice.template} ({choice.source})",
                   "stored_config": base, "contenders": {}}

            def sdpa(backend, q=q, k=k, v=v):
                with sdpa_kernel(backend):
                    return F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                          enable_gqa=hq != hkv)

            def like_q(cfg, q=q, k=k, v=v):
                return attn_fwd(q, k, v, cfg, causal=True, out=torch.empty_like(q))

            cands = {
                "sdpa_cudnn": lambda: sdpa(SDPBackend.CUDNN_ATTENTION),
                "sdpa_flash": lambda: sdpa(SDPBackend.FLASH_ATTENTION),
                "flashtune.attention": lambda q=q, k=k, v=v: flashtune.attention(
                    q, k, v, causal=True),
                "attn_fwd stored, out contiguous": lambda q=q, k=k, v=v: attn_fwd(
                    q, k, v, base, causal=True),
                "attn_fwd stored, out like q": lambda: like_q(base),
            }
            for cfg in variants[1:]:
                changed = {key: val for key, val in cfg.items() if base.get(key) != val}
                cands[f"attn_fwd {changed}, out like q"] = lambda cfg=cfg: like_q(cfg)
            # what the integration returns: (B, N, H, D) contiguous
            for name in ("sdpa_cudnn", "flashtune.attention", "attn_fwd stored, out contiguous",
                         "attn_fwd stored, out like q"):
                cands[f"{name} + to (B, N, H, D)"] = (
                    lambda fn=cands[name]: fn().transpose(1, 2).contiguous())
            for name, fn in cands.items():
                try:
                    out = fn()
                    if out.shape != ref.shape:
                        out = out.transpose(1, 2)
                    rel = ((out.float() - ref).norm() / ref.norm()).item()
                    if not rel < 1e-2:
                        row["contenders"][name] = {"error": f"relerr {rel:.3g}"}
                        continue
                    ms = bench(fn).median_ms
                    row["contenders"][name] = {"ms": ms, "tflops": flops / ms / 1e9,
                                               "relerr": rel}
                except Exception as exc:
                    row["contenders"][name] = {"error": str(exc).splitlines()[0][:200]}
            rows.append(row)
            print(json.dumps({"model": model, "n": n, "layout": layout}), flush=True)
    doc = {"benchmark": "probe_layout", "device": torch.cuda.get_device_name(),
           "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"), "rows": rows}
    out_dir = os.environ.get("OUT", "benchmarks/results")
    with open(os.path.join(out_dir, "layout.json"), "w") as f:
        json.dump(doc, f, indent=1)
    for row in rows:
        cudnn = row["contenders"]["sdpa_cudnn"].get("ms")
        print(f"\n{row['model']} B{row['shape']['batch']} x {row['shape']['seqlen']} "
              f"{row['layout']} route {row['route']} stored {row['stored_config']}")
        for name, r in row["contenders"].items():
            if "ms" in r:
                print(f"  {name:60s} {r['ms']:8.4f} ms {r['tflops']:6.1f} TFLOP/s "
                      f"{cudnn / r['ms'] if cudnn else float('nan'):6.3f}x cuDNN")
            else:
                print(f"  {name:60s} {r['error']}")


if __name__ == "__main__":
    main()

"""A training step's attention as a model hands it the tensors: eager and under
``torch.compile``, per contender, with the copies around the call counted in.

    OUT=DIR LABEL=name python benchmarks/probe_train_layout.py   (writes DIR/train_layout_<LABEL>.json)

transformers projects ``(B, N, H * D)``, views it as ``(B, N, H, D)`` and transposes to
``(B, H, N, D)`` for attention; after it, ``transpose(1, 2)`` and a reshape back to
``(B, N, H * D)``. An output or gradient written contiguous ``(B, H, N, D)`` makes that
transpose back a copy (the output forward, dQ/dK/dV backward); one written in the inputs'
layout makes it a view. The step here is exactly that: ``xq, xk, xv`` ``(B, N, H * D)`` leaves
standing for the projections, viewed and transposed, attention, transposed back and
reshaped, then ``torch.autograd.grad`` of the result with a fixed gradient. Contenders:
SDPA cuDNN and FLASH, ``flashtune.attention`` as routed, and forced to ``attn_fwd``'s pair
(attn_fwd with attn_bwd) and to the Gluon pair; each eager and compiled
(``torch.compile(fullgraph=True)``, where flashtune's calls go through its custom ops; FLASH
eager only).
Every contender's output and three gradients are checked against an fp32 reference
(``torch`` math on float32 copies) before it is timed with a cold L2 (``timing.bench``).
Run it once per code version (``LABEL``, ``PYTHONPATH`` ahead of the checkout for another
one) and compare the ratios to cuDNN of the same run. TFLOP/s: the training step's flops
(the forward's 3.5x, ANCHORS.md).
"""
import json
import os
import time
from contextlib import nullcontext


def main():
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import flashtune
    from flashtune.autotune.timing import bench
    from flashtune.core.problem import AttentionProblem
    from flashtune.integrations.model_bench import ATTENTION_KERNEL

    def others(step):
        """The kernels of one step that are not attention's (copies, casts, adds): name ->
        [count, device us], from torch.profiler."""
        step()
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
        found = {}
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA \
                    and not ATTENTION_KERNEL.search(e.name):
                n, us = found.get(e.name[:80], (0, 0.0))
                found[e.name[:80]] = (n + 1, us + float(e.self_device_time_total))
        return found

    label = os.environ.get("LABEL", "run")
    modes = os.environ.get("MODES", "eager,compiled").split(",")
    # (name, batch, heads_q, heads_kv, tokens, head_dim, causal)
    shapes = [("Llama-3-8B", 2, 32, 8, 4096, 128, True),
              ("Phi-3-mini", 2, 32, 32, 2048, 96, True),
              ("BERT-base", 32, 12, 12, 512, 64, False)]
    rows = []
    for model, b, hq, hkv, n, d, causal in shapes:
        p = AttentionProblem(b, hq, hkv, n, n, d, causal, "bf16")
        flops = 3.5 * p.flops()
        gen = torch.Generator(device="cuda").manual_seed(0)
        xs = [torch.randn(b, n, h * d, device="cuda", dtype=torch.bfloat16,
                          generator=gen).requires_grad_() for h in (hq, hkv, hkv)]
        dy = torch.randn(b, n, hq * d, device="cuda", dtype=torch.bfloat16, generator=gen)

        def block(attn, xq, xk, xv):
            q, k, v = (x.view(b, n, -1, d).transpose(1, 2) for x in (xq, xk, xv))
            return attn(q, k, v).transpose(1, 2).reshape(b, n, hq * d)

        def sdpa(q, k, v):  # the backend: the sdpa_kernel context the step runs in
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                                  enable_gqa=hq != hkv)

        def ours(impl=None):
            return lambda q, k, v: flashtune.attention(q, k, v, causal=causal, impl=impl)

        def math32(q, k, v):
            with sdpa_kernel(SDPBackend.MATH):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                                      enable_gqa=hq != hkv)

        leaves32 = [x.detach().float().requires_grad_() for x in xs]
        y32 = block(math32, *leaves32)
        ref = [y32.detach(), *torch.autograd.grad(y32, leaves32, dy.float())]
        attns = {"sdpa_cudnn": (sdpa, SDPBackend.CUDNN_ATTENTION),
                 "sdpa_flash": (sdpa, SDPBackend.FLASH_ATTENTION),
                 "flashtune.attention": (ours(), None),
                 "flashtune attn_fwd pair": (ours("attn_fwd"), None),
                 "flashtune Gluon pair": (ours("attn_fwd_gluon_bwd_gluon"), None)}
        row = {"model": model, "shape": {"batch": b, "heads_q": hq, "heads_kv": hkv,
                                         "seqlen": n, "head_dim": d, "causal": causal},
               "contenders": {}}
        for mode in modes:
            for name, (attn, backend) in attns.items():
                if mode == "compiled" and name == "sdpa_flash":
                    continue  # compiled: cuDNN's anchor is enough (and compiling takes time)
                key = f"{name} {mode}"
                fwd = (lambda attn=attn: lambda *x: block(attn, *x))()
                if mode == "compiled":
                    torch._dynamo.reset()
                    fwd = torch.compile(fwd, fullgraph=True)

                def step(fwd=fwd, backend=backend):
                    with sdpa_kernel(backend) if backend is not None else nullcontext():
                        y = fwd(*xs)
                        return (y, *torch.autograd.grad(y, xs, dy))
                try:
                    got = step()
                    errs = [((g.float() - r).norm() / r.norm()).item() for g, r in zip(got, ref)]
                    if not max(errs) < 2e-2:
                        row["contenders"][key] = {"error": f"relerr {errs}"}
                        continue
                    t = bench(step)
                    row["contenders"][key] = {"ms": t.median_ms, "tflops": flops / t.median_ms / 1e9,
                                              "relerr": errs, "other_kernels": others(step)}
                except Exception as exc:
                    row["contenders"][key] = {"error": str(exc).splitlines()[0][:200]}
                print(json.dumps({"model": model, "contender": key,
                                  **row["contenders"][key]}), flush=True)
        rows.append(row)
    doc = {"benchmark": "probe_train_layout", "label": label,
           "device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "date": time.strftime("%Y-%m-%d"), "rows": rows}
    out_dir = os.environ.get("OUT", "benchmarks/results")
    with open(os.path.join(out_dir, f"train_layout_{label}.json"), "w") as f:
        json.dump(doc, f, indent=1)
    for row in rows:
        s = row["shape"]
        print(f"\n[{label}] {row['model']} B{s['batch']} H{s['heads_q']}/{s['heads_kv']} "
              f"N{s['seqlen']} D{s['head_dim']}{' causal' if s['causal'] else ''}")
        for mode in modes:
            cudnn = row["contenders"].get(f"sdpa_cudnn {mode}", {}).get("ms")
            for key, r in row["contenders"].items():
                if not key.endswith(mode):
                    continue
                if "ms" in r:
                    other = r["other_kernels"]
                    print(f"  {key:40s} {r['ms']:8.3f} ms {r['tflops']:6.1f} TFLOP/s "
                          f"{cudnn / r['ms'] if cudnn else float('nan'):6.3f}x cuDNN; "
                          f"{sum(c for c, _ in other.values())} other kernels "
                          f"{sum(us for _, us in other.values()):7.1f} us")
                else:
                    print(f"  {key:40s} {r['error']}")


if __name__ == "__main__":
    main()

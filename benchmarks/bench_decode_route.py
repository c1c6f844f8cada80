"""Where flashtune.attention should route short queries: attn_fwd vs attn_decode (both with
their template defaults) over Nq x Nk x B, plus the host cost of a call.

    python benchmarks/bench_decode_route.py [--out benchmarks/results/decode_route.json]

Kernel time: CUDA-graph replays of 20 calls (no launch overhead), median of 5. Host time:
eager calls in a loop, synchronised at the end (the per-call cost once the GPU keeps up).
GQA 32:8, D 128, bf16. Every output checked against fp32 first. Prints a table last.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def graph_us(fn):
    from flashtune.autotune.timing import bench_graph

    return bench_graph(fn) * 1000


def host_us(fn, n=2000):
    import torch

    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) * 1e6 / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="benchmarks/results/decode_route.json")
    args = ap.parse_args()
    import torch

    import flashtune
    from flashtune.core.device import cuda_device
    from flashtune.core.problem import AttentionProblem
    from flashtune.kernel_templates import get_template
    from flashtune.runtime.kvcache import attention_with_kvcache

    fwd, dec = get_template("attn_fwd"), get_template("attn_decode")
    dev = cuda_device()
    hq, hkv, d, dt = 32, 8, 128, torch.bfloat16
    rows = []
    for b in (1, 16):
        for nq in (1, 4, 16):
            for nk in (64, 128, 256, 512, 1024, 4096):
                p = AttentionProblem(b, hq, hkv, nq, nk, d, True, "bf16")
                q = torch.randn(b, hq, nq, d, device="cuda", dtype=dt)
                k = torch.randn(b, hkv, nk, d, device="cuda", dtype=dt)
                v = torch.randn_like(k)
                ref = torch.nn.functional.scaled_dot_product_attention(
                    q.float(), k.float(), v.float(), enable_gqa=True,
                    attn_mask=torch.ones(nq, nk, device="cuda", dtype=torch.bool).tril(nk - nq))
                row = {"batch": b, "nq": nq, "nk": nk}
                for name, spec in (("fwd", fwd), ("decode", dec)):
                    cfg = spec.default_config(p, dev)
                    def fn(s=spec, c=cfg):
                        return s.launcher(q, k, v, c, causal=True)

                    err = ((fn().float() - ref).norm() / ref.norm()).item()
                    assert err < 2e-2, (name, row, err)
                    row[name + "_us"] = graph_us(fn)
                    row[name + "_config"] = cfg
                row["routed"] = flashtune.lookup_config(q, k, v, causal=True).template
                row["attention_host_us"] = host_us(lambda: flashtune.attention(q, k, v,
                                                                               causal=True))
                rows.append(row)
    # host cost of attention_with_kvcache (planned) vs its launcher: B 1, Nmax 1024, paged
    # (a kernel of a few us, so the loop measures the host)
    from flashtune.kernel_templates.attn_decode import attn_decode_kvcache
    from tests.decode_helpers import make_cache

    q, kc, vc, lens, table = make_cache([1000], hq, hkv, 1, d, dt, "cuda", page_size=64,
                                        capacity=1024, seed=0)
    p = AttentionProblem(1, hq, hkv, 1, 1024, d, True, "bf16")
    cfg = dec.default_config(p, dev)
    host = {
        "attention_with_kvcache_us": host_us(lambda: attention_with_kvcache(
            q, kc, vc, lens, block_table=table)),
        "attn_decode_kvcache_launcher_us": host_us(lambda: attn_decode_kvcache(
            q, kc, vc, lens, cfg, block_table=table)),
        "kernel_us": graph_us(lambda: attn_decode_kvcache(q, kc, vc, lens, cfg,
                                                          block_table=table)),
    }
    out = {"benchmark": "decode route: attn_fwd vs attn_decode defaults (graph-timed)",
           "device": dev.name, "torch": torch.__version__, "rows": rows, "kvcache_host": host,
           "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print("| B | Nq | Nk | fwd us | decode us | fwd/decode | routed | attention() host us |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['batch']} | {r['nq']} | {r['nk']} | {r['fwd_us']:.1f} | "
              f"{r['decode_us']:.1f} | {r['fwd_us'] / r['decode_us']:.2f} | {r['routed']} | "
              f"{r['attention_host_us']:.1f} |")
    print(json.dumps(host))


if __name__ == "__main__":
    main()

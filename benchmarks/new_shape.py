"""What the first call of a shape costs: torch SDPA's backends against flashtune.

    python benchmarks/new_shape.py --out benchmarks/results/new_shape_h200.json

Inference meets a new shape with every prompt length and every decoding step over a growing
KV cache. Per case and contender, six calls each with a key length never called before (the
keys a prefix view of one buffer, or a contiguous copy of it: both layouts transformers
hands over), then the same shape five times again; milliseconds from launch to a
synchronized stream, so a backend that plans per shape (cuDNN builds a graph) shows it. The
contenders: SDPA forced to cuDNN and to FLASH, SDPA as torch picks, flashtune.attention as
routed, and flashtune's attn_fwd by name. Prints a table, last, and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import flashtune
from flashtune.runtime.ops import lookup_config

CASES = {"prefill B1 H8 N128 D128": (1, 8, 8, 128, 128), "decode B8 H32/8 N1 D128": (8, 32, 8, 1, 128),
         "prefill B1 H8 N128 D64": (1, 8, 8, 128, 64), "prefill B4 H32 N512 D128": (4, 32, 32, 512, 128)}


def _ms(fn: Callable[[], object]) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3


def _forced(backend: SDPBackend) -> Callable[..., torch.Tensor]:
    def call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gqa: bool) -> torch.Tensor:
        with sdpa_kernel([backend]):
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa)
    return call


CONTENDERS: dict[str, Callable[..., torch.Tensor]] = {
    "sdpa_cudnn": _forced(SDPBackend.CUDNN_ATTENTION),
    "sdpa_flash": _forced(SDPBackend.FLASH_ATTENTION),
    "sdpa": lambda q, k, v, gqa: F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa),
    "flashtune": lambda q, k, v, gqa: flashtune.attention(q, k, v),
    "flashtune_attn_fwd": lambda q, k, v, gqa: flashtune.attention(q, k, v, impl="attn_fwd"),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="new_shape.json")
    args = parser.parse_args()
    rows, length = [], 600
    for label, (b, hq, hkv, nq, d) in CASES.items():
        gqa = hq != hkv
        q = torch.randn(b, hq, nq, d, device="cuda", dtype=torch.bfloat16)
        buf = torch.randn(b, hkv, 2400, d, device="cuda", dtype=torch.bfloat16)
        route = lookup_config(q, buf[:, :, :599], buf[:, :, :599])
        for layout in ("view", "contiguous"):
            def keys(n: int, layout: str = layout) -> torch.Tensor:
                return buf[:, :, :n] if layout == "view" else buf[:, :, :n].contiguous()
            for name, fn in CONTENDERS.items():
                length += 12  # lengths no contender has called
                row = {"case": label, "layout": layout, "contender": name,
                       "route": f"{route.template} ({route.source})"}
                try:
                    fn(q, keys(512), keys(512), gqa)
                    new = [_ms(lambda n=length + i: fn(q, keys(n), keys(n), gqa))
                           for i in range(6)]
                    again = [_ms(lambda: fn(q, keys(length), keys(length), gqa))
                             for _ in range(5)]
                except Exception as exc:  # a backend that cannot take the case: data
                    row["error"] = str(exc).splitlines()[0][:200]
                else:
                    row.update(new_ms=new, again_ms=again, new_median_ms=statistics.median(new),
                               again_median_ms=statistics.median(again))
                rows.append(row)
    result = {"benchmark": "new_shape", "device": torch.cuda.get_device_name(),
              "torch": torch.__version__, "cudnn": torch.backends.cudnn.version(),
              "date": time.strftime("%Y-%m-%d %H:%M:%S"), "rows": rows}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"ms per call ({result['device']}, torch {result['torch']}, cuDNN {result['cudnn']}): "
          "median of 6 calls at new key lengths | of 5 at one length again")
    for r in rows:
        got = (f"{r['new_median_ms']:8.2f} | {r['again_median_ms']:6.3f}" if "error" not in r
               else r["error"])
        print(f"{r['case']:26s} {r['layout']:10s} {r['contender']:19s} {got}   flashtune: {r['route']}")


if __name__ == "__main__":
    main()

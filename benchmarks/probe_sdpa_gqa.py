"""Probe (GPU): do the fused SDPA aten ops take heads_q != heads_kv directly (GQA), and
does their output match the fp32 reference? Prints one line per backend; JSON to argv[1]."""

from __future__ import annotations

import json
import sys

import torch

from flashtune.kernel_templates.attn_fwd.reference import attn_fwd_reference

aten = torch.ops.aten
out = {}
q = torch.randn(2, 8, 256, 128, device="cuda", dtype=torch.bfloat16)
k = torch.randn(2, 2, 256, 128, device="cuda", dtype=torch.bfloat16)
v = torch.randn_like(k)
ref, _ = attn_fwd_reference(q, k, v, causal=True, dtype=torch.float32)
calls = {
    "cudnn": lambda: aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, True)[0],
    "flash": lambda: aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True)[0],
    "efficient": lambda: aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0,
                                                                      True)[0],
}
for name, call in calls.items():
    try:
        o = call()
        err = float((o.float() - ref).norm() / ref.norm())
        out[name] = {"ok": err < 2e-2, "rel_err": err}
    except Exception as exc:  # noqa: BLE001
        out[name] = {"ok": False, "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"}
    print(name, out[name])
if len(sys.argv) > 1:
    with open(sys.argv[1], "w") as f:
        json.dump(out, f, indent=1)

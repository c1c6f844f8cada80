"""Compile the Gluon backward for sm_90 on the CPU and print what the compiler made of it.

    python -m flashtune.kernel_templates.attn_bwd_gluon '[{"head_dim": 64, "causal": true}]'

Each case is a config over ``DEFAULT_CONFIG`` plus optional ``head_dim`` (128), ``causal``
(false), ``dtype`` ("bf16"), ``layout`` ("bhsd" or "bshd"), ``window`` (false: with a
causal sliding window), ``softcap`` (0: none) and ``loops`` (false: with the main loops'
SASS census, :func:`~flashtune.kernel_templates.sm90.loop_census`); one JSON line per
case.

    python -m flashtune.kernel_templates.attn_bwd_gluon --prefilter [--jobs N]

writes ``sm90_compile.json`` (:mod:`.prefilter`).
"""

from __future__ import annotations

import json
import os
import re
import sys


def main(argv: list[str]) -> int:
    """Compile each case of ``argv[0]`` (a JSON list; default: the default config) and print
    its figures; with ``--prefilter``, :func:`.prefilter.main`."""
    if argv and argv[0] == "--prefilter":
        from flashtune.kernel_templates.attn_bwd_gluon.prefilter import main as prefilter

        return prefilter(argv)
    if os.environ.get("TRITON_INTERPRET"):
        print("unset TRITON_INTERPRET: this compiles for sm_90", file=sys.stderr)
        return 2
    from flashtune.kernel_templates.attn_bwd_gluon.launcher import DEFAULT_CONFIG, compile_sm90
    from flashtune.kernel_templates.attn_fwd_gluon.launcher import ptxas_stats
    from flashtune.kernel_templates.sm90 import loop_report

    for case in json.loads(argv[0]) if argv else [{}]:
        d = case.pop("head_dim", 128)
        causal = case.pop("causal", False)
        dtype = case.pop("dtype", "bf16")
        layout = case.pop("layout", "bhsd")
        loops = case.pop("loops", False)
        window = bool(case.pop("window", False))
        softcap = float(case.pop("softcap", 0.0))
        config = dict(DEFAULT_CONFIG, **case)
        c = compile_sm90(config, d, causal, dtype, layout, window=window, softcap=softcap)
        print(json.dumps({"config": config, "head_dim": d, "causal": causal, "dtype": dtype,
                          "layout": layout, "window": window, "softcap": softcap,
                          "shared": c.metadata.shared,
                          "warps": c.metadata.num_warps, **ptxas_stats(c.asm["ptx"]),
                          "atomics": sorted(set(re.findall(r"(?:atom|red)\.global\.[\w.]+",
                                                           c.asm["ptx"]))),
                          "tma_stores": len(re.findall(
                              r"cp\.async\.bulk\.tensor\.\dd\.global\.shared", c.asm["ptx"])),
                          **(loop_report(c.asm["cubin"]) if loops else {})}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

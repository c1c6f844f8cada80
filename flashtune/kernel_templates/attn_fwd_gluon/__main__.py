"""Compile the Gluon forward for sm_90 on the CPU and print what the compiler made of it.

    python -m flashtune.kernel_templates.attn_fwd_gluon \
        '[{"head_dim": 64, "causal": true}, {"PINGPONG": 1}]'

Each case is a config over ``DEFAULT_CONFIG`` plus optional ``head_dim`` (128), ``causal``
(false), ``dtype`` ("bf16"), ``layout`` ("bhsd", or "bshd": inputs in ``(B, N, H, D)``
storage), ``window`` (false: with a causal sliding window), ``softcap`` (0: none; with the scores
capped at it) and ``loops`` (false: with the
main loops' SASS census, :func:`~flashtune.kernel_templates.sm90.loop_census`); one JSON
line per case: the config, shared memory bytes,
warps, and
:func:`~flashtune.kernel_templates.attn_fwd_gluon.launcher.ptxas_stats`. No GPU needed; run
it without ``TRITON_INTERPRET``.

    python -m flashtune.kernel_templates.attn_fwd_gluon --prefilter [--jobs N]

writes ``sm90_compile.json``, the table behind the space's validity predicate
(:mod:`.prefilter`).
"""

from __future__ import annotations

import json
import os
import sys


def main(argv: list[str]) -> int:
    """Compile each case of ``argv[0]`` (a JSON list; default: the default config) and print
    its figures; with ``--prefilter``, :func:`.prefilter.main`."""
    if argv and argv[0] == "--prefilter":
        from flashtune.kernel_templates.attn_fwd_gluon.prefilter import main as prefilter

        return prefilter(argv)
    if os.environ.get("TRITON_INTERPRET"):
        print("unset TRITON_INTERPRET: this compiles for sm_90", file=sys.stderr)
        return 2
    from flashtune.kernel_templates.attn_fwd_gluon.launcher import (
        DEFAULT_CONFIG,
        compile_sm90,
        ptxas_stats,
    )
    from flashtune.kernel_templates.sm90 import loop_report

    for case in json.loads(argv[0]) if argv else [{}]:
        d = case.pop("head_dim", 128)
        causal = case.pop("causal", False)
        dtype = case.pop("dtype", "bf16")
        layout = case.pop("layout", "bhsd")
        loops = case.pop("loops", False)
        window = case.pop("window", False)
        softcap = float(case.pop("softcap", 0.0))
        c = compile_sm90(case, d, causal, dtype, layout, window, softcap)
        print(json.dumps({"config": dict(DEFAULT_CONFIG, **case), "head_dim": d,
                          "causal": causal, "dtype": dtype, "layout": layout,
                          "window": window, "softcap": softcap,
                          "shared": c.metadata.shared,
                          "warps": c.metadata.num_warps, **ptxas_stats(c.asm["ptx"]),
                          **(loop_report(c.asm["cubin"]) if loops else {})}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

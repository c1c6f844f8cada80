"""Write ``sm90_compile.json``, the table behind attn_bwd_gluon's validity predicate
(:mod:`.space` describes it): every structurally valid point of the space compiled for
sm_90a on the CPU, per head dim and causal flag (bf16), in a process pool.

    python -m flashtune.kernel_templates.attn_bwd_gluon --prefilter [--jobs N] [--out PATH]

No GPU needed (ptxas ships with triton); run it without ``TRITON_INTERPRET``, after any
change to ``kernel.py``, ``launcher.py`` or the space (a test checks the source hash).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path
from typing import Any

from flashtune.kernel_templates.attn_bwd_gluon.space import (
    HEAD_DIMS,
    REGENERATE,
    SPACE,
    TABLE,
    TABLE_FORMAT,
    entry_key,
    parse_table,
    structural_reason,
)

__all__ = ["cases", "compile_case", "main"]


def cases() -> list[dict[str, Any]]:
    """Every compile the table holds."""
    return [{"head_dim": d, "causal": c, "config": config}
            for config in SPACE if structural_reason(config) is None
            for d in HEAD_DIMS for c in (False, True)]


def compile_case(case: dict[str, Any]) -> dict[str, Any]:
    """Compile one case for sm_90a; the table entry (the error's first line on failure)."""
    from flashtune.kernel_templates.attn_bwd_gluon.launcher import compile_sm90
    from flashtune.kernel_templates.attn_fwd_gluon.launcher import ptxas_stats

    entry = dict(case, shared=None, registers=None, spill_bytes=None, error=None)
    try:
        compiled = compile_sm90(case["config"], case["head_dim"], case["causal"])
        stats = ptxas_stats(compiled.asm["ptx"])
        entry.update(shared=int(compiled.metadata.shared), registers=max(stats["registers"]),
                     spill_bytes=sum(stats["spill_store_bytes"]))
    except Exception as exc:  # noqa: BLE001 - a failure is a verdict
        lines = [t.strip() for t in str(exc).splitlines() if t.strip()]
        entry["error"] = f"{type(exc).__name__}: {lines[0] if lines else ''}"[:300]
    return entry


def main(argv: list[str] | None = None) -> int:
    """Compile every case and write the table; 2 when run under ``TRITON_INTERPRET``."""
    parser = argparse.ArgumentParser(prog=REGENERATE.rsplit(" ", 1)[0], description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prefilter", action="store_true", help="(the mode flag)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--out", type=Path, default=TABLE, help=f"default: {TABLE}")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET"):
        print("unset TRITON_INTERPRET: this compiles for sm_90", file=sys.stderr)
        return 2
    import triton

    from flashtune.kernel_templates.registry import source_hash

    todo = cases()
    here = Path(__file__).parent
    start = time.monotonic()
    entries = []
    with ProcessPoolExecutor(max_workers=max(1, args.jobs),
                             mp_context=get_context("spawn")) as pool:
        for i, entry in enumerate(pool.map(compile_case, todo), 1):
            entries.append(entry)
            print(f"[{i}/{len(todo)} {time.monotonic() - start:.0f}s] "
                  f"{entry_key(entry['head_dim'], entry['causal'], entry['config'])}: shared "
                  f"{entry['shared']}, registers {entry['registers']}, spills "
                  f"{entry['spill_bytes']}{', ' + entry['error'] if entry['error'] else ''}",
                  file=sys.stderr, flush=True)
    doc = {
        "format": TABLE_FORMAT,
        "about": "attn_bwd_gluon's main kernel compiled for sm_90a on the CPU (bf16): shared "
                 "memory bytes, ptxas registers and spill-store bytes, or the compile error, per "
                 "head dim, causal flag and config; read by space.py's validity predicate",
        "command": REGENERATE,
        "source_hash": source_hash(here / "kernel.py", here / "launcher.py"),
        "triton": triton.__version__,
        "target": "sm_90a",
        "entries": entries,
    }
    parse_table(doc, "the new table")
    args.out.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {len(entries)} entries to {args.out} in {time.monotonic() - start:.0f}s",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

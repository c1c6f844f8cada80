"""Write ``sm90_compile.json``, the table behind attn_fwd_gluon's validity predicate
(:mod:`.space` describes it): every point of the space compiled for sm_90a on the CPU, per
head dim, dtype and causal flag, in a process pool.

    python -m flashtune.kernel_templates.attn_fwd_gluon --prefilter [--jobs N] [--out PATH]

No GPU needed (ptxas ships with triton); run it without ``TRITON_INTERPRET``. Run it after
any change to ``kernel.py`` or ``launcher.py`` (the table's source hash must be the
template's; a test checks it), or to the space.
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

from flashtune.kernel_templates.attn_fwd_gluon.space import (
    DTYPES,
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
    """Every compile the table holds: each structurally valid config of the space at each
    head dim, dtype and causal flag."""
    return [{"head_dim": d, "dtype": dt, "causal": c, "config": config}
            for config in SPACE if structural_reason(config) is None
            for d in HEAD_DIMS for dt in DTYPES for c in (False, True)]


def compile_case(case: dict[str, Any]) -> dict[str, Any]:
    """Compile one case for sm_90a; the table entry (the error's first line on failure)."""
    from flashtune.kernel_templates.attn_fwd_gluon.launcher import compile_sm90, ptxas_stats

    entry = dict(case, shared=None, registers=None, spill_bytes=None, error=None)
    try:
        compiled = compile_sm90(case["config"], case["head_dim"], case["causal"], case["dtype"])
        stats = ptxas_stats(compiled.asm["ptx"])
        figures = dict(shared=int(compiled.metadata.shared), registers=max(stats["registers"]),
                       spill_bytes=sum(stats["spill_store_bytes"]))
    except Exception as exc:  # noqa: BLE001 - a failure is a verdict
        lines = [t.strip() for t in str(exc).splitlines() if t.strip()]
        entry["error"] = f"{type(exc).__name__}: {lines[0] if lines else ''}"[:300]
        return entry
    entry.update(figures)
    return entry


def main(argv: list[str] | None = None) -> int:
    """Compile every case and write the table; 2 when run under ``TRITON_INTERPRET``."""
    parser = argparse.ArgumentParser(prog=REGENERATE.rsplit(" ", 1)[0], description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prefilter", action="store_true", help="(the mode flag)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                        help="compile processes (default: every core)")
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
                  f"{entry_key(entry['head_dim'], entry['dtype'], entry['causal'], entry['config'])}"
                  f": shared {entry['shared']}, registers {entry['registers']}, "
                  f"spills {entry['spill_bytes']}{', ' + entry['error'] if entry['error'] else ''}",
                  file=sys.stderr, flush=True)
    doc = {
        "format": TABLE_FORMAT,
        "about": "attn_fwd_gluon compiled for sm_90a on the CPU: shared memory bytes, ptxas "
                 "registers and spill-store bytes, or the compile error, per head dim, dtype, "
                 "causal flag and config; read by space.py's validity predicate",
        "command": REGENERATE,
        "source_hash": source_hash(here / "kernel.py", here / "launcher.py"),
        "triton": triton.__version__,
        "target": "sm_90a",
        "entries": entries,
    }
    parse_table(doc, "the new table")  # what the predicate will read back
    args.out.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {len(entries)} entries to {args.out} in {time.monotonic() - start:.0f}s",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

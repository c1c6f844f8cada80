"""Write ``sm90_compile.json``, the table behind attn_bwd_gluon's validity predicate
(:mod:`.space` describes it): every structurally valid point of the space compiled for
sm_90a on the CPU, per head dim and causal flag (bf16), in a process pool.

    python -m flashtune.kernel_templates.attn_bwd_gluon --prefilter [--jobs N] [--out PATH]

No GPU needed (ptxas ships with triton); run it without ``TRITON_INTERPRET``, after any
change to ``kernel.py``, ``launcher.py`` or the space (a test checks the source hash).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from flashtune.kernel_templates.attn_bwd_gluon.space import (
    COMPILED,
    HEAD_DIMS,
    REGENERATE,
    SPACE,
    TABLE,
    TABLE_FORMAT,
    entry_key,
    parse_table,
    structural_reason,
)
from flashtune.kernel_templates.sm90_table import compile_entry, write_table

__all__ = ["cases", "compile_case", "main"]


def cases() -> list[dict[str, Any]]:
    """Every compile the table holds (the knobs it is keyed by: :data:`.space.COMPILED`)."""
    return [{"head_dim": d, "causal": c, "config": {n: config[n] for n in COMPILED}}
            for config in SPACE
            if all(config[n] == 0 for n in set(config) - set(COMPILED))
            for d in HEAD_DIMS if structural_reason(config, d) is None
            for c in (False, True)]


def compile_case(case: dict[str, Any], old: dict[str, Any] | None = None,
                 keep: bool = False) -> dict[str, Any]:
    """Compile one case for sm_90a; the table entry (the error's first line on failure).
    ``old``: the regenerated table's entry of the same key, reused when its frontend IR
    hash is this compile's (``keep``: whatever it is; see :func:`compile_entry`)."""
    from flashtune.kernel_templates.attn_bwd_gluon.launcher import compile_sm90

    return compile_entry(case, lambda: compile_sm90(case["config"], case["head_dim"],
                                                    case["causal"]),
                         old, keep)


def main(argv: list[str] | None = None) -> int:
    """Compile every case and write the table; 2 when run under ``TRITON_INTERPRET``."""
    import triton

    from flashtune.kernel_templates.registry import source_hash

    here = Path(__file__).parent
    return write_table(
        argv, command=REGENERATE, description=__doc__, table=TABLE, cases=cases(),
        compile_case=compile_case,
        label=lambda e: entry_key(e["head_dim"], e["causal"], e["config"]),
        header={
            "format": TABLE_FORMAT,
            "about": "attn_bwd_gluon's main kernel compiled for sm_90a on the CPU (bf16): "
                     "shared memory bytes, ptxas registers and spill-store bytes, or the compile "
                     "error, per head dim, causal flag and config; read by space.py's validity "
                     "predicate",
            "command": REGENERATE,
            "source_hash": source_hash(here / "kernel.py", here / "launcher.py"),
            "triton": triton.__version__,
            "target": "sm_90a",
        },
        check=parse_table)


if __name__ == "__main__":
    sys.exit(main())

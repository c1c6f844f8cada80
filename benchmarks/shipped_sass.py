"""The machine code of every shipped config of a Triton template, compiled for sm_90 on the CPU:
the evidence for re-keying the shipped tables after a kernel change that leaves their configs'
code as it was (a knob added behind a constexpr whose off value is the old code).

    python benchmarks/shipped_sass.py attn_decode --out before.json   (no TRITON_INTERPRET)
    ... change the kernel ...
    python benchmarks/shipped_sass.py attn_decode --compare before.json

The configs: every entry of the template's files in ``flashtune/configs`` (``template=NAME``)
and every candidate of that implementation in the op files (``op=...``), and a backward's half
of the training pairs that name it (``op=train``, the ``bwd.`` keys), each compiled as the
precompiler launches it for its problem (``kernel_templates.sm90.compile_launches``), in a
pool of ``--workers`` processes. Each launch gives ptxas' registers and spills and
``sass_hash`` (the instructions alone, so code moved in its file hashes the same). With
``--compare`` the run fails (exit 1) unless every config compiles to the same instructions
as in the earlier run; only then may the files' source hash be replaced by the new one.
(2026-12-01: attn_decode's fused-combine knob left all 172 shipped configs' 311 launches as
they were; ``variants/decode_fused_combine.diff``.)
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def shipped_configs(template: str, configs_dir: Path = ROOT / "flashtune" / "configs"
                    ) -> list[str]:
    """The distinct ``[problem key, config]`` pairs (canonical JSON) of ``template`` in the
    shipped files: its own tables' entries and its candidates in the op files, sorted."""
    from flashtune.kernel_templates.registry import catalog
    from flashtune.kernel_templates.training import BWD_PREFIX

    specs = catalog()
    seen = set()
    for path in sorted(configs_dir.glob("*.json")):
        doc = json.loads(path.read_text())
        if doc.get("template", {}).get("name") == template:
            for e in doc["entries"]:
                seen.add(json.dumps([e["problem"], e["config"]], sort_keys=True))
        for choice in doc["entries"] if "op" in doc else []:  # an op file's choices
            for cand in choice.get("candidates", []):
                config = cand["config"]
                spec = specs.get(cand["implementation"])
                if doc["op"] == "train" and spec is not None and spec.backward == template:
                    # a training pair's backward half (its "bwd."-prefixed keys)
                    config = {n[len(BWD_PREFIX):]: v for n, v in config.items()
                              if n.startswith(BWD_PREFIX)}
                elif cand["implementation"] != template:
                    continue
                seen.add(json.dumps([choice["problem"], config], sort_keys=True))
    return sorted(seen)


def compile_one(template: str, key: str) -> tuple[str, list[dict] | str]:
    """One pair's launches (kernel, sass, registers, spill bytes), or the compile error."""
    os.environ.pop("TRITON_INTERPRET", None)
    from flashtune.core.problem import AttentionProblem
    from flashtune.kernel_templates.sm90 import compile_launches

    problem, config = json.loads(key)
    try:
        launches = compile_launches(template, AttentionProblem.from_key(problem), config)
    except Exception as exc:  # noqa: BLE001 - recorded: a config that no longer compiles
        return key, f"{type(exc).__name__}: {exc}"[:300]
    return key, [{"kernel": r["kernel"], "sass": r["sass"], "registers": r["registers"],
                  "spill_store_bytes": r["spill_store_bytes"]} for r in launches]


def differences(before: dict, after: dict) -> list[str]:
    """What changed between two runs: pairs only one run has, and pairs whose launches
    (kernels and instructions) differ."""
    out = [f"only before: {k}" for k in sorted(set(before) - set(after))]
    out += [f"only after: {k}" for k in sorted(set(after) - set(before))]
    for k in sorted(set(before) & set(after)):
        a, b = _code(before[k]), _code(after[k])
        if a != b:
            out.append(f"changed: {k}: {a} -> {b}")
    return out


def _code(launches: list[dict] | str) -> list[tuple[str, str]] | str:
    """What decides a pair's machine code: each launch's kernel and instructions (or its
    compile error)."""
    if isinstance(launches, str):
        return launches
    return [(x["kernel"], x["sass"]) for x in launches]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("template")
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--configs", type=Path, default=ROOT / "flashtune" / "configs",
                    help="the folder of shipped files (default: the package's)")
    ap.add_argument("--out", default=None, help="write this run's figures as JSON")
    ap.add_argument("--compare", default=None, metavar="JSON",
                    help="an earlier run's --out: exit 1 unless every config's code is the same")
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET"):
        print("unset TRITON_INTERPRET: this compiles for sm_90", file=sys.stderr)
        return 2
    keys = shipped_configs(args.template, args.configs)
    print(f"{len(keys)} shipped {args.template} configs", file=sys.stderr)
    with ProcessPoolExecutor(max(1, args.workers)) as pool:
        result = dict(pool.map(compile_one, [args.template] * len(keys), keys))
    sass_missing = any(not isinstance(r, str) and not all(x["sass"] for x in r)
                       for r in result.values())
    if sass_missing:
        print("no nvdisasm: the instructions were not hashed", file=sys.stderr)
        return 2
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1, sort_keys=True))
    errors = sum(isinstance(r, str) for r in result.values())
    launches = sum(len(r) for r in result.values() if not isinstance(r, str))
    print(f"{launches} launches compiled, {errors} configs failed to compile", file=sys.stderr)
    if args.compare:
        diff = differences(json.loads(Path(args.compare).read_text()), result)
        for line in diff:
            print(line)
        print(f"{len(result) - len(diff)} of {len(result)} configs: the same code"
              if not diff else f"{len(diff)} differences", file=sys.stderr)
        return 1 if diff else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())

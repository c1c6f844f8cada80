"""Compile a Triton template's launches for Hopper (sm_90) on the CPU, no GPU needed, and
report what ptxas made of them: shared memory, registers, spill stores, and hashes of the
machine code (to show that a change leaves a config's code as it was): of the cubin's bytes
(which also hold line tables, so moving code in a file changes it) and of its instructions
alone (``nvdisasm``'s listing without addresses, encodings or line info), and a census of
its main loops' instructions (:func:`loop_census`: a step's count, spills and masked
sections, which the Gluon templates' ``python -m`` compile commands print with
``"loops": true``).

Each launch is compiled as the launcher would launch it for contiguous, aligned inputs of
the problem (the template's ``warmup_launches``, built from shapes alone), with Triton's
own argument specialisation (integer divisibility, constants of 1), so the figures are the
ones the GPU would run. Not part of any source hash: it compiles, it does not decide code.

    python -m flashtune.kernel_templates.sm90 \
        '[{"template": "attn_fwd", "head_dim": 80, "causal": true}]'

Each case names a ``template`` (a registered Triton template with warmup launches) and
optionally the problem (``batch`` 4, ``heads`` 16, ``kv_heads`` (heads), ``seqlen`` 2048,
``kv_seqlen`` (seqlen), ``head_dim`` 128, ``causal`` false, ``dtype`` "bf16", ``dropout``
0), a
``config`` (default: the template's default config for an H100) and ``"loops": true`` for
each launch's :func:`loop_census`; one JSON line per launch.
Run it without ``TRITON_INTERPRET`` (under the interpreter the kernels are not compiled).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from collections.abc import Mapping
from typing import Any

from flashtune.core.device import DeviceFingerprint
from flashtune.core.problem import AttentionProblem

__all__ = ["H100", "compile_launches", "loop_census", "loop_report", "main", "sass_listing"]

# the H100 SXM the shipped tables are for (what default configs are derived for)
H100 = DeviceFingerprint("NVIDIA_H100_80GB_HBM3", "9.0", 132, 232448, 85 << 30)


def compile_launches(template: str, problem: AttentionProblem,
                     config: Mapping[str, int] | None = None, *,
                     loops: bool = False) -> list[dict[str, Any]]:
    """Compile every launch of ``template`` for ``problem`` with ``config`` for sm_90.

    Arguments:
        template: a registered template of kind ``"triton"`` (``attn_fwd``, ``attn_bwd``,
            ``attn_decode``).
        problem: the shapes the launches are built for.
        config: the config (None: the template's default config on :data:`H100`).
        loops: also give each launch's ``loops`` (:func:`loop_report`).
    Returns:
        One dict per launch, in launch order: ``kernel`` (its name), ``config``,
        ``shared`` (bytes), ``warps``, ``registers`` and ``spill_store_bytes`` (ptxas'
        figures for sm_90a), ``cubin`` (the first 16 hex characters of the machine code's
        sha256) and ``sass`` (the same of its instructions alone: :func:`sass_hash`).
    Raises:
        RuntimeError under ``TRITON_INTERPRET``; what the compiler raises for a config it
        cannot compile.
    """
    if os.environ.get("TRITON_INTERPRET"):
        raise RuntimeError("unset TRITON_INTERPRET: this compiles for sm_90")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.compiler import compile as triton_compile
    from triton.runtime.jit import create_function_from_signature

    from flashtune.kernel_templates import get_template
    from flashtune.kernel_templates.attn_fwd_gluon.launcher import ptxas_stats

    spec = get_template(template)
    if spec.warmup_launches is None:
        raise ValueError(f"template {template!r} has no warmup launches to compile")
    cfg = dict(spec.default_config(problem, H100) if config is None else config)
    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    results = []
    for kernel, args, kwargs, _grid in spec.warmup_launches(problem, cfg):
        # what JITFunction.run does before it compiles, with the target named
        kwargs = {**kwargs, "debug": False}
        binder = create_function_from_signature(kernel.signature, kernel.params, backend)
        bound, specialization, options = binder(*args, **kwargs)
        options, signature, constexprs, attrs = kernel._pack_args(
            backend, kwargs, bound, specialization, options)
        compiled = triton_compile(ASTSource(kernel, signature, constexprs, attrs),
                                  target=target, options=options.__dict__)
        stats = ptxas_stats(compiled.asm["ptx"])
        results.append({
            "kernel": kernel.fn.__name__, "config": cfg, "shared": compiled.metadata.shared,
            "warps": compiled.metadata.num_warps, "registers": max(stats["registers"]),
            "spill_store_bytes": max(stats["spill_store_bytes"], default=0),
            "cubin": hashlib.sha256(compiled.asm["cubin"]).hexdigest()[:16],
            "sass": sass_hash(compiled.asm["cubin"]),
            **(loop_report(compiled.asm["cubin"]) if loops else {})})
    return results


def _nvdisasm(cubin: bytes, *flags: str) -> str | None:
    """``nvdisasm``'s listing of ``cubin`` with ``flags`` (Triton's own copy of the tool,
    else one on PATH); None where neither is found."""
    import shutil
    import subprocess
    import tempfile
    from pathlib import Path

    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    found = str(tool) if tool.exists() else shutil.which("nvdisasm")
    if found is None:
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([found, *flags, f.name], capture_output=True, text=True,
                              check=True).stdout


def sass_listing(cubin: bytes) -> str:
    """``nvdisasm -c`` of ``cubin``: the instructions with their addresses and branch
    labels. Raises RuntimeError when no ``nvdisasm`` is found."""
    listing = _nvdisasm(cubin, "-c")
    if listing is None:
        raise RuntimeError("no nvdisasm: neither triton's copy nor one on PATH")
    return listing


# the opcodes a loop's census counts (a main loop's matrix products, softmax, masking,
# spills, shared memory and synchronisation)
LOOP_OPCODES = ("HGMMA", "HMMA", "LDGSTS", "LDSM", "MUFU", "FFMA", "FMUL", "FADD", "FSEL", "ISETP", "SEL", "IADD3",
                "IMAD", "LOP3", "SHF", "F2FP", "LDS", "STS", "STSM", "LDL", "STL", "BAR",
                "SYNCS")
# a conditional forward branch inside a loop skipping more instructions than this is a
# section of its own (a mask's, an epilogue's)
SECTION_MIN = 20


def loop_census(listing: str) -> list[dict[str, Any]]:
    """The innermost loops of an ``nvdisasm -c`` listing that issue ``HGMMA`` or ``HMMA`` (a
    kernel's main loops: one per consumer partition of a warp-specialized kernel), in
    address order.
    A loop runs from a branch label to the last instruction before the kernel's last
    ``EXIT`` branching back to it. Each:
    ``start``/``end`` (addresses), ``instructions``, ``opcodes`` (counts of
    :data:`LOOP_OPCODES`, predicated ones included) and ``sections``: the conditional
    forward branches inside it that skip more than :data:`SECTION_MIN` instructions (what
    runs only on some steps, e.g. a mask), each with its own ``start``, ``end``,
    ``instructions`` and ``opcodes``. A static census: which instructions a step may
    issue, not how often (the GPU's profile says that)."""
    import re

    label_re = re.compile(r"^\s*(\.L_x_\d+):")
    instr_re = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
    branch_re = re.compile(r"BRA\b[^`]*`\(?(\.L_x_\d+)")
    code: list[tuple[int, str]] = []
    labels: dict[str, int] = {}
    pending: list[str] = []
    for line in listing.splitlines():
        found = label_re.match(line)
        if found:
            pending.append(found.group(1))
            continue
        found = instr_re.search(line)
        if found:
            for name in pending:
                labels[name] = len(code)
            pending = []
            code.append((int(found.group(1), 16), found.group(2)))

    def opcode(text: str) -> str:
        words = text.split()
        return (words[1] if words[0].startswith("@") else words[0]).split(".")[0]

    def census(first: int, last: int) -> dict[str, Any]:
        ops = [opcode(text) for _, text in code[first:last + 1]]
        return {"start": code[first][0], "end": code[last][0], "instructions": len(ops),
                "opcodes": {name: ops.count(name) for name in LOOP_OPCODES
                            if name in ops}}

    # past the last EXIT lie the out-of-line blocks (barrier waits' spin loops), each
    # branching back into a loop it was called from: not loops of their own
    exits = [i for i, (_, text) in enumerate(code) if opcode(text) == "EXIT"]
    body_end = exits[-1] if exits else len(code)
    loops = []
    for i, (_, text) in enumerate(code[:body_end]):
        found = branch_re.search(text)
        if found and labels.get(found.group(1), i) < i:
            first = labels[found.group(1)]
            if any(opcode(t) in ("HGMMA", "HMMA") for _, t in code[first:i + 1]):
                loops.append((first, i))
    # innermost: no other such loop inside; the last back branch to a label ends its loop
    ends: dict[int, int] = {}
    for first, last in loops:
        ends[first] = max(last, ends.get(first, last))
    spans = sorted(ends.items())
    inner = [(a, b) for a, b in spans
             if not any((c, d) != (a, b) and a <= c and d <= b for c, d in spans)]
    result = []
    for first, last in inner:
        entry = census(first, last)
        sections = []
        for j in range(first, last):
            text = code[j][1]
            found = branch_re.search(text)
            target = labels.get(found.group(1), -1) if found else -1
            if text.startswith("@") and j < target <= last and target - j > SECTION_MIN:
                sections.append(census(j + 1, target - 1))
        entry["sections"] = sections
        result.append(entry)
    return result


def loop_report(cubin: bytes) -> dict[str, Any]:
    """``{"loops": ...}``: :func:`loop_census` of ``cubin``'s listing (the templates'
    ``python -m`` compile commands print it with a case's ``"loops": true``)."""
    return {"loops": loop_census(sass_listing(cubin))}


def sass_hash(cubin: bytes) -> str:
    """The first 16 hex characters of the sha256 of a cubin's instructions: ``nvdisasm``'s
    listing (Triton's own copy) with addresses, encodings and comments dropped, so two
    builds whose code differs only in its line tables (a kernel moved in its file) hash
    the same. "" where no ``nvdisasm`` is found."""
    import re

    listing = _nvdisasm(cubin)
    if listing is None:
        return ""
    code = [re.sub(r"/\*.*?\*/", "", line).strip() for line in listing.splitlines()
            if ";" in line]
    return hashlib.sha256("\n".join(c for c in code if c).encode()).hexdigest()[:16]


def _problem(case: Mapping[str, Any]) -> AttentionProblem:
    heads = int(case.get("heads", 16))
    seqlen = int(case.get("seqlen", 2048))
    return AttentionProblem(int(case.get("batch", 4)), heads, int(case.get("kv_heads", heads)),
                            seqlen, int(case.get("kv_seqlen", seqlen)),
                            int(case.get("head_dim", 128)), bool(case.get("causal", False)),
                            str(case.get("dtype", "bf16")),
                            dropout=float(case.get("dropout", 0.0)))


def main(argv: list[str]) -> int:
    """Compile each case of ``argv[0]`` (a JSON list, see the module doc) and print one JSON
    line per launch (the case's fields with the launch's figures)."""
    if os.environ.get("TRITON_INTERPRET"):
        print("unset TRITON_INTERPRET: this compiles for sm_90", file=sys.stderr)
        return 2
    for case in json.loads(argv[0]):
        for launch in compile_launches(case["template"], _problem(case), case.get("config"),
                                       loops=bool(case.get("loops", False))):
            print(json.dumps({**case, **launch}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

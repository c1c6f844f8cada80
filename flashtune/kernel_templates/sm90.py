"""Compile a Triton template's launches for Hopper (sm_90) on the CPU, no GPU needed, and
report what ptxas made of them: shared memory, registers, spill stores, and hashes of the
machine code (to show that a change leaves a config's code as it was): of the cubin's bytes
(which also hold line tables, so moving code in a file changes it) and of its instructions
alone (``nvdisasm``'s listing without addresses, encodings or line info).

Each launch is compiled as the launcher would launch it for contiguous, aligned inputs of
the problem (the template's ``warmup_launches``, built from shapes alone), with Triton's
own argument specialisation (integer divisibility, constants of 1), so the figures are the
ones the GPU would run. Not part of any source hash: it compiles, it does not decide code.

    python -m flashtune.kernel_templates.sm90 \
        '[{"template": "attn_fwd", "head_dim": 80, "causal": true}]'

Each case names a ``template`` (a registered Triton template with warmup launches) and
optionally the problem (``batch`` 4, ``heads`` 16, ``kv_heads`` (heads), ``seqlen`` 2048,
``kv_seqlen`` (seqlen), ``head_dim`` 128, ``causal`` false, ``dtype`` "bf16", ``dropout``
0) and a
``config`` (default: the template's default config for an H100); one JSON line per launch.
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

__all__ = ["H100", "compile_launches", "main"]

# the H100 SXM the shipped tables are for (what default configs are derived for)
H100 = DeviceFingerprint("NVIDIA_H100_80GB_HBM3", "9.0", 132, 232448, 85 << 30)


def compile_launches(template: str, problem: AttentionProblem,
                     config: Mapping[str, int] | None = None) -> list[dict[str, Any]]:
    """Compile every launch of ``template`` for ``problem`` with ``config`` for sm_90.

    Arguments:
        template: a registered template of kind ``"triton"`` (``attn_fwd``, ``attn_bwd``,
            ``attn_decode``).
        problem: the shapes the launches are built for.
        config: the config (None: the template's default config on :data:`H100`).
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
            "sass": sass_hash(compiled.asm["cubin"])})
    return results


def sass_hash(cubin: bytes) -> str:
    """The first 16 hex characters of the sha256 of a cubin's instructions: ``nvdisasm``'s
    listing (Triton's own copy) with addresses, encodings and comments dropped, so two
    builds whose code differs only in its line tables (a kernel moved in its file) hash
    the same. "" where no ``nvdisasm`` is found."""
    import re
    import shutil
    import subprocess
    import tempfile
    from pathlib import Path

    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    found = str(tool) if tool.exists() else shutil.which("nvdisasm")
    if found is None:
        return ""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        listing = subprocess.run([found, f.name], capture_output=True, text=True,
                                 check=True).stdout
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
        for launch in compile_launches(case["template"], _problem(case), case.get("config")):
            print(json.dumps({**case, **launch}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

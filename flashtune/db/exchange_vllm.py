"""Exported best configs as vLLM-style tuned-config files (``flashtune export --format vllm``).

vLLM ships its tuned Triton configs as one flat JSON object per device and kernel variant,
named ``E=8,N=14336,device_name=NVIDIA_H100_80GB_HBM3.json``, mapping a shape key (the
token count ``"M"``) to a config dict. The same here: one file per device x template x
(dtype, head_dim, causal), named by
:func:`flashtune.db.exchange.vllm_config_file_name`, e.g.
``template=attn_fwd,dtype=bf16,head_dim=128,causal=1,device_name=NVIDIA_H100_80GB_HBM3.json``,
mapping ``"B=1,Hq=32,Hkv=8,Nq=2048,Nk=2048"`` to ``{"BLOCK_M": 128, "BLOCK_N": 64, ...}``::

    {
        "B=1,Hq=32,Hkv=8,Nq=2048,Nk=2048": {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8,
                                             "num_stages": 3, "USE_TMA": 1, ...},
        ...
    }

Keys come in numeric order of (B, Hq, Hkv, Nq, Nk); timings and versions are left out (the
``flashtune`` format keeps them). These files are for other consumers: flashtune's own
loader reads only ``flashtune``-format files (``device_name=...,template=....json``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from flashtune.core.problem import OPTIONAL
from flashtune.db.exchange import ConfigDocument, vllm_config_file_name

__all__ = ["SHAPE_FIELDS", "VllmFile", "parse_shape_key", "shape_key", "vllm_files",
           "vllm_to_json"]

# (label in the shape key, field of the problem key)
SHAPE_FIELDS = (("B", "batch"), ("Hq", "heads_q"), ("Hkv", "heads_kv"), ("Nq", "seqlen_q"),
                ("Nk", "seqlen_k"))
_GROUP_FIELDS = ("dtype", "head_dim", "causal")
_KEY = re.compile(",".join(f"{label}=([1-9][0-9]*)" for label, _ in SHAPE_FIELDS))


@dataclass(frozen=True)
class VllmFile:
    """One vLLM-style file: its name and its shape key -> config mapping, in key order."""

    name: str
    device: str
    template: str
    configs: dict[str, dict[str, int]]


def shape_key(problem: Mapping[str, Any]) -> str:
    """``"B=1,Hq=32,Hkv=8,Nq=2048,Nk=2048"`` for a problem key; ``ValueError`` when the key
    lacks one of the fields or one is not a positive int."""
    parts = []
    for label, name in SHAPE_FIELDS:
        value = problem.get(name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"problem key {dict(problem)!r} has no positive int {name!r}; "
                             "expected an attention problem key")
        parts.append(f"{label}={value}")
    return ",".join(parts)


def parse_shape_key(text: str) -> dict[str, int]:
    """The problem-key fields of a :func:`shape_key` string (``{"batch": 1, ...}``);
    ``ValueError`` for anything else."""
    match = _KEY.fullmatch(text)
    if match is None:
        raise ValueError(f"shape key {text!r} is not of the form "
                         "'B=<int>,Hq=<int>,Hkv=<int>,Nq=<int>,Nk=<int>'")
    return {name: int(v) for (_, name), v in zip(SHAPE_FIELDS, match.groups())}


def _order(key: str) -> tuple[int, ...]:
    return tuple(parse_shape_key(key).values())


def vllm_files(docs: Sequence[ConfigDocument]) -> list[VllmFile]:
    """The vLLM-style files of ``docs`` (see the module docstring), sorted by name.

    ``docs`` are validated documents (:func:`flashtune.db.exchange.export_documents`); each
    is split by (dtype, head_dim, causal) of its problems. Entries of problems with a
    score modification (window, softcap, ALiBi) or of a packed batch
    (:data:`~flashtune.core.problem.OPTIONAL`) are left out: vLLM's shape keys have no
    field for them, and the plain shape's config would be overwritten. ``ValueError`` for a problem key that is not an attention
    problem's, or two documents that would write one file.
    """
    files: dict[str, VllmFile] = {}
    for doc in docs:
        groups: dict[tuple[Any, ...], dict[str, dict[str, int]]] = {}
        for entry in doc.entries:
            problem = entry.problem
            if any(name in problem for name in OPTIONAL):
                continue
            missing = [f for f in _GROUP_FIELDS if f not in problem]
            if missing:
                raise ValueError(f"problem key {problem!r} of {doc.file_name()} has no "
                                 f"{', '.join(missing)}; expected an attention problem key")
            group = tuple(problem[f] for f in _GROUP_FIELDS)
            groups.setdefault(group, {})[shape_key(problem)] = dict(entry.config)
        for (dtype, head_dim, causal), configs in groups.items():
            name = vllm_config_file_name(doc.device.name, doc.template, dtype=dtype,
                                         head_dim=head_dim, causal=causal)
            if name in files:
                raise ValueError(f"two documents would both write {name}; expected one "
                                 "document per device and template")
            files[name] = VllmFile(name, doc.device.name, doc.template,
                                   {k: configs[k] for k in sorted(configs, key=_order)})
    return [files[n] for n in sorted(files)]


def vllm_to_json(file: VllmFile) -> str:
    """The file's text: its mapping as JSON with indent 4 (as vLLM writes its configs), keys
    in numeric shape order, config keys sorted, a trailing newline."""
    return json.dumps({k: dict(sorted(v.items())) for k, v in file.configs.items()},
                      indent=4, allow_nan=False) + "\n"

"""vLLM-style export files: the naming function, shape keys, grouping and the JSON text."""

from __future__ import annotations

import dataclasses
import json

import pytest

from flashtune.core.problem import AttentionProblem
from flashtune.db.exchange import (
    ConfigDocument,
    ConfigEntry,
    config_file_name,
    vllm_config_file_name,
)
from flashtune.db.exchange_vllm import (
    parse_shape_key,
    shape_key,
    vllm_files,
    vllm_to_json,
)
from tests.db_tests.exchange_support import CONFIGS, T0, make_document

H100_NAME = "NVIDIA_H100_80GB_HBM3"


def test_file_name_is_vllm_style() -> None:
    assert vllm_config_file_name(H100_NAME, "attn_fwd", dtype="bf16", head_dim=128,
                                 causal=True) == (
        "template=attn_fwd,dtype=bf16,head_dim=128,causal=1,"
        "device_name=NVIDIA_H100_80GB_HBM3.json")
    assert vllm_config_file_name("cpu-interpreter", "attn_bwd", dtype="fp16", head_dim=16,
                                 causal=False).endswith(",causal=0,device_name=cpu-interpreter.json")


@pytest.mark.parametrize("kwargs,needle", [
    (dict(device_name="../etc", template="attn_fwd", dtype="bf16", head_dim=64, causal=True),
     "device name '../etc'"),
    (dict(device_name=H100_NAME, template="a/b", dtype="bf16", head_dim=64, causal=True),
     "template name 'a/b'"),
    (dict(device_name=H100_NAME, template="attn_fwd", dtype="bf,16", head_dim=64, causal=True),
     "dtype 'bf,16'"),
    (dict(device_name=H100_NAME, template="attn_fwd", dtype="bf16", head_dim=0, causal=True),
     "head_dim 0 is not a positive int"),
    (dict(device_name=H100_NAME, template="attn_fwd", dtype="bf16", head_dim=True, causal=True),
     "head_dim True"),
])
def test_file_name_refuses_unsafe_parts(kwargs: dict, needle: str) -> None:
    with pytest.raises(ValueError) as info:
        vllm_config_file_name(**kwargs)
    assert needle in str(info.value)


def test_shape_key_round_trip() -> None:
    key = AttentionProblem(1, 32, 8, 2048, 4096, 128, True, "bf16").key()
    assert shape_key(key) == "B=1,Hq=32,Hkv=8,Nq=2048,Nk=4096"
    assert parse_shape_key(shape_key(key)) == {k: key[k] for k in
                                               ("batch", "heads_q", "heads_kv", "seqlen_q",
                                                "seqlen_k")}
    for bad in ("B=1,Hq=32", "B=0,Hq=1,Hkv=1,Nq=1,Nk=1", "M=16", "B=1,Hq=2,Hkv=2,Nq=3,Nk=4,"):
        with pytest.raises(ValueError):
            parse_shape_key(bad)
    with pytest.raises(ValueError, match="no positive int 'seqlen_k'"):
        shape_key({"batch": 1, "heads_q": 2, "heads_kv": 2, "seqlen_q": 4})


def _doc_with(problems: list[AttentionProblem]) -> ConfigDocument:
    entries = tuple(ConfigEntry(problem=p.key(), bucket=p.bucket(), config=dict(CONFIGS[i % 3]),
                                median_ms=1.0 + i, tflops=None, trials=5, tuned_at=T0)
                    for i, p in enumerate(problems))
    return dataclasses.replace(make_document(), entries=entries)


def test_files_group_by_dtype_head_dim_causal_in_numeric_order() -> None:
    problems = [AttentionProblem(1, 32, 8, 16384, 16384, 128, True, "bf16"),
                AttentionProblem(1, 32, 8, 2048, 2048, 128, True, "bf16"),
                AttentionProblem(16, 32, 8, 512, 512, 128, True, "bf16"),
                AttentionProblem(1, 32, 8, 2048, 2048, 128, False, "bf16"),
                AttentionProblem(1, 32, 8, 2048, 2048, 64, True, "fp16")]
    doc = _doc_with(problems)
    files = vllm_files([doc])
    assert [f.name for f in files] == sorted(f.name for f in files)
    by_name = {f.name: f for f in files}
    main = by_name[vllm_config_file_name(H100_NAME, "attn_fwd", dtype="bf16", head_dim=128,
                                         causal=True)]
    assert list(main.configs) == ["B=1,Hq=32,Hkv=8,Nq=2048,Nk=2048",
                                  "B=1,Hq=32,Hkv=8,Nq=16384,Nk=16384",
                                  "B=16,Hq=32,Hkv=8,Nq=512,Nk=512"]
    assert main.configs["B=1,Hq=32,Hkv=8,Nq=2048,Nk=2048"] == doc.entries[1].config
    assert len(files) == 3 and sum(len(f.configs) for f in files) == 5
    assert all(f.device == H100_NAME and f.template == "attn_fwd" for f in files)
    # never the name flashtune's own loader looks for
    assert config_file_name(H100_NAME, "attn_fwd") not in by_name


def test_json_text_is_a_flat_mapping_of_configs() -> None:
    [file] = vllm_files([_doc_with([AttentionProblem(2, 8, 2, 77, 133, 64, False, "fp16")])])
    text = vllm_to_json(file)
    assert text.endswith("}\n") and '\n    "B=2,Hq=8,Hkv=2,Nq=77,Nk=133": {' in text
    data = json.loads(text)
    assert data == {"B=2,Hq=8,Hkv=2,Nq=77,Nk=133": CONFIGS[0]}
    assert all(isinstance(v, int) for cfg in data.values() for v in cfg.values())


def test_two_documents_for_one_file_are_refused() -> None:
    doc = _doc_with([AttentionProblem(1, 4, 4, 64, 64, 64, True, "bf16")])
    with pytest.raises(ValueError, match="two documents would both write"):
        vllm_files([doc, doc])


def test_entries_with_score_modifications_are_left_out() -> None:
    """vLLM's shape key has no window or softcap: such entries would overwrite the plain
    shape's config, so the vLLM export leaves them out."""
    plain = AttentionProblem(1, 8, 8, 512, 512, 64, True, "bf16")
    windowed = AttentionProblem(1, 8, 8, 512, 512, 64, True, "bf16", 127)
    base = make_document(n=1)
    entry = base.entries[0]
    doc = dataclasses.replace(base, entries=(
        dataclasses.replace(entry, problem=plain.key(), config=CONFIGS[0]),
        dataclasses.replace(entry, problem=windowed.key(), config=CONFIGS[1]),
    ))
    (file,) = vllm_files([doc])
    assert list(file.configs.values()) == [CONFIGS[0]]

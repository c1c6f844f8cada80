"""attn_fwd's space, predicate, default configs, registry and shared-memory model."""

from __future__ import annotations

import pytest

from flashtune.core.device import DeviceFingerprint
from flashtune.core.errors import ConfigError, UnknownTemplateError
from flashtune.core.problem import AttentionProblem
from flashtune.kernel_templates import get_template, template_names
from flashtune.kernel_templates.attn_fwd.space import shared_mem_bytes

SPEC = get_template("attn_fwd")
H100 = DeviceFingerprint("NVIDIA_H100_80GB_HBM3", "9.0", 132, 232448, 85 << 30)
SMALL_SMEM = DeviceFingerprint("tiny_gpu", "8.6", 10, 101376, 8 << 30)


def prob(d=128, n=4096, causal=False):
    return AttentionProblem(4, 16, 16, n, n, d, causal, "bf16")


def test_registry_lists_known_names_on_unknown():
    assert "attn_fwd" in template_names()
    with pytest.raises(UnknownTemplateError, match="known templates: .*attn_fwd"):
        get_template("attn_nope")
    assert len(SPEC.source_hash) == 16


def test_validate_rejects_unknown_missing_and_out_of_space():
    good = {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4, "num_stages": 3}
    # the Hopper knobs are optional and default to off
    assert SPEC.space.validate(good) == {**good, "USE_TMA": 0, "REVERSE_M": 0, "SPLIT_D": 0}
    assert SPEC.space.validate({**good, "USE_TMA": 1})["USE_TMA"] == 1
    with pytest.raises(ConfigError, match="USE_TMA.*allowed values: \\[0, 1\\]"):
        SPEC.space.validate({**good, "USE_TMA": 2})
    with pytest.raises(ConfigError, match="unknown keys \\['BLOCK_K'\\]"):
        SPEC.space.validate({**good, "BLOCK_K": 32})
    with pytest.raises(ConfigError, match="missing keys \\['num_stages'\\]"):
        SPEC.space.validate({k: v for k, v in good.items() if k != "num_stages"})
    with pytest.raises(ConfigError, match="BLOCK_M.*48.*allowed"):
        SPEC.space.validate({**good, "BLOCK_M": 48})
    with pytest.raises(ConfigError, match="num_warps"):
        SPEC.space.validate({**good, "num_warps": 4.0})
    with pytest.raises(ConfigError, match="mapping"):
        SPEC.space.validate([("BLOCK_M", 64)])


def test_predicate_reads_device_limits():
    cfg = {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 3}
    assert SPEC.space.check(cfg, prob(128), H100) is None  # 224 KiB fits 227 KiB
    assert "shared memory" in SPEC.space.check(cfg, prob(128), SMALL_SMEM)
    big = {"BLOCK_M": 256, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2}
    assert "spill" in SPEC.space.check(big, prob(256), H100)


def test_predicate_prunes_knobs_that_cannot_apply():
    cfg = {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2, "USE_TMA": 0,
           "REVERSE_M": 1}
    assert "causal" in SPEC.space.check(cfg, prob(64, causal=False), H100)
    assert SPEC.space.check(cfg, prob(64, causal=True), H100) is None
    tma = {**cfg, "REVERSE_M": 0, "USE_TMA": 1}
    assert SPEC.space.check(tma, prob(64), H100) is None
    assert "compute capability >= 9.0" in SPEC.space.check(tma, prob(64), SMALL_SMEM)


def test_pruning_matches_the_measured_out_of_resources_count():
    # ANCHORS.md: of BM {64,128,256} x BN {32,64,128} x w {4,8} x s {2..5}, 14 of 72 configs
    # ran out of resources at D=128 on the H100.
    grid = [{"BLOCK_M": m, "BLOCK_N": n, "num_warps": w, "num_stages": s}
            for m in (64, 128, 256) for n in (32, 64, 128) for w in (4, 8) for s in (2, 3, 4, 5)]
    oor = [c for c in grid if shared_mem_bytes(c, 128) > H100.shared_mem_per_block]
    assert len(oor) == 14


@pytest.mark.parametrize("d", [16, 32, 64, 96, 128, 192, 256])
@pytest.mark.parametrize("device", [H100, SMALL_SMEM], ids=["h100", "small"])
def test_default_config_is_valid_everywhere(d, device):
    p = prob(d)
    cfg = SPEC.default_config(p, device)
    assert SPEC.space.validate(cfg) == cfg
    assert SPEC.space.check(cfg, p, device) is None


def test_space_is_data():
    assert SPEC.space.size == len(list(SPEC.space))
    valid = SPEC.space.valid_configs(prob(128), H100)
    assert 0 < len(valid) < SPEC.space.size


_COMPILE_SCRIPT = r"""
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from flashtune.kernel_templates.attn_fwd.kernel import attn_fwd_kernel as kern
from flashtune.kernel_templates.head_tiles import d_tiles
names = kern.arg_names
aligned = {"Q", "K", "V", "Out", "Lse"} | {n for n in names if n.startswith("stride_")
                                           and n not in ("stride_lb", "stride_lh")}
attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if n in aligned}
result = []
for bm, bn, w, s, d, tma, split in json.loads(sys.argv[1]):
    bd, bd1 = d_tiles(d, split)
    const = dict(HEAD_DIM=d, BLOCK_D=bd, BLOCK_M=bm, BLOCK_N=bn, IS_CAUSAL=False,
                 STORE_LSE=True, UPCAST_DOT=False, NEG_SCALE=False, USE_TMA=bool(tma),
                 REVERSE_M=False, HAS_WINDOW=False, HAS_SOFTCAP=False, HAS_ALIBI=False,
                 VARLEN=False, HAS_DROPOUT=False, Alibi=None, CuSeqQ=None, CuSeqK=None,
                 Seed=None, BLOCK_D1=bd1)
    descs = {"desc_q": bm, "desc_k": bn, "desc_v": bn, "desc_o": bm}
    descs1 = {n + "1": r for n, r in descs.items()}
    if not tma:
        const.update({n: None for n in descs})
    if not (tma and bd1):
        const.update({n: None for n in descs1})
    sig = {n: ("constexpr" if n in const else "*fp16" if n in ("Q", "K", "V", "Out")
               else f"tensordesc<fp16[1,1,{descs[n]},{bd}]>" if n in descs
               else f"tensordesc<fp16[1,1,{descs1[n]},{bd1}]>" if n in descs1
               else "*fp32" if n == "Lse" else "fp32" if n in ("sm_scale", "SOFTCAP")
               else "i32")
           for n in names}
    src = ASTSource(fn=kern, signature=sig, attrs=attrs,
                    constexprs={(names.index(k),): v for k, v in const.items()})
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=w, num_stages=s))
    result.append(compiled.metadata.shared)
print(json.dumps(result))
"""


def test_shared_memory_model_matches_the_hopper_compiler():
    """Compile for sm_90 on the CPU (no GPU needed) and compare the reported shared memory.

    Runs in a subprocess because this process has the kernels wrapped by the interpreter.
    """
    import json
    import os
    import subprocess
    import sys

    cases = [(128, 64, 8, 3, 128, 0, 0), (64, 32, 4, 2, 64, 0, 0), (128, 128, 8, 3, 128, 0, 0),
             (64, 64, 4, 4, 96, 0, 0), (128, 64, 8, 3, 128, 1, 0), (64, 32, 4, 2, 64, 1, 0),
             (64, 64, 4, 4, 96, 1, 0),
             # the head dim as two tiles (SPLIT_D): 96 = 64 + 32, 80 = 64 + 16
             (128, 64, 8, 3, 96, 0, 1), (128, 128, 8, 3, 96, 1, 1), (128, 64, 8, 3, 80, 1, 1)]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _COMPILE_SCRIPT, json.dumps(cases)],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    reported = json.loads(proc.stdout.strip().splitlines()[-1])
    for (bm, bn, w, s, d, tma, split), shared in zip(cases, reported):
        est = shared_mem_bytes({"BLOCK_M": bm, "BLOCK_N": bn, "num_stages": s, "USE_TMA": tma,
                                "SPLIT_D": split}, d)
        if tma:  # an upper bound: barriers plus up to 1 KiB of swizzle alignment
            assert est - 1024 < shared <= est, (bm, bn, w, s, d, est, shared)
        else:
            assert est == shared, (bm, bn, w, s, d, est, shared)

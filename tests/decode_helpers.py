"""Shared helpers of the decode tests: random caches and the flash-attention tolerance rule."""

from __future__ import annotations

import math

import torch

from flashtune.kernel_templates.attn_decode.reference import attn_decode_reference


def make_cache(lens, hq, hkv, nq, d, dtype, device, *, page_size=None, capacity=None, seed=0):
    """``(q, k_cache, v_cache, cache_seqlens, block_table)`` for sequences of lengths ``lens``.

    ``page_size`` None: a contiguous cache of ``capacity`` (default max(lens)) slots;
    otherwise a paged one whose pages are a random permutation (plus two spare pages), with
    the unused table entries set to -1.
    """
    g = torch.Generator().manual_seed(seed)
    b = len(lens)
    seqlens = torch.tensor(lens, dtype=torch.int32)
    q = torch.randn(b, hq, nq, d, generator=g).to(dtype)
    if page_size is None:
        n = capacity or max(max(lens), 1)
        k = torch.randn(b, hkv, n, d, generator=g).to(dtype)
        v = torch.randn(b, hkv, n, d, generator=g).to(dtype)
        table = None
    else:
        max_pages = max(1, -(-(capacity or max(lens)) // page_size))
        used = [-(-n // page_size) for n in lens]
        num_pages = sum(used) + 2
        k = torch.randn(num_pages, hkv, page_size, d, generator=g).to(dtype)
        v = torch.randn(num_pages, hkv, page_size, d, generator=g).to(dtype)
        perm = torch.randperm(num_pages, generator=g)
        table = torch.full((b, max_pages), -1, dtype=torch.int32)
        at = 0
        for i, n in enumerate(used):
            table[i, :n] = perm[at:at + n].to(torch.int32)
            at += n
        table = table.to(device)
    return (q.to(device), k.to(device), v.to(device), seqlens.to(device), table)


def assert_decode_close(out, q, k, v, *, cache_seqlens=None, block_table=None, causal,
                        scale=None, lse=None, factor=2.0, **mods):
    """flash-attention's rule: max error vs fp64 <= factor x torch's low-precision error
    (plus a few ulps of the output dtype), a hard relative bound, and the LSE. ``mods``:
    the reference's ``window``, ``softcap``, ``alibi_slopes``."""
    kw = dict(cache_seqlens=cache_seqlens, block_table=block_table, causal=causal, scale=scale,
              **mods)
    ref, ref_lse = attn_decode_reference(q, k, v, dtype=torch.float64, **kw)
    low, _ = attn_decode_reference(q, k, v, dtype=q.dtype, **kw)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert not torch.isnan(out).any(), "NaN in output"
    err = (out.double() - ref).abs().max().item()
    pt_err = (low.double() - ref).abs().max().item()
    eps = torch.finfo(q.dtype).eps
    assert err <= factor * pt_err + 4 * eps * max(1.0, ref.abs().max().item()), (
        f"kernel max error {err:.3e} > {factor} x torch low-precision error {pt_err:.3e}")
    if ref.norm() > 0:
        rel = ((out.double() - ref).norm() / ref.norm()).item()
        assert rel < 2e-2, f"relative error {rel:.3e}"
    if lse is not None:
        assert lse.dtype == torch.float32 and lse.shape == q.shape[:3]
        inf_ref = torch.isinf(ref_lse)
        assert torch.equal(torch.isinf(lse), inf_ref), "LSE -inf pattern differs"
        assert (lse[inf_ref] < 0).all()
        finite = ~inf_ref
        if finite.any():
            lse_err = (lse.double()[finite] - ref_lse[finite]).abs().max().item()
            assert lse_err < 1e-3 * max(1.0, ref_lse[finite].abs().max().item()), lse_err
    return err


# compile attn_decode's split kernel for sm_90 on the CPU: the interpreter is lenient about
# types, this is not. Each case: constexprs over the defaults below, and "none": the
# parameters passed as None (pointers and scalars of options that are off)
_COMPILE_SCRIPT = r"""
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from flashtune.kernel_templates.attn_decode.kernel import attn_decode_split_kernel as kern
names = kern.arg_names
DEFAULTS = dict(HEAD_DIM=128, BLOCK_D=128, GROUP=4, BLOCK_M=16, BLOCK_N=64, NUM_SPLITS=4,
                IS_CAUSAL=True, HAS_SEQLENS=True, PAGED=False, PAGE_ALIGNED=False,
                STORE_LSE=True, UPCAST_DOT=False, HAS_WINDOW=False, HAS_SOFTCAP=False,
                HAS_ALIBI=False, HAS_NEW=False, ROT_DIM=0, ROT_INTERLEAVED=False,
                ROT_Q_PER_POS=False, HAS_BATCH_IDX=False, HAS_LEFTPAD=False, NEW_ROWS=False,
                BLOCK_D1=0)
PTR = {"Q": "*fp16", "K": "*fp16", "V": "*fp16", "Out": "*fp16", "Lse": "*fp32",
       "OPart": "*fp32", "LsePart": "*fp32", "Seqlens": "*i32", "BlockTable": "*i32",
       "Alibi": "*fp32", "KNew": "*fp16", "VNew": "*fp16", "Cos": "*fp16", "Sin": "*fp16",
       "BatchIdx": "*i32", "LeftPad": "*i32"}
for case in json.loads(sys.argv[1]):
    const = {**DEFAULTS, **case.get("const", {})}
    const.update({n: None for n in case.get("none", [])})
    sig = {n: "constexpr" if n in const else PTR.get(n)
           or ("fp32" if n in ("sm_scale", "SOFTCAP") else "i32") for n in names}
    src = ASTSource(fn=kern, signature=sig,
                    constexprs={(names.index(k),): v for k, v in const.items()})
    triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4,
                                                                        num_stages=2))
print("ok")
"""

# the cache options' parameters, None when off
NO_CACHE_OPTIONS = ["KNew", "VNew", "Cos", "Sin", "BatchIdx", "LeftPad", "stride_knb",
                    "stride_knh", "stride_knn", "stride_vnb", "stride_vnh", "stride_vnn",
                    "N_NEW", "SEQLEN_RO", "CACHE_BATCH", "BATCH_HEADS"]


def compile_split_kernel_sm90(cases):
    """Compile the split kernel for the H100 for each case (see _COMPILE_SCRIPT) in a
    subprocess without the interpreter; asserts it succeeds."""
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _COMPILE_SCRIPT, json.dumps(cases)],
                          capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


# -- the cache options: new keys appended in place, rotary, cache_batch_idx, cache_leftpad --


def append_case(lens, hq, hkv, nq, n_new, d, dtype, device, *, page_size=None, capacity=64,
                rotary_dim=0, cos_dtype=None, batch_cache=None, leftpad=None, seed=0):
    """The arguments of an ``attention_with_kvcache`` call with FlashAttention-2's cache
    options, as a dict: ``q, k_cache, v_cache, cache_seqlens`` and, where asked, ``k, v``
    (``n_new`` > 0), ``rotary_cos, rotary_sin`` (``rotary_dim`` > 0; ``cos_dtype`` default
    ``dtype``), ``cache_batch_idx`` (a contiguous cache of ``batch_cache`` rows, a random
    choice of distinct rows), ``cache_leftpad`` (a list), ``block_table`` (``page_size``:
    every sequence owns ``capacity / page_size`` shuffled pages, two spare pages).
    Lengths are what the cache holds before the call (the new keys must fit)."""
    g = torch.Generator().manual_seed(seed)
    b = len(lens)

    def randn(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    args = {"q": randn(b, hq, nq, d),
            "cache_seqlens": torch.tensor(lens, dtype=torch.int32)}
    if page_size is None:
        rows = batch_cache or b
        args["k_cache"], args["v_cache"] = randn(rows, hkv, capacity, d), randn(rows, hkv,
                                                                                capacity, d)
        if batch_cache:
            args["cache_batch_idx"] = torch.randperm(batch_cache, generator=g)[:b].to(
                torch.int32)
    else:
        max_pages = -(-capacity // page_size)
        num_pages = b * max_pages + 2
        args["k_cache"] = randn(num_pages, hkv, page_size, d)
        args["v_cache"] = randn(num_pages, hkv, page_size, d)
        perm = torch.randperm(num_pages, generator=g)[:b * max_pages]
        args["block_table"] = perm.view(b, max_pages).to(torch.int32)
    if n_new:
        args["k"], args["v"] = randn(b, hkv, n_new, d), randn(b, hkv, n_new, d)
    if rotary_dim:
        angle = torch.rand(capacity, rotary_dim // 2, generator=g) * 2 * math.pi
        cd = cos_dtype or dtype
        args["rotary_cos"], args["rotary_sin"] = angle.cos().to(cd), angle.sin().to(cd)
    if leftpad is not None:
        args["cache_leftpad"] = torch.tensor(leftpad, dtype=torch.int32)
    return {n: t.to(device) for n, t in args.items()}


def assert_kvcache_close(out, args, before, *, lse=None, factor=2.0, **options):
    """``out`` (and ``lse``) of a call on ``args`` and the caches it left, against
    :func:`attn_decode_kvcache_reference` run on ``before`` (copies of the caches before the
    call): the flash-attention rule for the output (as :func:`assert_decode_close`), the new
    keys as the reference rotated them (fp32 math rounded to the dtype: a few ulps apart at
    most), the new values exact, every other slot of the caches untouched. ``options``:
    the call's other keywords (causal, window, rotary_interleaved, ...)."""
    from flashtune.kernel_templates.attn_decode.reference import attn_decode_kvcache_reference

    q = args["q"]
    kw = {n: t for n, t in args.items() if n not in ("q", "k_cache", "v_cache",
                                                     "cache_seqlens")}
    kw.update(options)
    ref, ref_lse, k_ref, v_ref = attn_decode_kvcache_reference(
        q, before["k_cache"], before["v_cache"], args["cache_seqlens"], dtype=torch.float64,
        **kw)
    low, _, _, _ = attn_decode_kvcache_reference(
        q, before["k_cache"], before["v_cache"], args["cache_seqlens"], dtype=q.dtype, **kw)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert not torch.isnan(out).any(), "NaN in output"
    err = (out.double() - ref).abs().max().item()
    pt_err = (low.double() - ref).abs().max().item()
    eps = torch.finfo(q.dtype).eps
    assert err <= factor * pt_err + 4 * eps * max(1.0, ref.abs().max().item()), (
        f"kernel max error {err:.3e} > {factor} x torch low-precision error {pt_err:.3e}")
    if ref.norm() > 0:
        rel = ((out.double() - ref).norm() / ref.norm()).item()
        assert rel < 2e-2, f"relative error {rel:.3e}"
    if lse is not None:
        inf_ref = torch.isinf(ref_lse)
        assert torch.equal(torch.isinf(lse), inf_ref), "LSE -inf pattern differs"
        finite = ~inf_ref
        if finite.any():
            lse_err = (lse.double()[finite] - ref_lse[finite]).abs().max().item()
            assert lse_err < 1e-3 * max(1.0, ref_lse[finite].abs().max().item()), lse_err
    tol = 1e-3 if q.dtype == torch.float16 else 8e-3
    torch.testing.assert_close(args["k_cache"].float(), k_ref.float(), atol=tol, rtol=tol,
                               msg="k_cache after the call")
    assert torch.equal(args["v_cache"], v_ref), "v_cache after the call"
    return err

"""Shared helpers of the decode tests: random caches and the flash-attention tolerance rule."""

from __future__ import annotations

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

"""attn_bwd's tuning case: what the tuner's runner launches,
checks and counts for one problem (``TemplateSpec.make_case``).

Not part of the template's source hash: it decides how configs are checked, not which code
is generated.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from flashtune.core.case import (
    Case,
    mods_options,
    packed_gradients,
    packed_inputs,
    random_inputs,
    reference_options,
    relative_error,
)
from flashtune.core.device import DeviceFingerprint
from flashtune.core.problem import AttentionProblem

# above this many q elements the reference covers batch 0 and kv head 0 with its q heads
FULL_REFERENCE_MAX_ELEMS = 1 << 20


def make_case(problem: AttentionProblem, device: DeviceFingerprint, *, torch_device: str,
              generator: Any, launcher: Callable[..., Any], check_slice: bool = True) -> Case:
    """Random q, k, v and dout; out and LSE from attn_fwd with its default config; the
    gradients of ``launcher(q, k, v, out, lse, dout, config, causal=)`` checked against
    fp32 autograd (the worst relative error of dq, dk, dv); backward FLOPs (2.5x forward).
    A dropout problem's forward and every launch get the case's one seed, the reference
    its materialised mask.

    For big problems the reference covers batch 0 and the first kv head with every q head
    of its group (dK/dV sum over the group, so no smaller slice checks them).
    """
    import torch

    from flashtune.kernel_templates.attn_bwd.reference import attn_bwd_reference
    from flashtune.kernel_templates.attn_fwd.launcher import attn_fwd
    from flashtune.kernel_templates.attn_fwd.space import default_config

    p = problem
    if p.packed:
        return _packed_case(p, device, torch_device=torch_device, generator=generator,
                            launcher=launcher, check_slice=check_slice)
    t = random_inputs(p, torch_device, generator, ("q", "k", "v", "do"))
    q, k, v, do = t["q"], t["k"], t["v"], t["do"]
    options = mods_options(p, torch_device, generator)
    out, lse = attn_fwd(q, k, v, default_config(p, device), causal=p.causal, return_lse=True,
                        **options)
    if check_slice and q.numel() > FULL_REFERENCE_MAX_ELEMS:
        group = p.heads_q // p.heads_kv
        sq: tuple[slice, slice] = (slice(0, 1), slice(0, group))
        skv: tuple[slice, slice] = (slice(0, 1), slice(0, 1))
    else:
        sq = skv = (slice(None), slice(None))
    if options:  # the modified scores' gradients: autograd through the fp32 reference
        from flashtune.kernel_templates.attn_fwd.reference import attn_fwd_reference
        from flashtune.kernel_templates.dropout import dropout_mask

        # dropout's seed as the mask it draws, of the sequences and heads checked
        sliced = sq[1].stop is not None
        ref_options = reference_options(options, p, dropout_mask,
                                        batches=1 if sliced else None,
                                        heads=sq[1].stop if sliced else None)
        if "alibi_slopes" in ref_options:
            ref_options["alibi_slopes"] = ref_options["alibi_slopes"][sq[1]]
        leaves = [x[s].float().requires_grad_(True) for x, s in ((q, sq), (k, skv), (v, skv))]
        with torch.enable_grad():
            ref_out, _ = attn_fwd_reference(*leaves, causal=p.causal, dtype=torch.float32,
                                            **ref_options)
            ref = torch.autograd.grad(ref_out, leaves, do[sq].float())
    else:
        ref = attn_bwd_reference(q[sq], k[skv], v[skv], do[sq], causal=p.causal,
                                 dtype=torch.float32)

    def launch(config: Any) -> Any:
        return launcher(q, k, v, out, lse, do, config, causal=p.causal, **options)

    def error(grads: Any) -> float:
        errs = [relative_error(g[s], r) for g, s, r in zip(grads, (sq, skv, skv), ref)]
        return float("nan") if any(e != e for e in errs) else max(errs)

    return Case(launch=launch, error=error, flops=p.flops(backward=True),
                inputs={"q": q, "k": k, "v": v, "do": do, "out": out, "lse": lse})


def _packed_case(problem: AttentionProblem, device: DeviceFingerprint, *, torch_device: str,
                 generator: Any, launcher: Callable[..., Any], check_slice: bool) -> Case:
    """:func:`make_case` for a packed batch (its ``cu_seqlens`` passed to both kernels)."""
    from flashtune.kernel_templates.attn_fwd.launcher import attn_fwd
    from flashtune.kernel_templates.attn_fwd.reference import attn_fwd_reference
    from flashtune.kernel_templates.attn_fwd.space import default_config
    from flashtune.kernel_templates.dropout import dropout_mask

    p = problem
    t, packing = packed_inputs(p, torch_device, generator, ("q", "k", "v", "do"))
    q, k, v, do = t["q"], t["k"], t["v"], t["do"]
    mods = mods_options(p, torch_device, generator)
    options = {**mods, **packing}
    out, lse = attn_fwd(q, k, v, default_config(p, device), causal=p.causal, return_lse=True,
                        **options)
    heads, (_, *ref) = packed_gradients(attn_fwd_reference, p, q, k, v, do, mods,
                                        check_slice, dropout_mask)
    kv_heads = (slice(None), slice(0, ref[1].shape[1]))

    def launch(config: Any) -> Any:
        return launcher(q, k, v, out, lse, do, config, causal=p.causal, **options)

    def error(grads: Any) -> float:
        errs = [relative_error(g[s], r) for g, s, r in zip(grads, (heads, kv_heads, kv_heads),
                                                            ref)]
        return float("nan") if any(e != e for e in errs) else max(errs)

    return Case(launch=launch, error=error, flops=p.flops(backward=True),
                inputs={"q": q, "k": k, "v": v, "do": do, "out": out, "lse": lse})

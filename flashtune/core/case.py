"""A tuning case: one problem's inputs for one implementation, the numerics check of a launch
against the fp32 reference, and the work it does.

Every candidate the tuner times is checked first (FlashAttention's rule: relative Frobenius
error against an fp32 reference under :data:`TOLERANCE`, and no NaN). An implementation
builds its case with its ``make_case``; the runners in :mod:`flashtune.autotune.runners`
launch, check and time it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from flashtune.core.device import DeviceFingerprint
from flashtune.core.problem import AttentionProblem

__all__ = ["FULL_REFERENCE_MAX_ELEMS", "TOLERANCE", "Case", "MaskFn", "forward_case", "least_bytes",
           "mods_kwargs", "mods_options", "packed_gradients", "packed_inputs",
           "packed_reference", "random_inputs", "reference_options", "relative_error",
           "shared_inputs"]

# relative Frobenius error allowed against the fp32 reference
TOLERANCE = {"bf16": 2e-2, "fp16": 5e-3}
# above this many q elements the reference is computed on a slice (batch 0, 2 q heads)
FULL_REFERENCE_MAX_ELEMS = 1 << 20
# dropout seeds of a tuning case are drawn in [0, this) (as kernel_templates.dropout's)
SEED_HIGH = 1 << 62

# materialises attention dropout's keep mask: ``(seed, batch, heads_q, seqlen_q, seqlen_k,
# dropout_p, batches=, heads=) -> bool (batches, heads, seqlen_q, seqlen_k)`` of the first
# ``batches`` sequences and ``heads`` query heads (kernel_templates.dropout.dropout_mask)
MaskFn = Callable[..., Any]


@dataclass(frozen=True)
class Case:
    """One problem's inputs for one template, as :class:`LocalRunner` uses them.

    ``launch(config)`` runs the template once and returns its outputs; ``error(outputs)``
    is their relative Frobenius error against the fp32 reference (the worst of them when
    there are several; NaN when any output holds a NaN); ``flops`` is the work of one
    launch (ANCHORS.md's count) and ``min_bytes`` the memory traffic it cannot avoid (both
    set the physical floor below which a timing is rejected). ``inputs`` names the tensors
    for scripts that reuse them.
    Each template builds its own with ``TemplateSpec.make_case`` (the forward-shaped ones
    with :func:`forward_case`).
    """

    launch: Callable[[Mapping[str, int]], Any]
    error: Callable[[Any], float]
    flops: float
    inputs: Mapping[str, Any] = field(default_factory=dict)
    min_bytes: float = 0.0  # bytes one launch must move at least (for the physical floor)


def relative_error(got: Any, ref: Any) -> float:
    """``||got - ref|| / ||ref||`` in fp32 (NaN when ``got`` holds a NaN)."""
    import torch

    got = got.float()
    if torch.isnan(got).any():
        return float("nan")
    return float(torch.linalg.vector_norm(got - ref)) / (float(torch.linalg.vector_norm(ref))
                                                         or 1.0)


# the draws :func:`shared_inputs` hands out again while it is active (None: it is not)
_SHARED: dict[tuple[Any, ...], tuple[Any, Any]] | None = None


@contextlib.contextmanager
def shared_inputs() -> Iterator[None]:
    """While active, :func:`random_inputs` and :func:`packed_inputs` give every caller that
    asks for the same draw (problem, device, names, generator state) the tensors of the
    first, and leave its generator where the draw would have: the side-by-side timing's
    runners, which all draw the same seeded inputs, then hold one copy of them, not one
    each (a decode shape's 26 GB cache, once per leader, did not fit an H200). The tensors
    are shared, so a case must not write into them (the training cases only set
    ``requires_grad``, the same for each). Nested uses share the outermost's draws."""
    global _SHARED
    outer = _SHARED
    if outer is None:
        _SHARED = {}
    try:
        yield
    finally:
        if outer is None:
            _SHARED = None


def _draw(what: str, problem: AttentionProblem, torch_device: str, generator: Any,
          names: Sequence[str], make: Callable[[], Any]) -> Any:
    """``make()``, or while :func:`shared_inputs` is active the same draw's earlier result
    (its generator moved on as ``make`` would have moved it)."""
    if _SHARED is None:
        return make()
    key = (what, problem, torch_device, tuple(names),
           generator.get_state().numpy().tobytes())
    if key not in _SHARED:
        _SHARED[key] = (make(), generator.get_state())
    drawn, after = _SHARED[key]
    generator.set_state(after)
    return drawn


def random_inputs(problem: AttentionProblem, torch_device: str, generator: Any,
                  names: Sequence[str] = ("q", "k", "v")) -> dict[str, Any]:
    """Seeded ``randn`` tensors ``(batch, heads, seqlen, head_dim)`` in the problem's dtype,
    drawn in the order of ``names`` (``q``/``do``: q's shape; others: k's)."""
    import torch

    p = problem
    dtype = torch.float16 if p.dtype == "fp16" else torch.bfloat16

    def make() -> dict[str, Any]:
        out = {}
        for name in names:
            h, n = (p.heads_q, p.seqlen_q) if name in ("q", "do") else (p.heads_kv, p.seqlen_k)
            out[name] = torch.randn((p.batch, h, n, p.head_dim), generator=generator,
                                    device=torch_device, dtype=torch.float32).to(dtype)
        return out

    return dict(_draw("dense", p, torch_device, generator, names, make))


def packed_inputs(problem: AttentionProblem, torch_device: str, generator: Any,
                  names: Sequence[str] = ("q", "k", "v")) -> tuple[dict[str, Any],
                                                               dict[str, Any]]:
    """A packed problem's batch (:meth:`AttentionProblem.packed_lengths`): seeded ``randn``
    tensors ``(tokens, heads, head_dim)`` drawn in the order of ``names`` (``q``/``do``:
    the queries' tokens; others: the keys'), and the launcher keywords that describe it
    (``cu_seqlens_q/k`` int32, ``max_seqlen_q/k``)."""
    import itertools

    import torch

    p = problem
    dtype = torch.float16 if p.dtype == "fp16" else torch.bfloat16

    def make() -> dict[str, Any]:
        out = {}
        for name in names:
            h, n = (p.heads_q, p.tokens_q) if name in ("q", "do") else (p.heads_kv, p.tokens_k)
            out[name] = torch.randn((n, h, p.head_dim), generator=generator,
                                    device=torch_device, dtype=torch.float32).to(dtype)
        return out

    tensors = dict(_draw("packed", p, torch_device, generator, names, make))
    lens_q, lens_k = p.packed_lengths()
    options: dict[str, Any] = {
        f"cu_seqlens_{side}": torch.tensor([0, *itertools.accumulate(lens)],
                                           dtype=torch.int32, device=torch_device)
        for side, lens in (("q", lens_q), ("k", lens_k))}
    options.update(max_seqlen_q=p.seqlen_q, max_seqlen_k=p.seqlen_k)
    return tensors, options


def packed_reference(reference: Callable[..., Any], problem: AttentionProblem, q: Any,
                     k: Any, v: Any, mods: Mapping[str, Any]) -> Any:
    """``reference`` (:func:`forward_case`'s) over a packed batch, one sequence at a time:
    the float32 output ``(tokens, heads, head_dim)`` of packed ``q, k, v`` (any heads
    slice whose query heads are the key heads' groups; ALiBi slopes in ``mods`` cut to
    q's heads), differentiable in them."""
    import torch

    outs = []
    start_q = start_k = 0
    for b, (nq, nk) in enumerate(zip(*problem.packed_lengths(), strict=True)):
        qs, ks, vs = (x[a:a + n].transpose(0, 1)[None]
                      for x, a, n in ((q, start_q, nq), (k, start_k, nk), (v, start_k, nk)))
        if nq and nk:
            options = _sliced(mods, q.shape[1])
            if "dropout_mask" in options:  # this sequence's (its own lengths)
                options["dropout_mask"] = options["dropout_mask"][b:b + 1, :, :nq, :nk]
            outs.append(reference(qs, ks, vs, causal=problem.causal, dtype=torch.float32,
                                  **options)[0][0].transpose(0, 1))
        elif nq:  # no keys: FlashAttention's rows of zeros
            outs.append(torch.zeros((nq, q.shape[1], q.shape[2]), device=q.device))
        start_q, start_k = start_q + nq, start_k + nk
    return torch.cat(outs).float()


def packed_gradients(reference: Callable[..., Any], problem: AttentionProblem, q: Any,
                     k: Any, v: Any, do: Any, mods: Mapping[str, Any],
                     check_slice: bool = True, dropout_mask: MaskFn | None = None
                     ) -> tuple[tuple[slice, slice], Any]:
    """The float32 ``(out, dq, dk, dv)`` of a packed batch by autograd through
    :func:`packed_reference` with output gradient ``do``, and the heads slice they cover:
    every head, or for a big batch (``check_slice``) the first key head and its group's
    query heads (dK/dV sum over the group, so no smaller slice checks them). ``mods``: the
    launcher's keywords (:func:`mods_options`; dropout's seed becomes the mask
    ``dropout_mask`` draws, :func:`reference_options`)."""
    import torch

    p = problem
    hq, hkv = p.heads_q, p.heads_kv
    if check_slice and max(q.numel(), k.numel()) > FULL_REFERENCE_MAX_ELEMS:
        hq, hkv = p.heads_q // p.heads_kv, 1
    leaves = [x.detach()[:, :h].float().requires_grad_(True)
              for x, h in ((q, hq), (k, hkv), (v, hkv))]
    ref_mods = reference_options(mods, p, dropout_mask, heads=hq)
    with torch.enable_grad():
        out = packed_reference(reference, p, leaves[0], leaves[1], leaves[2], ref_mods)
        grads = torch.autograd.grad(out, leaves, do[:, :hq].float())
    return (slice(None), slice(0, hq)), (out.detach(), *grads)


def mods_options(problem: AttentionProblem, torch_device: str,
                 generator: Any) -> dict[str, Any]:
    """The launcher keywords of ``problem``'s score modifications and dropout (empty for a
    plain problem, so implementations without them are called as before), with seeded
    ALiBi slopes ``(heads_q,)`` in [0, 1) (the geometric slopes of the ALiBi paper lie
    there) and one dropout seed for the case (so every launch, and the reference's mask,
    drop the same scores)."""
    import torch

    slopes = seed = None
    if problem.alibi:
        slopes = torch.rand((problem.heads_q,), generator=generator, device=torch_device,
                            dtype=torch.float32)
    if problem.dropout:
        seed = torch.randint(SEED_HIGH, (1,), generator=generator, device=torch_device,
                             dtype=torch.int64)
    return mods_kwargs(problem, slopes, seed)


def mods_kwargs(problem: AttentionProblem, alibi_slopes: Any = None,
                seed: Any = None) -> dict[str, Any]:
    """``problem``'s score modifications and dropout as launcher keywords: ``window`` (the
    right bound 0 when causal), ``softcap``, ``alibi_slopes`` and ``dropout_p`` with its
    ``seed`` (given: tensors, or shape-only stand-ins to compile with) where the problem
    has them; empty for a plain problem."""
    p = problem
    options: dict[str, Any] = {}
    if p.window_left != -1 or p.window_right != -1:
        options["window"] = (p.window_left, 0 if p.causal else p.window_right)
    if p.softcap:
        options["softcap"] = p.softcap
    if p.alibi:
        options["alibi_slopes"] = alibi_slopes
    if p.dropout:
        options["dropout_p"] = p.dropout
        options["seed"] = seed
    return options


def reference_options(options: Mapping[str, Any], problem: AttentionProblem,
                      dropout_mask: MaskFn | None, *, batches: int | None = None,
                      heads: int | None = None) -> dict[str, Any]:
    """The reference's keywords for launcher keywords ``options``: dropout's ``seed``
    replaced by the keep mask it draws (``dropout_mask`` materialises it), of the first
    ``batches`` sequences (all) and ``heads`` query heads (all) at the longest lengths."""
    out = dict(options)
    seed = out.pop("seed", None)
    if out.get("dropout_p"):
        if dropout_mask is None:
            raise ValueError("a dropout problem's reference needs the kernels' mask "
                             "(kernel_templates.dropout.dropout_mask)")
        p = problem
        out["dropout_mask"] = dropout_mask(seed, p.batch, p.heads_q, p.seqlen_q, p.seqlen_k,
                                           p.dropout, batches=batches, heads=heads)
    return out


def _sliced(options: Mapping[str, Any], heads: int) -> dict[str, Any]:
    """``options`` for the first ``heads`` query heads (ALiBi slopes and the dropout mask
    are per head)."""
    out = dict(options)
    if "alibi_slopes" in out:
        out["alibi_slopes"] = out["alibi_slopes"][:heads]
    if "dropout_mask" in out:
        out["dropout_mask"] = out["dropout_mask"][:, :heads]
    return out


def least_bytes(problem: AttentionProblem, q: Any, k: Any, v: Any) -> float:
    """The bytes a forward launch must move: q read and the output written whole, and of k
    and v the keys some query can see (:meth:`AttentionProblem.keys_read`)."""
    def size(t: Any) -> int:
        return t.numel() * t.element_size()

    return 2 * size(q) + (size(k) + size(v)) * problem.keys_read()


def forward_case(reference: Callable[..., Any], problem: AttentionProblem,
                 device: DeviceFingerprint, *, torch_device: str, generator: Any,
                 launcher: Callable[..., Any], check_slice: bool = True,
                 dropout_mask: MaskFn | None = None) -> Case:
    """``launcher(q, k, v, config, causal=[, score modifications, dropout])`` on random q,
    k, v against ``reference``'s output (``reference(q, k, v, causal=, dtype=[, window=,
    softcap=, alibi_slopes=, dropout_p=, dropout_mask=]) -> (out, lse)``; the
    modifications only for a problem that has them, :func:`mods_options`; dropout's mask
    from ``dropout_mask``, for the seed every launch gets). For big problems (q or
    k above ``FULL_REFERENCE_MAX_ELEMS`` elements) only batch
    0 and the first two q heads (and their kv heads) are compared, to bound memory."""
    import torch

    p = problem
    if p.packed:
        return _packed_forward_case(reference, p, torch_device=torch_device,
                                    generator=generator, launcher=launcher,
                                    check_slice=check_slice, dropout_mask=dropout_mask)
    t = random_inputs(p, torch_device, generator)
    q, k, v = t["q"], t["k"], t["v"]
    options = mods_options(p, torch_device, generator)
    if check_slice and max(q.numel(), k.numel()) > FULL_REFERENCE_MAX_ELEMS:
        hq = min(2, p.heads_q)
        hkv = (hq - 1) // (p.heads_q // p.heads_kv) + 1
        sl: tuple[slice, slice] = (slice(0, 1), slice(0, hq))
        ref_options = reference_options(options, p, dropout_mask, batches=1, heads=hq)
        ref, _ = reference(q[:1, :hq], k[:1, :hkv], v[:1, :hkv], causal=p.causal,
                           dtype=torch.float32, **_sliced(ref_options, hq))
    else:
        sl = (slice(None), slice(None))
        ref, _ = reference(q, k, v, causal=p.causal, dtype=torch.float32,
                           **reference_options(options, p, dropout_mask))
    io = least_bytes(p, q, k, v)
    return Case(launch=lambda config: launcher(q, k, v, config, causal=p.causal, **options),
                error=lambda out: relative_error(out[sl], ref), flops=p.flops(),
                inputs={"q": q, "k": k, "v": v, "ref": ref, "ref_slice": sl}, min_bytes=io)




def _packed_forward_case(reference: Callable[..., Any], problem: AttentionProblem, *,
                         torch_device: str, generator: Any, launcher: Callable[..., Any],
                         check_slice: bool, dropout_mask: MaskFn | None) -> Case:
    """:func:`forward_case` for a packed problem: the launcher called with the batch's
    ``cu_seqlens``; big batches checked on their first two query heads (and their key
    heads)."""
    p = problem
    t, packing = packed_inputs(p, torch_device, generator)
    q, k, v = t["q"], t["k"], t["v"]
    mods = mods_options(p, torch_device, generator)
    hq = p.heads_q
    if check_slice and max(q.numel(), k.numel()) > FULL_REFERENCE_MAX_ELEMS:
        hq = min(2, p.heads_q)
    hkv = (hq - 1) // (p.heads_q // p.heads_kv) + 1
    ref = packed_reference(reference, p, q[:, :hq], k[:, :hkv], v[:, :hkv],
                           reference_options(mods, p, dropout_mask, heads=hq))
    io = least_bytes(p, q, k, v)
    options = {**mods, **packing}
    return Case(launch=lambda config: launcher(q, k, v, config, causal=p.causal, **options),
                error=lambda out: relative_error(out[:, :hq], ref), flops=p.flops(),
                inputs={"q": q, "k": k, "v": v, "ref": ref, "ref_slice": (slice(None),
                                                                          slice(0, hq))},
                min_bytes=io)

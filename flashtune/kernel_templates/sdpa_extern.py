"""torch SDPA's backends as extern implementations: no knobs, one config (``{}``).

Inductor times its extern kernel choices beside its Triton templates; flashtune does the
same with the backends behind :func:`torch.nn.functional.scaled_dot_product_attention`:
``sdpa_cudnn``, ``sdpa_flash``, ``sdpa_efficient`` and ``sdpa_math``, one template folder
each, all built here by :func:`extern_spec`. Each is a :class:`TemplateSpec` of kind
``"extern"`` for the user ops ``fwd`` and ``decode`` with an empty search space (size 1, its
only config ``{}``), so the tuner measures it beside flashtune's kernels and the router can
run it like any other implementation.

The launchers call the backend's aten op directly (``torch.ops.aten.
_scaled_dot_product_{cudnn,flash,efficient}_attention``, ``_scaled_dot_product_attention_math``),
not ``F.scaled_dot_product_attention``: no backend selection, no padding or copies, the least
host time per call. They check only what they must to honour flashtune's conventions
(``config == {}``, equal heads, causal alignment), so the tuner and the router pay for one
comparison each; the declared :class:`~flashtune.core.spec.Limits` are where the tuner and
the router learn what a backend serves.

Conventions, as flashtune's attention has them:

* causal is **bottom-right** aligned in flashtune, **top-left** in SDPA's ``is_causal``; they
  agree when ``seqlen_q == seqlen_k``, and a single query row (``seqlen_q == 1``, decoding)
  sees every key, so it runs unmasked. Other causal shapes are refused
  (``Limits.causal_unaligned=False``; the launchers raise :class:`InputError` too).
* the LSE is float32 ``(batch, heads, seqlen_q)`` in natural log (the efficient backend's
  padding of its last dim to a multiple of 32 is sliced off, cuDNN's trailing unit dim
  dropped: views, not copies).
* ``scale`` None means ``1/sqrt(head_dim)``.
* the output has q's shape; its strides are whatever the backend chose (flash returns a
  ``(batch, seqlen, heads, head_dim)`` buffer seen as ``(batch, heads, seqlen, head_dim)``;
  cuDNN follows q's layout). Nothing is copied to make it contiguous.

Autograd: the aten ops are differentiable and nothing here detaches; cuDNN and efficient
save the LSE their backward needs whenever grad mode is on and an input requires grad (as
``F.scaled_dot_product_attention`` does), so the router may later send calls that need a
gradient to an extern.

Source hash: an extern has no source of flashtune's to hash; what decides its kernel is
torch (and for cuDNN, cuDNN). :func:`extern_hash` hashes the backend name, torch's version
string and, for ``sdpa_cudnn``, the cuDNN version, so timings recorded under another torch
(or cuDNN) are stale, as a Triton template's are after its code changes.

GQA: ``sdpa_cudnn`` and ``sdpa_flash`` take ``heads_q`` a multiple of ``heads_kv`` as they
are (on an H100 with torch 2.11 both matched the fp32 reference, no K/V copy:
``benchmarks/probe_sdpa_gqa.py``, ``benchmarks/results/probe_sdpa_gqa_h100.json``; the GPU
tests cover it); the efficient op refuses unequal heads ("Expected query.size(2) ==
key.size(2)"), so it declares ``gqa=False``; ``sdpa_math`` takes ``enable_gqa`` (torch >= 2.5)
and repeats K/V heads.

Head dims (flashtune serves 1..256; ``Limits.head_dims`` refuses the rest, so the router
sends those calls to flashtune's own kernels): cuDNN and the efficient kernel take multiples
of 8 only (torch's dispatcher checks ``head_dim % 8`` for both and pads for neither;
cuDNN's limit is 256 on sm_90/sm_100, 128 elsewhere, see below). The flash op takes
multiples of 8 up to 256; ``F.scaled_dot_product_attention`` serves the other head dims up
to 256 with it by zero-padding q, k and v to the next multiple of 8 (copies) and slicing
the output, and :func:`sdpa_flash` does the same, so ``sdpa_flash`` stands for what torch
runs for, e.g., D59 and D111.

What torch's own dispatcher checks and these limits do not say (a call outside it fails in
the op, and the tuner records that trial as a failure): cuDNN serves head dims above 128
only on sm_90 with cuDNN >= 9.10, and no key length of 1; flash's backward refuses head dims
above 192 on sm_86/89/120; the efficient backend takes bf16 only from sm_80. On sm_90 torch
picks cuDNN by default (newer cuDNN only), elsewhere flash.
"""

from __future__ import annotations

import functools
import hashlib
import math
from collections.abc import Callable, Mapping
from typing import Any

import torch

from flashtune.core.case import forward_case
from flashtune.core.device import DeviceFingerprint
from flashtune.core.errors import ConfigError, InputError
from flashtune.core.problem import MAX_HEAD_DIM, AttentionProblem
from flashtune.core.space import Config, SearchSpace
from flashtune.core.spec import Limits, TemplateSpec
from flashtune.kernel_templates.attn_fwd.reference import attn_fwd_reference

__all__ = ["BACKENDS", "EMPTY_SPACE", "any_layout", "bound_inference", "extern_hash",
           "extern_spec", "no_config", "sdpa_cudnn", "sdpa_efficient", "sdpa_flash",
           "sdpa_is_causal", "sdpa_math"]

BACKENDS = ("cudnn", "flash", "efficient", "math")
# no knobs: one config, {}
EMPTY_SPACE = SearchSpace(params={}, predicate=lambda c, p, d: None)

_aten = torch.ops.aten
_CUDNN = _aten._scaled_dot_product_cudnn_attention.default
_FLASH = _aten._scaled_dot_product_flash_attention.default
_EFFICIENT = _aten._scaled_dot_product_efficient_attention.default
_MATH = _aten._scaled_dot_product_attention_math.default


# the same ops as torch.* functions: a C++ binding each, a few microseconds less per call than
# an OpOverload's Python __call__ (what the runtime's memoised launch plans call)
_CUDNN_FN = getattr(torch, "_scaled_dot_product_cudnn_attention", _CUDNN)
_FLASH_FN = getattr(torch, "_scaled_dot_product_flash_attention", _FLASH)
_EFFICIENT_FN = getattr(torch, "_scaled_dot_product_efficient_attention", _EFFICIENT)


# torch.nn.attention.SDPBackend's values (what torch._fused_sdp_choice returns)
_PICKS = {"sdpa_flash": 1, "sdpa_efficient": 2, "sdpa_cudnn": 3}


def _has_arg(op: Any, name: str) -> bool:
    return any(a.name == name for a in op._schema.arguments)


# torch 2.5 gave the math op enable_gqa and the cuDNN op its (attn_bias, compute_log_sumexp)
_MATH_GQA = _has_arg(_MATH, "enable_gqa")
_CUDNN_CURRENT = _has_arg(_CUDNN, "compute_log_sumexp")


def no_config(problem: AttentionProblem, device: DeviceFingerprint) -> Config:
    """The default config of an implementation without knobs: ``{}``."""
    return {}


def sdpa_is_causal(name: str, q: torch.Tensor, k: torch.Tensor, config: Mapping[str, int],
                   causal: bool, gqa: bool = False) -> bool:
    """SDPA's ``is_causal`` for flashtune's ``causal`` (the same mask where ``seqlen_q ==
    seqlen_k``, none needed for a single query); raises what a launcher of torch's SDPA ops
    refuses (a config other than ``{}``, GQA where ``gqa`` is False, unaligned causal)."""
    if config != {} and (not isinstance(config, Mapping) or len(config)):
        raise ConfigError(f"config must be {{}} for {name} (an extern has no knobs), got "
                          f"{config!r}")
    if not gqa and q.shape[1] != k.shape[1]:
        raise InputError(f"{name} does not serve GQA/MQA: heads_q {q.shape[1]} != heads_kv "
                         f"{k.shape[1]}; expand k and v or use attn_fwd")
    nq, nk = q.shape[2], k.shape[2]
    if causal and nq != nk and nq != 1:
        raise InputError(f"{name} does not serve causal with seqlen_q {nq} != seqlen_k {nk} "
                         f"(SDPA aligns the mask top-left, flashtune bottom-right; "
                         f"causal_unaligned); use attn_fwd")
    return causal and nq == nk


def _needs_lse(return_lse: bool, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether the op must compute the LSE: asked for, or kept for autograd's backward."""
    return return_lse or (torch.is_grad_enabled()
                          and (q.requires_grad or k.requires_grad or v.requires_grad))


def sdpa_cudnn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, config: Mapping[str, int], *,
               causal: bool = False, scale: float | None = None, return_lse: bool = False
               ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """torch SDPA's cuDNN backend (``aten._scaled_dot_product_cudnn_attention``).

    Arguments:
        q: ``(batch, heads, seqlen_q, head_dim)``, fp16 or bf16 on a CUDA device, last dim
            contiguous (any other strides).
        k, v: ``(batch, heads, seqlen_k, head_dim)``, same dtype and device; the same number
            of heads as ``q`` (no GQA).
        config: ``{}`` (the backend has no knobs).
        causal: bottom-right aligned causal mask; only ``seqlen_q == seqlen_k`` or
            ``seqlen_q == 1``.
        scale: softmax scale (None: ``1/sqrt(head_dim)``).
        return_lse: also return the log-sum-exp.
    Returns:
        ``out`` with q's shape (strides as cuDNN chose), or ``(out, lse)`` with ``lse``
        float32 ``(batch, heads, seqlen_q)``, natural log. Differentiable through autograd.
    Raises:
        ConfigError for a config other than ``{}``; InputError for GQA or unaligned causal.
    """
    is_causal = sdpa_is_causal("sdpa_cudnn", q, k, config, causal, gqa=True)
    res = _CUDNN(q, k, v, None, _needs_lse(return_lse, q, k, v), 0.0, is_causal, False,
                 scale=scale)
    if not return_lse:
        return res[0]
    lse = res[1]
    if lse.dim() == 4:  # (batch, heads, seqlen_q, 1)
        lse = lse.squeeze(-1)
    return res[0], lse if lse.dtype == torch.float32 else lse.float()


def sdpa_flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, config: Mapping[str, int], *,
               causal: bool = False, scale: float | None = None, return_lse: bool = False
               ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """torch SDPA's FlashAttention-2 backend (``aten._scaled_dot_product_flash_attention``).

    Arguments, returns and errors as :func:`sdpa_cudnn` (the output is a
    ``(batch, seqlen_q, heads, head_dim)`` buffer seen with q's shape). A head dim that is
    not a multiple of 8, which the op refuses, runs as ``F.scaled_dot_product_attention``
    runs it: q, k and v zero-padded to the next multiple of 8 (copies; the zeros change no
    score), the scale of the real head dim, the output a view of the first ``head_dim``
    columns. Differentiable either way.
    """
    is_causal = sdpa_is_causal("sdpa_flash", q, k, config, causal, gqa=True)
    head_dim = q.shape[-1]
    if head_dim % 8:
        if scale is None:
            scale = 1.0 / math.sqrt(head_dim)
        pad = (0, 8 - head_dim % 8)
        q, k, v = (torch.nn.functional.pad(t, pad) for t in (q, k, v))
    res = _FLASH(q, k, v, 0.0, is_causal, False, scale=scale)
    out = res[0][..., :head_dim] if head_dim % 8 else res[0]
    if not return_lse:
        return out
    return out, res[1]


def sdpa_efficient(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   config: Mapping[str, int], *, causal: bool = False,
                   scale: float | None = None, return_lse: bool = False
                   ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """torch SDPA's memory-efficient backend (xFormers' kernel,
    ``aten._scaled_dot_product_efficient_attention``).

    Arguments, returns and errors as :func:`sdpa_cudnn` (the op pads the LSE's last dim to a
    multiple of 32; the returned ``lse`` is a view of its first ``seqlen_q``).
    """
    is_causal = sdpa_is_causal("sdpa_efficient", q, k, config, causal)
    res = _EFFICIENT(q, k, v, None, _needs_lse(return_lse, q, k, v), 0.0, is_causal,
                     scale=scale)
    if not return_lse:
        return res[0]
    return res[0], res[1][:, :, :q.shape[2]]


def sdpa_math(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, config: Mapping[str, int], *,
              causal: bool = False, scale: float | None = None, return_lse: bool = False
              ) -> torch.Tensor:
    """torch SDPA's math backend (``aten._scaled_dot_product_attention_math``): plain
    matmul and softmax on any device (CPU included), upcast to fp32 inside by torch.

    Arguments as :func:`sdpa_cudnn`, except that ``q`` may be on the CPU and ``heads_q`` may
    be a multiple of ``heads_kv`` (GQA, torch >= 2.5), and that ``return_lse`` must be
    False.
    Returns:
        ``out`` with q's shape. Differentiable through autograd.
    Raises:
        InputError when ``return_lse`` is True (the op does not compute the LSE), for
        unaligned causal, and for GQA under torch < 2.5; ConfigError for a config other
        than ``{}``.
    """
    is_causal = sdpa_is_causal("sdpa_math", q, k, config, causal, gqa=_MATH_GQA)
    if return_lse:
        raise InputError("sdpa_math cannot return the LSE (return_lse=True); use attn_fwd "
                         "or another SDPA backend")
    if q.shape[1] != k.shape[1]:
        return _MATH(q, k, v, None, 0.0, is_causal, None, scale=scale, enable_gqa=True)[0]
    return _MATH(q, k, v, None, 0.0, is_causal, None, scale=scale)[0]


def _torch_picks(q: torch.Tensor, k: torch.Tensor, is_causal: bool, scale: float | None,
                 gqa: bool) -> int:
    """The backend (``SDPBackend``'s value) ``F.scaled_dot_product_attention`` would run
    these inputs on now (-1 when torch cannot say)."""
    try:
        return int(torch._fused_sdp_choice(q, k, k, None, 0.0, is_causal, scale=scale,
                                           enable_gqa=gqa))
    except Exception:  # an older or CPU-only torch: no shortcut
        return -1


def bound_inference(name: str, q: torch.Tensor, k: torch.Tensor, *, causal: bool,
                    scale: float | None, return_lse: bool
                    ) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], Any] | None:
    """A call of extern ``name`` for inputs shaped as ``q``/``k`` without gradients, with
    its options bound and its checks done now: ``fn(q, k, v)`` returns what the launcher
    would (``out``, or ``(out, lse)``). The runtime memoises one per call signature, so a
    call pays for the backend's op alone.

    Where torch's own ``F.scaled_dot_product_attention`` would pick this very backend for
    these inputs (asked once, now: ``torch._fused_sdp_choice``) and no LSE is wanted, the
    bound call is that function: it reaches the same op from C++ and returns one tensor
    where the op returns nine to Python, 2-3 us less per call on the H100. (A caller who
    later narrows torch's backends with ``sdpa_kernel`` then steers these calls too, as it
    does torch's.) Otherwise the op's ``torch.*`` binding.

    Arguments:
        name: the extern (``sdpa_cudnn``, ``sdpa_flash``, ``sdpa_efficient``).
        q, k: tensors shaped (and placed) as the call's.
        causal, scale, return_lse: the call's options.
    Returns:
        ``fn(q, k, v)``, or None where there is nothing to save (math, another name, an
        LSE that needs reshaping, a flash call whose head dim the launcher pads). Where
        ``fn`` is torch's SDPA, :func:`any_layout` says so: it serves every layout of the
        same shapes, since torch checks the tensors and picks its backend per call.
    Raises:
        What the launcher raises for these shapes (GQA where refused, unaligned causal).
    """
    if name not in ("sdpa_cudnn", "sdpa_flash", "sdpa_efficient"):
        return None
    gqa = name != "sdpa_efficient"
    is_causal = sdpa_is_causal(name, q, k, {}, causal, gqa=gqa)
    if return_lse and name != "sdpa_flash":
        return None
    grouped = q.shape[1] != k.shape[1]
    if not return_lse and _torch_picks(q, k, is_causal, scale, grouped) == _PICKS[name]:
        # a partial, not a lambda: called from C, no Python frame of its own
        return functools.partial(torch.nn.functional.scaled_dot_product_attention,
                                 is_causal=is_causal, scale=scale, enable_gqa=grouped)
    if name == "sdpa_cudnn":
        cudnn = _CUDNN_FN
        return lambda q, k, v: cudnn(q, k, v, None, False, 0.0, is_causal, False,
                                     scale=scale)[0]
    if name == "sdpa_flash":
        if q.shape[-1] % 8:  # the launcher pads it (sdpa_flash): nothing to save
            return None
        flash = _FLASH_FN
        if return_lse:
            return lambda q, k, v: flash(q, k, v, 0.0, is_causal, False, scale=scale)[:2]
        return lambda q, k, v: flash(q, k, v, 0.0, is_causal, False, scale=scale)[0]
    efficient = _EFFICIENT_FN
    return lambda q, k, v: efficient(q, k, v, None, False, 0.0, is_causal, scale=scale)[0]


def any_layout(fn: Any) -> bool:
    """Whether ``fn``, a call :func:`bound_inference` returned, is torch's own
    ``F.scaled_dot_product_attention`` with the options bound: it then serves any strides,
    alignment and contiguity of tensors of the shapes it was bound for (torch checks the
    inputs and picks its backend on every call, as for any caller), so the runtime may key
    it by shapes, dtype and device alone (:func:`flashtune.runtime.routing._attention`)."""
    return (isinstance(fn, functools.partial)
            and fn.func is torch.nn.functional.scaled_dot_product_attention)


# -- what the running process offers ------------------------------------------------------------

def _gpu_reason(device: DeviceFingerprint, min_capability: tuple[int, int]) -> str | None:
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is built without CUDA"
    cap = device.capability
    if cap is None or cap < min_capability:
        return (f"needs sm_{min_capability[0]}{min_capability[1]} or newer, not "
                f"{device.name} ({device.compute_capability})")
    return None


def _cudnn_available(device: DeviceFingerprint) -> str | None:
    reason = _gpu_reason(device, (8, 0))
    if reason is not None:
        return reason
    if not torch.backends.cuda.cudnn_sdp_enabled():
        return "cuDNN SDPA is disabled in this process (torch.backends.cuda.cudnn_sdp_enabled())"
    version = _cudnn_version()
    if version is None or version < 90000:
        return f"cuDNN SDPA needs cuDNN 9 or newer (this torch has {version or 'none'})"
    if not _CUDNN_CURRENT:
        return f"torch {torch.__version__}'s cuDNN SDPA op predates torch 2.5's signature"
    return None


def _flash_available(device: DeviceFingerprint) -> str | None:
    reason = _gpu_reason(device, (8, 0))
    if reason is not None:
        return reason
    if not torch.backends.cuda.flash_sdp_enabled():
        return "flash SDPA is disabled in this process (torch.backends.cuda.flash_sdp_enabled())"
    built = getattr(torch.backends.cuda, "is_flash_attention_available", lambda: True)
    if not built():
        return f"torch {torch.__version__} is built without FlashAttention"
    return None


def _efficient_available(device: DeviceFingerprint) -> str | None:
    reason = _gpu_reason(device, (5, 0))
    if reason is not None:
        return reason
    if not torch.backends.cuda.mem_efficient_sdp_enabled():
        return ("memory-efficient SDPA is disabled in this process "
                "(torch.backends.cuda.mem_efficient_sdp_enabled())")
    return None


def _cudnn_version() -> int | None:
    try:
        version = torch.backends.cudnn.version()
    except Exception:  # a cuDNN that does not load (version mismatch): none to use
        return None
    return int(version) if version is not None else None


# -- the specs ----------------------------------------------------------------------------------

def extern_hash(backend: str, torch_version: str, cudnn_version: int | None = None) -> str:
    """The source hash of an extern: what decides its kernel is the library, not flashtune.

    Arguments:
        backend: ``"cudnn"``, ``"flash"``, ``"efficient"`` or ``"math"``.
        torch_version: ``torch.__version__``.
        cudnn_version: cuDNN's version (``torch.backends.cudnn.version()``) for the cuDNN
            backend; None for the others or when there is none.
    Returns:
        16 hex characters of the sha256 of the three; recorded timings go stale when any
        changes.
    """
    text = f"sdpa_{backend}\x00{torch_version}\x00{'' if cudnn_version is None else cudnn_version}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


# what cuDNN and the efficient kernel take (torch checks head_dim % 8 for both)
_MULTIPLES_OF_8 = tuple(range(8, MAX_HEAD_DIM + 1, 8))
_LAUNCHERS: dict[str, Callable[..., Any]] = {
    "cudnn": sdpa_cudnn, "flash": sdpa_flash, "efficient": sdpa_efficient, "math": sdpa_math}
_LIMITS = {
    # cuDNN's frontend: "s_q = s_kv = 1 is not supported" (FlashAttention-2's own tests,
    # test_flash_attn_bwd_overflow, on the H100)
    "cudnn": Limits(head_dims=_MULTIPLES_OF_8, gqa=True, causal_unaligned=False,
                    needs_gpu=True, single_token=False, available=_cudnn_available),
    # every head dim up to 256: the others than multiples of 8 padded, as torch pads them
    "flash": Limits(gqa=True, causal_unaligned=False,
                    needs_gpu=True, available=_flash_available),
    "efficient": Limits(head_dims=_MULTIPLES_OF_8,
                        gqa=False, causal_unaligned=False, needs_gpu=True,
                        available=_efficient_available),
    "math": Limits(gqa=_MATH_GQA, causal_unaligned=False, lse=False, needs_gpu=False),
}
_MAKE_CASE = functools.partial(forward_case, attn_fwd_reference)


def extern_spec(backend: str) -> TemplateSpec:
    """The :class:`TemplateSpec` of SDPA's ``backend``, named ``sdpa_<backend>`` (its
    template folder registers it).

    Arguments:
        backend: one of :data:`BACKENDS`.
    Returns:
        A spec of kind ``"extern"`` serving ``fwd`` and ``decode``, with the empty space.
    Raises:
        ValueError for an unknown backend.
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown SDPA backend {backend!r}; expected one of "
                         f"{', '.join(BACKENDS)}")
    return TemplateSpec(
        name=f"sdpa_{backend}",
        op="fwd",
        source_hash=extern_hash(backend, str(torch.__version__),
                                _cudnn_version() if backend == "cudnn" else None),
        launcher=_LAUNCHERS[backend],
        reference=attn_fwd_reference,
        space=EMPTY_SPACE,
        default_config=no_config,
        make_case=_MAKE_CASE,
        warmup_launches=None,
        tunable=True,
        kind="extern",
        torch_bound=True,
        serves=("fwd", "train", "decode"),
        limits=_LIMITS[backend],
        plans_per_shape=backend == "cudnn",
    )

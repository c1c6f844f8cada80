"""``flashtune bench --model``: flashtune inside a real model, end to end, against torch's SDPA.

One randomly initialised transformers model (Llama-, Mistral-, Gemma-2-, Gemma-3-, BERT- or
ViT-shaped: :data:`PRESETS`, layers and widths overridable) in bf16 runs each phase with its
attention implementation switched between the contenders, same weights, same inputs, same
run. The decoders (:data:`DECODERS`: ``llama``, ``mistral``, ``gemma2``, ``gemma3``) run the
prefill and generation phases; ``mistral``'s every layer attends within a sliding window of
4096 keys (Mistral-7B v0.1's), which torch's SDPA receives as an explicit mask once a
sequence outruns it and flashtune as a window (its default training step, 2 x 8192 tokens,
does); ``gemma3``'s local layers attend within a sliding window of 1024 keys
(five of every six layers, as Gemma 3's), which torch's SDPA receives as an explicit mask
and flashtune as a window; ``gemma2``'s every other layer within 4096 keys, and every layer
caps its scores with a softcap of 50 (``50 tanh(s / 50)``), which no SDPA backend applies:
transformers runs Gemma 2 on its ``eager`` attention (matmuls and a softmax, the N x N
scores in memory), the reference its contenders are checked against (:data:`REFERENCE`),
beside ``flex_attention`` (FlexAttention, compiled, with the softcap as a score
modification):

* ``prefill`` (decoders: the prompt's forward, last-token logits, as a server's prefill) or
  ``forward`` (``bert``, ``vit``: inference on a batch), at each requested length;
* ``train``: forward, loss and backward of a batch (no optimizer step: it is the same work
  for every contender);
* ``generate`` (decoders): greedy generation of ``new`` tokens after a prompt, KV cache on;
  its decode time is the generation's minus the prompt's prefill, timed beside it;
* ``generate_static`` (decoders): the same with a static cache (transformers'
  ``StaticCache``, made once and emptied before each call, as a server keeps its cache;
  ``cache_implementation="static"`` makes a new one a call, and the compiled step's CUDA
  graphs were recorded again every call), with which transformers compiles each decode step
  with ``torch.compile(mode="reduce-overhead")`` on a GPU: the steps replay as CUDA graphs
  (flashtune's steps run over the whole cache, lengths on the device:
  :mod:`flashtune.runtime.static_cache`). On CPU the steps run eagerly;
* ``generate_new`` (decoders): greedy generation from prompt lengths the process has not
  run, each contender in a process of its own
  (:mod:`flashtune.integrations.fresh_generation`): every decoding step a shape torch's
  cuDNN has not planned, as a request with a new prompt length meets it (``generate``
  repeats its lengths round after round).

Contenders: ``flashtune`` (``attn_implementation="flashtune"``: what
:func:`flashtune.scaled_dot_product_attention` routes each call to), ``sdpa`` (torch's own
choice of backend), ``sdpa_<backend>`` (``sdpa`` inside ``sdpa_kernel(<backend>)``), and
transformers' ``eager`` and ``flex_attention``. Each contender's output is checked against
the family's reference (``sdpa``; ``eager`` for ``gemma2``) before it is timed; then the
contenders are timed in rotation, ``rounds`` times (median kept), so a drift in clocks hits all
alike; a phase whose rounds swing past :data:`UNRESOLVED` also reports the fastest rounds'
ratios.

Per phase it also records the calls flashtune handed to torch (by reason:
:func:`flashtune.runtime.sdpa.fallback_counts`), where each distinct attention call of the
model is routed (:func:`~flashtune.runtime.sdpa.describe_route`, from an untimed pass), and on
a GPU attention's share of the device time (``torch.profiler``: kernels whose names are
attention kernels, :data:`ATTENTION_KERNEL`, over all kernels) for flashtune and ``sdpa``.

On CPU (``interpret=True``, under ``TRITON_INTERPRET=1``) the same pipeline runs a tiny model
(:data:`TINY`): it proves the wiring and numerics, its timings mean nothing.
"""

from __future__ import annotations

import contextlib
import functools
import platform
import re
import statistics
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from flashtune.core.problem import MAX_HEAD_DIM
from flashtune.integrations.fresh_generation import (
    fresh_generation_row,
    fresh_lengths,
    round_stats,
)
from flashtune.integrations.transformers import (
    NAME,
    chunk_against_cache,
    layer_window,
    sdpa_arguments,
)
from flashtune.runtime.bench import _first_line
from flashtune.runtime.ops import lookup_config
from flashtune.runtime.sdpa import describe_route, fallback_counts, reset_fallback_counts

__all__ = ["ATTENTION_KERNEL", "BASELINES", "CONTENDERS", "DECODERS", "FAMILIES", "GEMMAS",
           "PRESETS", "REFERENCE", "TINY", "ModelSpec", "Workload", "attention_share",
           "bench_model", "default_workload", "render_model"]

FAMILIES = ("llama", "mistral", "gemma2", "gemma3", "bert", "vit")
# the causal language models: a prefill, generation and its KV cache
DECODERS = ("llama", "mistral", "gemma2", "gemma3")
# the families with a head dim of their own, local layers and a window
GEMMAS = ("gemma2", "gemma3")
CONTENDERS = ("flashtune", "sdpa", "sdpa_flash", "sdpa_cudnn", "sdpa_efficient", "sdpa_math",
              "eager", "flex_attention")
DEFAULT_CONTENDERS = ("flashtune", "sdpa", "sdpa_flash", "sdpa_cudnn")
# the contender every other is checked against, by family: torch's SDPA as it picks its
# backend, but for Gemma 2, which transformers runs on its eager attention (SDPA has no
# softcap: transformers refuses "sdpa" for it)
REFERENCE = {"gemma2": "eager"}
# the contenders beside flashtune when none are named, by family
BASELINES = {"gemma2": ("eager", "flex_attention"),
             "mistral": ("sdpa", "sdpa_cudnn", "flex_attention")}
# kernels that compute attention: flashtune's (attn_fwd/bwd/decode, Gluon), FA2 in torch
# (pytorch_flash::flash_fwd_kernel), cuDNN's SDPA (..._sdpa_...), the efficient backend
# (fmha_cutlass...). torch's math path (matmuls and a softmax) is not counted.
ATTENTION_KERNEL = re.compile(r"attn|attention|flash|fmha|sdpa", re.IGNORECASE)
# the untimed pass's attention function: a name with "flash" in it, as "flashtune", so that
# transformers treats it as it treats flashtune (it keeps a static cache's padding mask for
# flash implementations); the integration tells transformers it needs no flash package
PROBE = "flashtune_probe"
# a contender's output vs sdpa's, a sanity check (each kernel is checked on its own against
# fp32 elsewhere): logits (bf16, through 8 Llama-3-8B layers SDPA's flash and cuDNN
# backends differ by 2.1e-2 on the H100), and a training step's loss and per-parameter
# gradient norms
TOL = 5e-2
# a round spread past which the table adds the fastest rounds' ratios (generation's rounds
# swung by 35-53% on the H200 hosts, the other phases' by 1-15%)
UNRESOLVED = 0.2


@dataclass(frozen=True)
class ModelSpec:
    """A model's shape: family (:data:`FAMILIES`), layers, hidden size, query and key/value
    heads, MLP width, vocabulary (decoders, ``bert``), image and patch size (``vit``),
    attention dropout (in training only); for the Gemma families the head dim
    (``head_size``; 0: ``hidden // heads``), the local layers' sliding window and every how
    many layers one attends globally (``global_every``: Gemma 3's 6, five local layers,
    then a global one; Gemma 2's 2), and Gemma 2's attention softcap; for ``mistral`` the
    sliding window of its every layer."""

    family: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int = 0
    image: int = 0
    patch: int = 0
    dropout: float = 0.0
    head_size: int = 0
    window: int = 0
    global_every: int = 0
    softcap: float = 0.0

    @property
    def head_dim(self) -> int:
        return self.head_size or self.hidden // self.heads

    @property
    def layer_types(self) -> list[str]:
        """A Gemma family's attention per layer (transformers' ``layer_types``)."""
        return ["full_attention" if (i + 1) % self.global_every == 0 else "sliding_attention"
                for i in range(self.layers)]

    def check(self) -> None:
        """ValueError naming the field that makes no model."""
        if self.family not in FAMILIES:
            raise ValueError(f"model family {self.family!r}: choose from {', '.join(FAMILIES)}")
        for name in ("layers", "hidden", "heads", "kv_heads", "intermediate"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if not self.head_size and self.hidden % self.heads:
            raise ValueError(f"hidden {self.hidden} is not a multiple of heads {self.heads}")
        if self.heads % self.kv_heads:
            raise ValueError(f"heads {self.heads} is not a multiple of kv_heads "
                             f"{self.kv_heads}")
        if self.family not in DECODERS and self.kv_heads != self.heads:
            raise ValueError(f"{self.family} has no grouped-query attention: kv_heads must "
                             f"equal heads ({self.heads})")
        if self.family in GEMMAS:
            for name in ("window", "global_every"):
                if getattr(self, name) < 1:
                    raise ValueError(f"{name} must be at least 1 for {self.family}, got "
                                     f"{getattr(self, name)}")
        elif self.family == "mistral":
            if self.window < 1:
                raise ValueError(f"window must be at least 1 for mistral, got {self.window}")
            if self.head_size or self.global_every:
                raise ValueError("head_size and global_every are the Gemma families'; mistral "
                                 "takes its head dim from hidden / heads, every layer local")
        elif self.head_size or self.window or self.global_every:
            raise ValueError(f"head_size, window and global_every are the Gemma families' "
                             f"(window mistral's too); {self.family} takes its head dim from "
                             f"hidden / heads and has no window")
        if self.softcap < 0 or (self.softcap and self.family != "gemma2"):
            raise ValueError(f"softcap is gemma2's (> 0, or 0 for none), got {self.softcap} "
                             f"for {self.family}")

    def config(self) -> Any:
        """The transformers config."""
        if self.family == "llama":
            from transformers import LlamaConfig

            return LlamaConfig(vocab_size=self.vocab, hidden_size=self.hidden,
                               intermediate_size=self.intermediate,
                               num_hidden_layers=self.layers, num_attention_heads=self.heads,
                               num_key_value_heads=self.kv_heads,
                               max_position_embeddings=32768, attention_dropout=self.dropout,
                               pad_token_id=0, bos_token_id=None, eos_token_id=None)
        if self.family == "mistral":
            from transformers import MistralConfig

            return MistralConfig(vocab_size=self.vocab, hidden_size=self.hidden,
                                 intermediate_size=self.intermediate,
                                 num_hidden_layers=self.layers, num_attention_heads=self.heads,
                                 num_key_value_heads=self.kv_heads, sliding_window=self.window,
                                 max_position_embeddings=32768,
                                 attention_dropout=self.dropout, pad_token_id=0,
                                 bos_token_id=None, eos_token_id=None)
        if self.family in GEMMAS:
            from transformers import Gemma2Config, Gemma3TextConfig

            # scores scaled by 1 / sqrt(head dim) (query_pre_attn_scalar, as both models');
            # Gemma 2 9B caps them at 50 and its logits at 30; Gemma 3 has no softcap (QK
            # norms took its place)
            gemma: dict[str, Any] = dict(
                vocab_size=self.vocab, hidden_size=self.hidden,
                intermediate_size=self.intermediate, num_hidden_layers=self.layers,
                num_attention_heads=self.heads, num_key_value_heads=self.kv_heads,
                head_dim=self.head_dim, query_pre_attn_scalar=self.head_dim,
                sliding_window=self.window, layer_types=self.layer_types,
                max_position_embeddings=32768, attention_dropout=self.dropout,
                pad_token_id=0, bos_token_id=None, eos_token_id=None)
            if self.family == "gemma3":
                return Gemma3TextConfig(**gemma)
            return Gemma2Config(**gemma, attn_logit_softcapping=self.softcap or None,
                                final_logit_softcapping=30.0)
        if self.family == "bert":
            from transformers import BertConfig

            return BertConfig(vocab_size=self.vocab, hidden_size=self.hidden,
                              intermediate_size=self.intermediate,
                              num_hidden_layers=self.layers, num_attention_heads=self.heads,
                              max_position_embeddings=4096, hidden_dropout_prob=0.0,
                              attention_probs_dropout_prob=self.dropout)
        from transformers import ViTConfig

        cfg = ViTConfig(hidden_size=self.hidden, intermediate_size=self.intermediate,
                        num_hidden_layers=self.layers, num_attention_heads=self.heads,
                        image_size=self.image, patch_size=self.patch, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=self.dropout)
        cfg.num_labels = 1000  # ImageNet's classes
        return cfg

    def build(self, dtype: torch.dtype, device: str) -> Any:
        """The model, randomly initialised (seeded by the caller), in eval mode."""
        from transformers import AutoModelForCausalLM, BertForMaskedLM, ViTForImageClassification

        # (transformers' constructors are untyped: called through Any)
        make: Any = AutoModelForCausalLM.from_config if self.family in DECODERS else \
            (BertForMaskedLM if self.family == "bert" else ViTForImageClassification)._from_config
        with torch.device(device):  # initialised where it runs: no host copy of the weights
            model = make(self.config(), dtype=dtype,
                         attn_implementation=REFERENCE.get(self.family, "sdpa"))
        return model.eval()


@dataclass(frozen=True)
class Workload:
    """What to run: the inference batch and lengths (decoders: prompts; ``bert``: tokens;
    ``vit``: ignored, a sequence is the image's patches and the class token), the training
    batch and length, and for the decoders the generation's batch, prompt and new tokens.
    ``phases`` names the phases to run."""

    batch: int
    seqlens: tuple[int, ...]
    train_batch: int
    train_seqlen: int
    gen_batch: int = 0
    gen_prompt: int = 0
    new_tokens: int = 0
    phases: tuple[str, ...] = ("prefill", "train", "generate", "generate_static",
                               "generate_new")


# Llama-3-8B's layer (4096 wide, 32 query and 8 KV heads of 128, MLP 14336, vocab 128256), 8
# of its 32 layers; Mistral-7B v0.1's (the same widths, vocab 32000, every layer in a
# 4096-key sliding window), 8 of its 32; Gemma-2-9B's (3584 wide, 16 query and 8 KV heads of
# 256, MLP 14336, vocab 256000, every other layer local with a 4096-key window, attention
# softcap 50), 8 of its 42; Gemma-3-12B's (3840 wide, 16 query and 8 KV heads of 256, MLP
# 15360, vocab 262208, local layers' window 1024, one global layer in six), 8 of its 48
# (layers 1-5 and 7-8 local, 6 global); BERT-large (24 x 1024, 16 heads of 64, attention
# dropout 0.1 as trained); ViT-L/16 at 224 px (24 x 1024, 16 heads of 64, 197 tokens)
PRESETS: dict[str, ModelSpec] = {
    "llama": ModelSpec("llama", 8, 4096, 32, 8, 14336, vocab=128256),
    "mistral": ModelSpec("mistral", 8, 4096, 32, 8, 14336, vocab=32000, window=4096),
    "gemma2": ModelSpec("gemma2", 8, 3584, 16, 8, 14336, vocab=256000, head_size=256,
                        window=4096, global_every=2, softcap=50.0),
    "gemma3": ModelSpec("gemma3", 8, 3840, 16, 8, 15360, vocab=262208, head_size=256,
                        window=1024, global_every=6),
    "bert": ModelSpec("bert", 24, 1024, 16, 16, 4096, vocab=30522, dropout=0.1),
    "vit": ModelSpec("vit", 24, 1024, 16, 16, 4096, image=224, patch=16),
}
# under the interpreter: head dim 16, a few tokens, so a phase takes seconds on a CPU
TINY: dict[str, ModelSpec] = {
    "llama": ModelSpec("llama", 2, 64, 4, 2, 128, vocab=128),
    # prompts longer than the window of 8
    "mistral": ModelSpec("mistral", 2, 64, 4, 2, 128, vocab=128, window=8),
    # a local layer then a global one; prompts longer than the window of 8
    "gemma3": ModelSpec("gemma3", 2, 64, 4, 2, 128, vocab=128, head_size=16, window=8,
                        global_every=2),
    # a softcap small enough to change the tiny model's scores
    "gemma2": ModelSpec("gemma2", 2, 64, 4, 2, 128, vocab=128, head_size=16, window=8,
                        global_every=2, softcap=1.0),
    "bert": ModelSpec("bert", 2, 64, 4, 4, 128, vocab=128, dropout=0.1),
    "vit": ModelSpec("vit", 2, 64, 4, 4, 128, image=32, patch=8),
}


def default_workload(family: str, *, tiny: bool = False) -> Workload:
    """The issue's measures: a decoder's prefill of one 2k and one 8k prompt, a training
    step on 2 x 4096 tokens (``mistral``: 2 x 8192, twice its window), 64 tokens generated
    for 8 prompts of 2048; BERT 32 x 512 tokens; ViT 64 images. ``tiny``: a few tokens
    each, for the interpreter."""
    if family in DECODERS:
        if tiny:
            return Workload(1, (24,), 2, 16, 2, 12, 3)
        return Workload(1, (2048, 8192), 2, 8192 if family == "mistral" else 4096, 8, 2048, 64)
    phases = ("forward", "train")
    if family == "bert":
        return Workload(2, (24,), 2, 16, phases=phases) if tiny else \
            Workload(32, (512,), 32, 512, phases=phases)
    return Workload(2, (0,), 2, 0, phases=phases) if tiny else \
        Workload(64, (0,), 64, 0, phases=phases)


@dataclass
class _Phase:
    """One phase's inputs and what to call: ``run()`` for timing, ``output()`` for the
    check (a tensor to compare between contenders)."""

    name: str
    label: str
    tokens: int
    run: Callable[[], Any]
    output: Callable[[], torch.Tensor]
    extra: dict[str, Any] = field(default_factory=dict)


def attention_share(kernels: Sequence[tuple[str, float]]) -> float | None:
    """The fraction of device time spent in attention kernels (:data:`ATTENTION_KERNEL`),
    given ``(kernel name, device time)`` pairs; None when there are no kernels."""
    total = sum(t for _, t in kernels)
    if total <= 0:
        return None
    return sum(t for name, t in kernels if ATTENTION_KERNEL.search(name)) / total


def _profile_share(fn: Callable[[], Any]) -> float | None:
    """:func:`attention_share` of one call of ``fn`` under ``torch.profiler`` (GPU only)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    kernels = [(e.name, float(e.self_device_time_total)) for e in prof.events()
               if e.device_type == torch.autograd.DeviceType.CUDA]
    return attention_share(kernels)


@contextlib.contextmanager
def _contender(model: Any, name: str) -> Iterator[None]:
    """``model`` runs its attention as contender ``name`` inside the block."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    model.set_attn_implementation(name if name in ("eager", "flex_attention") else
                                  NAME if name == "flashtune" else "sdpa")
    if name in ("flashtune", "sdpa", "eager", "flex_attention"):
        yield
        return
    backend = {"sdpa_flash": SDPBackend.FLASH_ATTENTION,
               "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION,
               "sdpa_efficient": SDPBackend.EFFICIENT_ATTENTION,
               "sdpa_math": SDPBackend.MATH}[name]
    with sdpa_kernel(backend):
        yield


@contextlib.contextmanager
def _probing(model: Any) -> Iterator[dict[str, dict[str, Any]]]:
    """Inside the block ``model`` runs flashtune's attention and records, per distinct call
    (shapes, dtype, causal, mask, dropout, gradients), how many times it came and where
    flashtune routes it (a fallback to torch says why)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    from flashtune.integrations.transformers import (
        flashtune_attention_forward,
        flashtune_attention_mask,
        is_generation_step,
    )

    calls: dict[str, dict[str, Any]] = {}

    def probe(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
              value: torch.Tensor, attention_mask: torch.Tensor | None, *args: Any,
              **kwargs: Any) -> Any:
        a = sdpa_arguments(module, query, key, value, attention_mask, *args, **kwargs)
        grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
        # a layer's sliding window, where its keys outrun it (as the integration reads it)
        sliding, softcap = kwargs.get("sliding_window"), kwargs.get("softcap")
        window = layer_window(sliding, key.shape[2])
        label = (f"q {tuple(query.shape)} k {tuple(key.shape)} {str(query.dtype)[6:]}"
                 f"{' causal' if a['is_causal'] else ''}"
                 f"{f' window {sliding}' if window else ''}"
                 f"{f' softcap {softcap}' if softcap is not None else ''}"
                 f"{' mask' if attention_mask is not None else ''}"
                 f"{' dropout' if a['dropout_p'] else ''}{' grad' if grad else ''}")
        if label not in calls:
            step = is_generation_step(query, key, attention_mask, a["dropout_p"])
            if step:
                route = "attn_decode: a generation step over the whole cache"
            elif attention_mask is None and (window or softcap is not None):
                choice = lookup_config(query, key, value, causal=a["is_causal"], window=window,
                                       softcap=softcap, dropout_p=a["dropout_p"])
                route = f"{choice.template} ({choice.source})"
            elif attention_mask is None and chunk_against_cache(query, key, a["is_causal"]):
                choice = lookup_config(query, key, value, causal=True)
                route = (f"{choice.template} ({choice.source}): a chunk against the cache, "
                         f"causal aligned bottom-right")
            elif attention_mask is not None and attention_mask.dim() == 2 \
                    and attention_mask.shape[1] <= key.shape[2] \
                    and query.shape[-1] <= MAX_HEAD_DIM:  # what the integration unpads
                route = "attn_fwd: padding removed, run as a packed batch (attention_varlen)"
            else:
                route = describe_route(**a)
            calls[label] = {"call": label, "calls": 0, "route": route}
        calls[label]["calls"] += 1
        return flashtune_attention_forward(module, query, key, value, attention_mask, *args,
                                           **kwargs)

    AttentionInterface.register(PROBE, probe)
    AttentionMaskInterface.register(PROBE, flashtune_attention_mask)
    model.set_attn_implementation(PROBE)
    try:
        yield calls
    finally:
        model.set_attn_implementation(NAME)


def _phases(spec: ModelSpec, work: Workload, model: Any, device: str) -> list[_Phase]:
    gen = torch.Generator(device=device).manual_seed(1)
    phases: list[_Phase] = []
    dtype = next(model.parameters()).dtype

    def ids(batch: int, n: int) -> torch.Tensor:
        return torch.randint(1, spec.vocab, (batch, n), device=device, generator=gen)

    def pixels(batch: int) -> torch.Tensor:
        return torch.randn(batch, 3, spec.image, spec.image, device=device, generator=gen,
                           dtype=torch.float32).to(dtype)

    def inputs(batch: int, n: int) -> dict[str, torch.Tensor]:
        if spec.family == "vit":
            return {"pixel_values": pixels(batch)}
        x = ids(batch, n)
        return {"input_ids": x} if spec.family == "bert" else \
            {"input_ids": x, "logits_to_keep": 1}  # type: ignore[dict-item]

    def tokens(batch: int, n: int) -> int:
        return batch * ((spec.image // spec.patch) ** 2 + 1 if spec.family == "vit" else n)

    def infer(x: Mapping[str, Any]) -> Callable[[], torch.Tensor]:
        def run() -> torch.Tensor:
            model.eval()
            with torch.no_grad():
                logits: torch.Tensor = model(**x).logits
            return logits
        return run

    infer_phase = "prefill" if spec.family in DECODERS else "forward"
    if infer_phase in work.phases:
        for n in (work.seqlens if spec.family != "vit" else (0,)):
            x = inputs(work.batch, n)
            label = f"B{work.batch} x {tokens(1, n)} tokens"
            phases.append(_Phase(infer_phase, label, tokens(work.batch, n), infer(x), infer(x)))
    if "train" in work.phases:
        x = inputs(work.train_batch, work.train_seqlen)
        x.pop("logits_to_keep", None)
        if spec.family == "vit":
            x["labels"] = torch.randint(0, 1000, (work.train_batch,), device=device,
                                        generator=gen)
        else:
            x["labels"] = x["input_ids"]

        def step(x: Mapping[str, Any] = x) -> torch.Tensor:
            model.train()
            loss = model(**x).loss
            loss.backward()
            grads = torch.stack([p.grad.float().norm() for p in model.parameters()
                                 if p.grad is not None])
            model.zero_grad(set_to_none=True)
            model.eval()
            return torch.cat([loss.detach().float().reshape(1), grads])

        phases.append(_Phase("train", f"B{work.train_batch} x "
                                      f"{tokens(1, work.train_seqlen)} tokens",
                             tokens(work.train_batch, work.train_seqlen), step, step))
    for name in ("generate", "generate_static"):
        if name not in work.phases or spec.family not in DECODERS:
            continue
        prompt = ids(work.gen_batch, work.gen_prompt)
        mask = torch.ones_like(prompt)
        # one static cache for every call, emptied before each: generate's own would be a
        # new one a call, and the compiled step's CUDA graphs would be recorded again each
        # time (torch's cudagraph trees: "static input data pointer changed")
        caches = _ReusedCache(model, work.gen_prompt + work.new_tokens - 1) \
            if name == "generate_static" else None

        def generate(caches: _ReusedCache | None = caches, prompt: torch.Tensor = prompt,
                     mask: torch.Tensor = mask) -> torch.Tensor:
            extra = {} if caches is None else {"past_key_values": caches.emptied()}
            return _greedy(model, prompt, mask, work.new_tokens, **extra)

        prefill = infer({"input_ids": prompt, "logits_to_keep": 1})
        label = (f"B{work.gen_batch} x {work.gen_prompt} + {work.new_tokens} new"
                 + (", static cache" + (", CUDA graphs" if device == "cuda" else "")
                    if caches is not None else ""))
        phases.append(_Phase(name, label, work.gen_batch * work.new_tokens, generate,
                             generate, {"prefill": prefill}))
    return phases


class _ReusedCache:
    """A transformers ``StaticCache`` of ``max_cache_len`` slots (generate's own length for
    the phase: prompt + new tokens - 1), made once and emptied before each use, so its
    tensors keep their addresses from call to call (what a server that keeps its cache
    does; a compiled step's CUDA graphs are then recorded once)."""

    def __init__(self, model: Any, max_cache_len: int) -> None:
        self.model, self.max_cache_len = model, max_cache_len
        self.cache: Any = None

    def emptied(self) -> Any:
        if self.cache is None:
            from transformers import StaticCache

            self.cache = StaticCache(config=self.model.config,
                                     max_cache_len=self.max_cache_len)
        else:
            self.cache.reset()
        return self.cache


def _greedy(model: Any, prompt: torch.Tensor, mask: torch.Tensor, new_tokens: int,
            **options: Any) -> torch.Tensor:
    """The generation phases' workload: exactly ``new_tokens`` greedy tokens after
    ``prompt`` (``options``: e.g. a static cache); the new tokens."""
    with torch.no_grad():
        out = model.generate(input_ids=prompt, attention_mask=mask,
                             max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             do_sample=False, pad_token_id=0, **options)
    new: torch.Tensor = out[:, prompt.shape[1]:]
    return new


def _timer(device: str) -> Callable[[Callable[[], Any]], float]:
    def ms(fn: Callable[[], Any]) -> float:
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        return (time.perf_counter() - t) * 1e3
    return ms


def _rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    if got.dtype in (torch.int64, torch.int32):  # generated tokens: the share that differ
        return float((got != ref).float().mean())
    got, ref = got.float(), ref.float()
    return float((got - ref).norm() / ref.norm().clamp_min(1e-12))


def bench_model(spec: ModelSpec, work: Workload, *, contenders: Sequence[str] = DEFAULT_CONTENDERS,
                rounds: int = 3, interpret: bool = False,
                on_phase: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Run every phase of ``work`` on a model shaped ``spec`` for each contender (see the
    module doc) and return the run as a JSON-ready dict (``phases``: one row each, with
    ``ms`` per contender, ``speedup`` of flashtune over each, the rounds' spread and the
    fastest rounds' ratios (:func:`~flashtune.integrations.fresh_generation.round_stats`),
    the check, the fallbacks, the routes and attention's share). ``on_phase`` gets each row
    as it is measured.

    Raises:
        ValueError for an unknown contender or a spec that makes no model; RuntimeError
        without a GPU unless ``interpret``.
    """
    import transformers

    spec.check()
    unknown = [c for c in contenders if c not in CONTENDERS]
    if unknown:
        raise ValueError(f"unknown contenders {unknown}; choose from {', '.join(CONTENDERS)}")
    contenders = ["flashtune", *(c for c in contenders if c != "flashtune")]
    reference = REFERENCE.get(spec.family, "sdpa")
    if reference not in contenders:
        contenders.append(reference)  # the one every contender is checked against
    device = "cpu" if interpret else "cuda"
    if not interpret and not torch.cuda.is_available():
        raise RuntimeError("no CUDA GPU: bench --model measures a model on the GPU "
                           "(--interpret runs a tiny one on CPU to check the pipeline)")
    torch.manual_seed(0)
    model = spec.build(torch.bfloat16, device)
    ms = _timer(device)
    rows = []
    for phase in _phases(spec, work, model, device):
        row: dict[str, Any] = {"phase": phase.name, "label": phase.label,
                               "tokens": phase.tokens, "ms": {}, "errors": {}, "check": {}}
        ref = None
        outputs: dict[str, torch.Tensor] = {}
        for name in [reference, *(c for c in contenders if c != reference)]:
            try:
                with _contender(model, name):
                    if name == "flashtune":
                        reset_fallback_counts()
                        # eagerly: the probe's bookkeeping, traced, would recompile a
                        # compiled step (generate_static) until dynamo's limit sends it eager
                        with _probing(model) as calls, torch.compiler.set_stance("force_eager"):
                            outputs[name] = phase.output()
                        row["routes"] = list(calls.values())
                        row["fallbacks"] = fallback_counts()
                    else:
                        outputs[name] = phase.output()
            except Exception as exc:  # a backend that cannot run the model: data
                row["errors"][name] = _first_line(exc)
                continue
            if name == reference:
                ref = outputs[name]
            elif ref is None:  # nothing to check it against: not timed either
                row["errors"][name] = f"not checked: {reference}, the reference, failed"
            elif not (phase.name == "train" and spec.dropout):
                # (generated tokens are compared, not judged: one near-tie in bf16 changes
                # the rest; with dropout each run draws its own mask)
                row["check"][name] = err = _rel_err(outputs[name], ref)
                if not phase.name.startswith("generate") and err > TOL:
                    row["errors"][name] = (f"output differs from {reference}'s: relative "
                                           f"error {err:.2e} > {TOL}")
        timed = [c for c in contenders if c not in row["errors"]]
        samples: dict[str, list[float]] = {c: [] for c in timed}
        prefill: dict[str, list[float]] = {c: [] for c in timed}
        for name in timed:  # warm-up: compile, route, fill the caches
            with _contender(model, name):
                phase.run()
        for _ in range(rounds):
            for name in timed:
                with _contender(model, name):
                    samples[name].append(ms(phase.run))
                    if "prefill" in phase.extra:
                        prefill[name].append(ms(phase.extra["prefill"]))
        row.update(round_stats(samples))
        if "prefill" in phase.extra:
            row["prefill_ms"] = {c: statistics.median(xs) for c, xs in prefill.items()}
            row["decode_ms_per_token"] = {
                c: max(row["ms"][c] - row["prefill_ms"][c], 0.0) / work.new_tokens
                for c in timed}
        mine = row["ms"].get("flashtune")
        row["speedup"] = {c: t / mine for c, t in row["ms"].items()
                          if mine and c != "flashtune"}
        best = [row["ms"][c] for c in ("sdpa", "sdpa_cudnn") if c in row["ms"]]
        if mine and best:
            row["speedup_vs_best_of_sdpa_and_cudnn"] = min(best) / mine
        if device == "cuda":
            row["attention_share"] = {}
            for name in ("flashtune", reference):
                if name in timed:
                    with _contender(model, name):
                        row["attention_share"][name] = _profile_share(phase.run)
        rows.append(row)
        if on_phase is not None:
            on_phase(row)
    if "generate_new" in work.phases and spec.family in DECODERS:
        row = fresh_generation_row(spec, work, contenders, rounds, device, reference)
        rows.append(row)
        if on_phase is not None:
            on_phase(row)
    return {"benchmark": "model", "model": asdict(spec), "workload": asdict(work),
            "contenders": contenders, "rounds": rounds, "interpret": interpret,
            "device": torch.cuda.get_device_name() if device == "cuda" else "cpu-interpreter",
            "torch": torch.__version__, "transformers": transformers.__version__,
            "host": platform.node(), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
            "phases": rows}


def render_model(result: Mapping[str, Any]) -> str:
    """The closing table: ms per phase and contender, flashtune's speedup over each,
    attention's share, then the calls flashtune handed to torch."""
    contenders = list(result["contenders"])
    header = ["phase", "shape", *contenders, *(f"vs {c}" for c in contenders[1:]),
              "round spread", "attention share"]
    body = []
    for r in result["phases"]:
        share = r.get("attention_share", {})
        body.append([r["phase"], r["label"],
                     *(f"{r['ms'][c]:.2f}" if c in r["ms"] else "error" for c in contenders),
                     *(f"{r['speedup'][c]:.3f}x" if c in r.get("speedup", {}) else "-"
                       for c in contenders[1:]),
                     f"{max(r['spread'].values()):.0%}" if r.get("spread") else "-",
                     " / ".join(f"{c} {share[c]:.0%}" for c in share if share[c] is not None)
                     or "-"])
    widths = [max(len(str(x)) for x in col) for col in zip(header, *body)]
    lines = ["  ".join(str(x).ljust(w) if i < 2 else str(x).rjust(w)
                       for i, (x, w) in enumerate(zip(line, widths)))
             for line in [header, *body]]
    m = result["model"]
    lines.insert(0, f"{m['family']}: {m['layers']} layers, hidden {m['hidden']}, "
                    f"{m['heads']}:{m['kv_heads']} heads of "
                    f"{m.get('head_size') or m['hidden'] // m['heads']}, bf16, "
                    f"{result['device']} (ms, median of {result['rounds']} rounds; vs X: "
                    f"X's time over flashtune's; round spread: the widest contender's "
                    f"(max - min) / median, under which a ratio is not resolved)")
    for r in result["phases"]:
        spread = max(r.get("spread", {}).values(), default=0.0)
        fastest = r.get("speedup_fastest", {})
        if spread > UNRESOLVED and fastest:
            lines.append(f"{r['phase']} {r['label']}: rounds spread {spread:.0%}; fastest "
                         f"rounds: " + ", ".join(f"vs {c} {fastest[c]:.3f}x"
                                                 for c in contenders if c in fastest))
        if "decode_ms_per_token" in r:
            d = r["decode_ms_per_token"]
            lines.append(f"{r['phase']} {r['label']}: decode ms/token " + ", ".join(
                f"{c} {d[c]:.3f}" for c in contenders if c in d))
        for c, e in r["errors"].items():
            lines.append(f"{r['phase']} {r['label']}: {c} not timed: {e}")
        if "routes" not in r:  # generate_new: its contenders ran in processes of their own
            continue
        falls = r.get("fallbacks", {})
        total = sum(x["calls"] for x in r.get("routes", []))
        if falls:
            lines.append(f"{r['phase']} {r['label']}: {sum(falls.values())} of {total} "
                         f"attention calls fell back to torch: " + "; ".join(
                             f"{n} x {why}" for why, n in falls.items()))
        else:
            lines.append(f"{r['phase']} {r['label']}: all {total} attention calls ran on "
                         "flashtune's route: " + "; ".join(sorted(
                             {x['route'] for x in r.get("routes", [])})))
    return "\n".join(lines)


def fresh_child(job: Mapping[str, Any]) -> dict[str, Any]:
    """``generate_new``'s child process (:mod:`flashtune.integrations.fresh_generation`):
    builds the model as :func:`bench_model` does (seed 0), warms up one contender at a
    length past the rounds', then times a generation from each round's prompt length
    (:func:`~flashtune.integrations.fresh_generation.fresh_lengths`), the prompts prefixes of
    one seeded draw. Returns the round times, the lengths and the first round's tokens."""
    spec, work = ModelSpec(**job["spec"]), Workload(**job["work"])
    device, rounds = job["device"], job["rounds"]
    torch.manual_seed(0)
    model = spec.build(torch.bfloat16, device)
    warm, timed = fresh_lengths(work.gen_prompt, work.new_tokens, rounds)
    gen = torch.Generator(device=device).manual_seed(1)
    tokens = torch.randint(1, spec.vocab, (work.gen_batch, warm), device=device, generator=gen)
    out: dict[int, torch.Tensor] = {}

    def generate(n: int) -> None:
        prompt = tokens[:, :n]
        out[n] = _greedy(model, prompt, torch.ones_like(prompt), work.new_tokens)

    ms = _timer(device)
    with _contender(model, job["contender"]):
        generate(warm)
        samples = [ms(functools.partial(generate, n)) for n in timed]
    return {"ms": samples, "lengths": timed, "warmup_length": warm,
            "first_tokens": out[timed[0]].tolist()}


if __name__ == "__main__":  # generate_new's child: the job on stdin, the result on stdout
    import json
    import sys

    print(json.dumps(fresh_child(json.loads(sys.stdin.read()))))

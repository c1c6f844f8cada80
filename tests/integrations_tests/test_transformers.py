"""attn_implementation="flashtune" in Hugging Face transformers: a tiny randomly initialised
Llama-style model (no downloads) against the same weights with eager attention."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")

from transformers import AutoModelForCausalLM, LlamaConfig  # noqa: E402

import flashtune.integrations.transformers  # noqa: E402,F401  (registers "flashtune")
from flashtune.runtime import sdpa as sdpa_mod  # noqa: E402
from tests.conftest import DEVICE  # noqa: E402

DTYPE = torch.float16 if DEVICE == "cpu" else torch.bfloat16


def _config() -> LlamaConfig:
    return LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=256, pad_token_id=0, eos_token_id=None)


@pytest.fixture(scope="module")
def models():
    torch.manual_seed(0)
    ours = AutoModelForCausalLM.from_config(copy.deepcopy(_config()),
                                            attn_implementation="flashtune", dtype=DTYPE)
    eager = AutoModelForCausalLM.from_config(copy.deepcopy(_config()),
                                             attn_implementation="eager", dtype=DTYPE)
    eager.load_state_dict(ours.state_dict())
    return ours.to(DEVICE).eval(), eager.to(DEVICE).eval()


@pytest.fixture
def kernel_calls(monkeypatch):
    """How many attention calls reached flashtune's kernel (not torch's fallback)."""
    calls = []
    real = sdpa_mod.attention
    monkeypatch.setattr(sdpa_mod, "attention", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    return calls


def test_the_model_runs_flashtune(models):
    ours, eager = models
    assert ours.config._attn_implementation == "flashtune"
    assert eager.config._attn_implementation == "eager"


def test_prefill_logits_match_eager(models, kernel_calls):
    ours, eager = models
    ids = torch.randint(1, 128, (2, 37), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    with torch.no_grad():
        got, want = ours(ids).logits.float(), eager(ids).logits.float()
    assert len(kernel_calls) == 2  # one per layer, all on flashtune's kernel
    assert (got - want).abs().max().item() < 2e-2 * want.abs().max().item()


def test_greedy_generation_with_the_kv_cache_matches_eager(models, kernel_calls):
    ours, eager = models
    ids = torch.randint(1, 128, (1, 11), generator=torch.Generator().manual_seed(2)).to(DEVICE)
    new = 8
    got = ours.generate(ids, max_new_tokens=new, do_sample=False)
    want = eager.generate(ids, max_new_tokens=new, do_sample=False)
    assert got.tolist() == want.tolist()
    assert len(kernel_calls) == 2 * new  # prefill + 7 decode steps with one query row each


def test_padded_batches_use_the_mask_through_torch(models, kernel_calls):
    ours, eager = models
    ids = torch.randint(1, 128, (2, 13), generator=torch.Generator().manual_seed(3)).to(DEVICE)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # left padding in the second row
    with torch.no_grad():
        got = ours(ids, attention_mask=mask).logits.float()
        want = eager(ids, attention_mask=mask).logits.float()
    keep = mask.bool()
    assert (got[keep] - want[keep]).abs().max().item() < 2e-2 * want.abs().max().item()
    assert len(kernel_calls) == 0  # a padding mask is torch's job


def test_softcap_models_are_refused_clearly():
    from flashtune.integrations.transformers import flashtune_attention_forward

    q = torch.zeros(1, 2, 3, 16, dtype=DTYPE, device=DEVICE)
    with pytest.raises(ValueError, match="softcap"):
        flashtune_attention_forward(torch.nn.Module(), q, q, q, None, softcap=30.0)

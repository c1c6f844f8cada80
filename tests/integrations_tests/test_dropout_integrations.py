"""Attention dropout through the integrations (issue 31, item 2): torch's SDPA signature
(``flashtune.scaled_dot_product_attention``: served, not a fallback, masks included),
FlashAttention-2's functions (``dropout_p`` passed through), and transformers' BERT-family
training (``attention_probs_dropout_prob``) on flashtune's kernels; each the same bits as
``flashtune.attention`` / ``attention_varlen`` under the same torch seed."""

from __future__ import annotations

import copy

import pytest
import torch

import flashtune
from flashtune import flash_attn_interface as fa
from flashtune.core.errors import InputError
from flashtune.runtime import sdpa as sdpa_mod
from tests.conftest import DEVICE

P = 0.2


def rand(*shape, seed=0, grad=False):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).half().to(DEVICE).requires_grad_(grad)


def seeded(fn, seed=5):
    torch.manual_seed(seed)
    return fn()


def test_sdpa_serves_dropout_as_flashtune_attention():
    q, k, v = rand(2, 4, 9, 32), rand(2, 2, 20, 32, seed=1), rand(2, 2, 20, 32, seed=2)
    sdpa_mod.reset_fallback_counts()
    assert sdpa_mod.fallback_reason(q, k, v, dropout_p=P, is_causal=True,
                                    enable_gqa=True) is None
    got = seeded(lambda: flashtune.scaled_dot_product_attention(
        q, k, v, dropout_p=P, is_causal=True, enable_gqa=True))
    # top-left causal with Lq < Lk: the first Lq keys, flashtune's bottom-right there
    want = seeded(lambda: flashtune.attention(q, k[:, :, :9], v[:, :, :9], causal=True,
                                              dropout_p=P))
    assert torch.equal(got, want)
    assert sdpa_mod.fallback_counts() == {}
    assert sdpa_mod.describe_route(q, k, v, dropout_p=P, is_causal=True,
                                   enable_gqa=True).startswith("attn_fwd ")
    assert "dropout_p" in sdpa_mod.fallback_reason(q, k, v, dropout_p=1.0, enable_gqa=True)


def test_sdpa_serves_dropout_with_a_key_padding_mask():
    q, k = rand(2, 2, 12, 16), rand(2, 2, 12, 16, seed=1)
    mask = torch.ones(2, 1, 1, 12, dtype=torch.bool, device=DEVICE)
    mask[1, ..., 8:] = False  # right padding of the second element
    sdpa_mod.reset_fallback_counts()
    assert sdpa_mod.fallback_reason(q, k, k, attn_mask=mask, dropout_p=P) is None
    a = seeded(lambda: flashtune.scaled_dot_product_attention(q, k, k, attn_mask=mask,
                                                              dropout_p=P))
    b = seeded(lambda: flashtune.scaled_dot_product_attention(q, k, k, attn_mask=mask,
                                                              dropout_p=P))
    plain = flashtune.scaled_dot_product_attention(q, k, k, attn_mask=mask)
    assert torch.equal(a, b) and not torch.equal(a, plain) and torch.isfinite(a).all()
    assert sdpa_mod.fallback_counts() == {}


def test_flash_attn_func_passes_dropout_through():
    q, k, v = rand(2, 13, 4, 32), rand(2, 21, 2, 32, seed=1), rand(2, 21, 2, 32, seed=2)
    got = seeded(lambda: fa.flash_attn_func(q, k, v, P, causal=True))
    want = seeded(lambda: flashtune.attention(q.transpose(1, 2), k.transpose(1, 2),
                                              v.transpose(1, 2), causal=True, dropout_p=P))
    assert torch.equal(got, want.transpose(1, 2))
    assert not torch.equal(got, fa.flash_attn_func(q, k, v, 0.0, causal=True))


def test_flash_attn_qkvpacked_and_varlen_train_with_dropout():
    qkv = rand(1, 17, 3, 2, 16, grad=True)
    out = seeded(lambda: fa.flash_attn_qkvpacked_func(qkv, P, causal=True))
    out.float().sum().backward()
    assert qkv.grad is not None and torch.isfinite(qkv.grad).all()
    q, k, v = rand(30, 2, 16, grad=True), rand(30, 2, 16, seed=1), rand(30, 2, 16, seed=2)
    cu = torch.tensor([0, 12, 30], dtype=torch.int32, device=DEVICE)
    got = seeded(lambda: fa.flash_attn_varlen_func(q, k, v, cu, cu, 18, 18, P, causal=True))
    want = seeded(lambda: flashtune.attention_varlen(q, k, v, cu, cu, 18, 18, causal=True,
                                                     dropout_p=P))
    assert torch.equal(got, want)


def test_the_paged_varlen_call_refuses_dropout_naming_it():
    q = rand(5, 2, 16)
    cache = rand(2, 16, 2, 16)
    cu = torch.tensor([0, 5], dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([0, 9], dtype=torch.int32, device=DEVICE)
    table = torch.tensor([[0, 1]], dtype=torch.int32, device=DEVICE)
    with pytest.raises(InputError, match="dropout_p=0.2"):
        fa.flash_attn_varlen_func(q, cache, cache, cu, cu_k, 5, 9, P, block_table=table)


def test_bert_training_with_attention_dropout_runs_flashtune():
    """A tiny BERT (attention_probs_dropout_prob 0.1) with attn_implementation="flashtune":
    in training every layer's attention runs flashtune's kernels with dropout 0.1 (plain
    batches through the SDPA signature, padded ones unpadded), nothing falls back to torch,
    gradients flow; in evaluation the output is eager's."""
    pytest.importorskip("transformers")
    from transformers import BertConfig, BertModel

    import flashtune.integrations.transformers as integration

    cfg = BertConfig(vocab_size=64, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=128, max_position_embeddings=64,
                     attention_probs_dropout_prob=0.1, hidden_dropout_prob=0.0)
    torch.manual_seed(0)
    ours = BertModel._from_config(copy.deepcopy(cfg), attn_implementation="flashtune",
                                  dtype=torch.float16).to(DEVICE)
    eager = BertModel._from_config(copy.deepcopy(cfg), attn_implementation="eager",
                                   dtype=torch.float16).to(DEVICE)
    eager.load_state_dict(ours.state_dict())
    ids = torch.randint(1, 64, (2, 20), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    mask = torch.ones_like(ids)
    mask[1, 15:] = 0
    drops = []
    real_attention, real_varlen = sdpa_mod.attention, integration._varlen
    sdpa_mod.reset_fallback_counts()
    try:
        sdpa_mod.attention = lambda *a, **kw: drops.append(kw["dropout_p"]) or \
            real_attention(*a, **kw)
        integration._varlen = lambda *a, **kw: drops.append(kw["dropout_p"]) or \
            real_varlen(*a, **kw)
        ours.train()
        out = ours(ids).last_hidden_state
        out.float().sum().backward()
        ours(ids, attention_mask=mask).last_hidden_state.float().sum().backward()
        assert drops == [0.1] * 4  # two layers, two batches
        assert sdpa_mod.fallback_counts() == {}
        assert all(p.grad is None or torch.isfinite(p.grad).all() for p in ours.parameters())
        ours.eval()
        with torch.no_grad():
            got = ours(ids, attention_mask=mask).last_hidden_state.float()
            want = eager.eval()(ids, attention_mask=mask).last_hidden_state.float()
        keep = mask.bool()
        assert (got[keep] - want[keep]).abs().max().item() < 2e-2 * want.abs().max().item()
        assert drops[4:] == [0.0] * 2  # evaluation: no dropout
    finally:
        sdpa_mod.attention, integration._varlen = real_attention, real_varlen

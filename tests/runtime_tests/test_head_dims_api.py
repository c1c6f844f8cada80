"""Every head dim 1..256 through the public ops (issue 31, item 1): flashtune.attention
forward and gradients, scaled_dot_product_attention served instead of falling back to torch,
attention_varlen, the transformers integration for a head dim that used to fall back, and
the refusal of head dims over 256. Interpreter-sized shapes."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import flashtune
from flashtune.core.errors import InputError
from flashtune.kernel_templates.attn_fwd.reference import attn_fwd_reference
from flashtune.runtime import sdpa as sdpa_mod
from tests.conftest import DEVICE
from tests.helpers import assert_close_to_reference, assert_grads_close


def _leaf(shape, dtype, g, layout):
    """A leaf tensor and its ``(B, H, N, D)`` view (``bnhd``: transposed storage)."""
    b, h, n, d = shape
    if layout == "bnhd":
        leaf = torch.randn(b, n, h, d, generator=g).to(dtype).to(DEVICE).requires_grad_(True)
        return leaf, leaf.transpose(1, 2)
    leaf = torch.randn(b, h, n, d, generator=g).to(dtype).to(DEVICE).requires_grad_(True)
    return leaf, leaf


@pytest.mark.parametrize("d,hq,hkv,nq,nk,causal,dtype,layout", [
    (40, 4, 2, 21, 34, True, torch.float16, "bhnd"),   # SD 1.x's head dim, GQA, Nq < Nk
    (59, 2, 2, 27, 27, False, torch.bfloat16, "bnhd"),  # odd: plain loads, strided views
    (3, 2, 1, 19, 25, True, torch.float16, "bhnd"),    # tiny: a 16-wide tile, MQA
], ids=["d40", "d59", "d3"])
def test_attention_forward_and_gradients(d, hq, hkv, nq, nk, causal, dtype, layout):
    g = torch.Generator().manual_seed(d)
    (lq, q), (lk, k), (lv, v) = (_leaf((1, h, n, d), dtype, g, layout)
                                 for h, n in ((hq, nq), (hkv, nk), (hkv, nk)))
    out = flashtune.attention(q, k, v, causal=causal)
    assert_close_to_reference(out.detach(), q.detach(), k.detach(), v.detach(), causal=causal)
    dout = torch.randn(out.shape, generator=g).to(dtype).to(DEVICE)
    out.backward(dout)
    grads = tuple(t.grad.transpose(1, 2) if layout == "bnhd" else t.grad for t in (lq, lk, lv))
    assert_grads_close(grads, q.detach(), k.detach(), v.detach(), dout, causal=causal)


@pytest.mark.parametrize("d", [80, 111])
def test_scaled_dot_product_attention_serves_them_instead_of_falling_back(d):
    g = torch.Generator().manual_seed(d)
    q, k, v = (torch.randn(1, 2, 23, d, generator=g).half().to(DEVICE) for _ in range(3))
    assert sdpa_mod.fallback_reason(q, k, v, is_causal=True) is None
    sdpa_mod.reset_fallback_counts()
    got = flashtune.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert sdpa_mod.fallback_counts() == {}
    assert_close_to_reference(got, q, k, v, causal=True)
    want = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)
    assert (got.float() - want).abs().max().item() < 1e-2


def test_attention_varlen_at_an_odd_head_dim():
    lens = [13, 1, 22]
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(sum(lens), h, 59, generator=g).half().to(DEVICE) for h in (4, 2, 2))
    cu = torch.tensor([0, 13, 14, 36], dtype=torch.int32, device=DEVICE)
    out = flashtune.attention_varlen(q, k, v, cu, cu, 22, 22, causal=True)
    for b in range(3):
        s = slice(int(cu[b]), int(cu[b + 1]))
        one = [t[s].transpose(0, 1)[None] for t in (q, k, v)]
        ref, _ = attn_fwd_reference(*one, causal=True)
        err = (out[s].transpose(0, 1)[None].double() - ref).abs().max().item()
        assert err < 5e-3, (b, err)


@pytest.mark.parametrize("d", [0, 257])
def test_head_dims_out_of_range_are_refused_or_fall_back(d):
    q = torch.zeros(1, 1, 4, d, dtype=torch.float16, device=DEVICE)
    with pytest.raises(InputError, match="head_dim|empty"):
        flashtune.attention(q, q, q)
    reason = sdpa_mod.fallback_reason(q, q, q)
    assert reason is not None and ("head_dim 257 (flashtune serves 1 to 256)" in reason
                                   or "empty" in reason)


def test_transformers_runs_flashtune_at_head_dim_40():
    """A Llama-style model with 2 heads of 40 (hidden 80): every attention call reaches
    flashtune's kernel, none falls back, and the logits match eager attention's."""
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM, LlamaConfig

    import flashtune.integrations.transformers  # noqa: F401  (registers "flashtune")

    config = LlamaConfig(vocab_size=64, hidden_size=80, intermediate_size=96,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                         max_position_embeddings=64, pad_token_id=0, eos_token_id=None)
    assert config.hidden_size // config.num_attention_heads == 40
    torch.manual_seed(0)
    ours = AutoModelForCausalLM.from_config(copy.deepcopy(config),
                                            attn_implementation="flashtune",
                                            dtype=torch.float16).to(DEVICE).eval()
    eager = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="eager",
                                             dtype=torch.float16).to(DEVICE).eval()
    eager.load_state_dict(ours.state_dict())
    ids = torch.randint(1, 64, (2, 19), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    sdpa_mod.reset_fallback_counts()
    with torch.no_grad():
        got, want = ours(ids).logits.float(), eager(ids).logits.float()
    assert sdpa_mod.fallback_counts() == {}
    assert (got - want).abs().max().item() < 2e-2 * want.abs().max().item()

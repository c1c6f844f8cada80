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


def _ours_and_eager(config, auto=AutoModelForCausalLM, dtype=DTYPE):
    """The same random weights (seed 0) with attention "flashtune" and "eager", on DEVICE,
    in eval mode."""
    torch.manual_seed(0)
    ours = auto.from_config(copy.deepcopy(config), attn_implementation="flashtune",
                            dtype=dtype)
    eager = auto.from_config(copy.deepcopy(config), attn_implementation="eager", dtype=dtype)
    eager.load_state_dict(ours.state_dict())
    return ours.to(DEVICE).eval(), eager.to(DEVICE).eval()


@pytest.fixture(scope="module")
def models():
    return _ours_and_eager(_config())


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


@pytest.fixture
def varlen_calls(monkeypatch):
    """How many attention calls ran as a packed batch on flashtune's kernels."""
    from flashtune.integrations import transformers as integration

    calls = []
    real = integration._varlen
    monkeypatch.setattr(integration, "_varlen", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    return calls


def test_padded_batches_run_unpadded_on_flashtune(models, kernel_calls, varlen_calls):
    ours, eager = models
    ids = torch.randint(1, 128, (2, 13), generator=torch.Generator().manual_seed(3)).to(DEVICE)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # left padding in the second row
    with torch.no_grad():
        got = ours(ids, attention_mask=mask).logits.float()
        want = eager(ids, attention_mask=mask).logits.float()
    keep = mask.bool()
    assert (got[keep] - want[keep]).abs().max().item() < 2e-2 * want.abs().max().item()
    assert len(kernel_calls) == 0 and len(varlen_calls) == 2  # unpadded, one per layer


def test_padding_free_batches_keep_sequences_apart(models, varlen_calls):
    ours, eager = models
    g = torch.Generator().manual_seed(4)
    a, b = torch.randint(1, 128, (1, 9), generator=g), torch.randint(1, 128, (1, 14), generator=g)
    row = torch.cat((a, b), 1).to(DEVICE)
    positions = torch.cat((torch.arange(9), torch.arange(14)))[None].to(DEVICE)
    with torch.no_grad():
        got = ours(row, position_ids=positions).logits.float()
        want = torch.cat((eager(a.to(DEVICE)).logits, eager(b.to(DEVICE)).logits), 1).float()
    assert len(varlen_calls) == 2
    assert (got - want).abs().max().item() < 2e-2 * want.abs().max().item()


def test_gemma2_softcap_and_sliding_window_run_on_flashtune(varlen_calls):
    from transformers import Gemma2Config

    config = Gemma2Config(vocab_size=128, hidden_size=64, intermediate_size=128,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=16, sliding_window=8, attn_logit_softcapping=5.0,
                          final_logit_softcapping=None, query_pre_attn_scalar=16,
                          max_position_embeddings=256, pad_token_id=0)
    ours, eager = _ours_and_eager(config)
    assert ours.config.layer_types[0] == "sliding_attention"
    from flashtune.runtime import scored

    seen = []
    real = scored._run
    scored_calls = lambda *a, **k: seen.append(a[-1]) or real(*a, **k)  # noqa: E731
    ids = torch.randint(1, 128, (2, 29), generator=torch.Generator().manual_seed(5)).to(DEVICE)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    with pytest.MonkeyPatch.context() as mp, torch.no_grad():
        mp.setattr(scored, "_run", scored_calls)
        got = ours(ids).logits.float()
        want = eager(ids).logits.float()
        got_padded = ours(ids, attention_mask=mask).logits.float()
        want_padded = eager(ids, attention_mask=mask).logits.float()
    assert (got - want).abs().max().item() < 3e-2 * want.abs().max().item()
    keep = mask.bool()
    assert (got_padded[keep] - want_padded[keep]).abs().max().item() \
        < 3e-2 * want_padded.abs().max().item()
    # every layer ran a softcap on flashtune, the sliding layer with its window
    assert len(seen) == 4 and all(o["softcap"] == 5.0 for o in seen)
    assert [o["window"] for o in seen[:2]] == [(7, 0), (-1, 0)]


@pytest.fixture
def step_calls(monkeypatch):
    """The masks of the calls that ran as a generation step over the whole cache."""
    from flashtune.integrations import transformers as integration

    masks = []
    real = integration.attention_static_cache
    monkeypatch.setattr(integration, "attention_static_cache",
                        lambda q, k, v, mask, **kw: masks.append(mask) or real(q, k, v, mask, **kw))
    return masks


def test_generation_with_a_static_cache_matches_eager(models, varlen_calls, step_calls):
    """A static cache hands attention K/V of the cache's full length. flashtune's mask
    builder pads the padding mask with the empty slots (False), so every step sees a mask of
    the same shape, and the steps run over the cache as it is (lengths from the mask on the
    device): no copy, no sync, nothing attended in the empty slots."""
    ours, eager = models
    ids = torch.randint(1, 128, (2, 9), generator=torch.Generator().manual_seed(6)).to(DEVICE)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding
    kw = dict(attention_mask=mask, max_new_tokens=5, do_sample=False,
              cache_implementation="static")
    got = ours.generate(ids, **kw)
    want = eager.generate(ids, **kw)
    assert got.tolist() == want.tolist()
    assert not varlen_calls  # no unpadding: the prompt (9 rows) and the steps are steps
    shapes = {tuple(m.shape) for m in step_calls}
    assert len(shapes) == 1  # one shape, the whole cache's, whatever the step
    # on a GPU transformers compiles the steps (CUDA graphs): Python sees the traced calls
    # only, not each replay
    assert len(step_calls) >= (2 if DEVICE == "cuda" else 2 * 5)
    first = step_calls[0]
    assert not first[0, :3].any() and first[1, :3].all()  # the left padding stays out


def test_generation_steps_with_left_padding_and_a_dynamic_cache(models, varlen_calls,
                                                                step_calls):
    """A left-padded batch decoding over a dynamic cache: its steps (one query row, more
    keys, a mask of one run per row) run over the cache without unpadding it."""
    ours, eager = models
    ids = torch.randint(1, 128, (3, 7), generator=torch.Generator().manual_seed(8)).to(DEVICE)
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    mask[2, :5] = 0
    kw = dict(attention_mask=mask, max_new_tokens=4, do_sample=False)
    got = ours.generate(ids, **kw)
    want = eager.generate(ids, **kw)
    assert got.tolist() == want.tolist()
    assert len(step_calls) == 2 * 3  # 3 decode steps, 2 layers; the prompt ran unpadded
    assert len(varlen_calls) == 2


@pytest.mark.parametrize("cache,chunk,padding", [
    ("dynamic", 17, None), ("dynamic", 17, "ones"), ("dynamic", 17, "left"),
    ("dynamic", 3, None), ("static", 3, None), ("static", 17, None)])
def test_a_later_chunk_against_the_cache_matches_eager(models, cache, chunk, padding):
    """A prompt's later chunk over the cache of its first (chunked prefill, a second turn):
    several query rows against more keys. FA2's mask builder hands a dynamic cache's chunk
    no mask and FA2 aligns causal bottom-right, so query i sees the cache and the chunk up
    to i (torch's top-left is_causal would see the first i + 1 keys: wrong logits, as this
    integration gave before); a static cache without a mask sees its tokens only, not the
    empty slots. Logits of the chunk against eager's with the same cache."""
    from transformers import DynamicCache, StaticCache

    ours, eager = models
    config = ours.config
    ids = torch.randint(1, 128, (2, 21 + chunk), generator=torch.Generator().manual_seed(9))
    ids = ids.to(DEVICE)
    mask = None if padding is None else torch.ones_like(ids)
    if padding == "left":
        mask[1, :5] = 0
    got = []
    for model in (ours, eager):
        past = DynamicCache(config=config) if cache == "dynamic" \
            else StaticCache(config=config, max_cache_len=64)
        with torch.no_grad():
            for start, end in ((0, 21), (21, 21 + chunk)):
                kw = {} if mask is None else {"attention_mask": mask[:, :end]}
                logits = model(ids[:, start:end], past_key_values=past, use_cache=True,
                               cache_position=torch.arange(start, end, device=DEVICE),
                               **kw).logits.float()
        got.append(logits)
    keep = slice(None) if mask is None else mask[:, 21:].bool()
    diff = (got[0] - got[1])[keep].abs().max().item()
    assert diff < 2e-2 * got[1].abs().max().item(), diff


def test_the_mask_builder_gives_a_cache_without_a_mask_its_tokens():
    """No padding mask: a dynamic cache (its keys are its tokens) and no cache get None;
    a static cache before it fills gets its tokens' mask, a step's over the whole cache
    (compared on the device from the tensor offset a static layer gives)."""
    from flashtune.integrations.transformers import flashtune_attention_mask

    assert flashtune_attention_mask(2, 40, 40) is None
    assert flashtune_attention_mask(2, 1, 64) is None  # no offset given: none made up
    assert flashtune_attention_mask(2, 17, 38, q_offset=21) is None
    chunk = flashtune_attention_mask(2, 17, 64, q_offset=torch.tensor(21))
    assert chunk.shape == (2, 38) and chunk.dtype == torch.bool and chunk.all()
    step = flashtune_attention_mask(2, 1, 64, q_offset=torch.tensor(21))
    assert step.shape == (2, 64) and step[:, :22].all() and not step[:, 22:].any()
    assert flashtune_attention_mask(2, 1, 22, q_offset=torch.tensor(21)) is None  # full


def test_the_mask_builder_keeps_a_steps_shape():
    """FA2's builder for the prefill and for caches it covers; for a step over a static
    cache the whole cache's mask, padded with empty slots; while compiling no mask.all()."""
    from flashtune.integrations.transformers import flashtune_attention_mask

    ones = torch.ones(2, 6, dtype=torch.long)
    assert flashtune_attention_mask(2, 6, 6, attention_mask=ones) is None  # FA2's: plain causal
    assert flashtune_attention_mask(2, 1, 6, attention_mask=ones) is None
    padded = flashtune_attention_mask(2, 1, 10, attention_mask=ones)
    assert padded.shape == (2, 10) and padded.dtype == torch.bool
    assert padded[:, :6].all() and not padded[:, 6:].any()
    long_prompt = flashtune_attention_mask(2, 40, 64, attention_mask=torch.ones(2, 40))
    assert long_prompt.shape == (2, 40)  # FA2's: K/V sliced to it by the attention call
    seen = []

    def step(mask):
        seen.append(flashtune_attention_mask(2, 1, 6, attention_mask=mask))
        return mask

    torch.compile(step, backend="eager", fullgraph=True)(ones)  # no data-dependent branch
    assert seen and seen[0] is not None and tuple(seen[0].shape) == (2, 6)


@pytest.mark.parametrize("term", ["position_bias", "s_aux"])
def test_a_score_term_flashtune_does_not_add_is_refused_not_dropped(term):
    """T5's position bias and gpt-oss's attention sinks change every row's softmax: a call
    that brings one is refused with the argument's name, not run without it."""
    from flashtune.integrations.transformers import flashtune_attention_forward, sdpa_arguments

    q = torch.zeros(1, 2, 4, 16, dtype=DTYPE)
    k = v = torch.zeros(1, 2, 4, 16, dtype=DTYPE)
    layer = torch.nn.Module()
    extra = {term: torch.zeros(2)}
    with pytest.raises(ValueError, match=f"does not support `{term}`"):
        flashtune_attention_forward(layer, q, k, v, None, **extra)
    with pytest.raises(ValueError, match=f"does not support `{term}`"):
        sdpa_arguments(layer, q, k, v, None, **extra)


def test_mla_a_value_head_narrower_than_the_querys_runs_padded():
    """DeepSeek-V3's MLA: the query and key heads (24 here) are wider than the value's (16).
    Both layers dense (no expert routing, whose top-k a rounding difference can flip).
    The value is zero-padded to the query's head dim and the output cropped, as
    transformers' FA2 path does, so the padded prefill and a later chunk against the cache
    run on flashtune's kernels (a chunk was refused: k and v of different shapes)."""
    from transformers import DeepseekV3Config, DynamicCache

    config = DeepseekV3Config(vocab_size=128, hidden_size=64, intermediate_size=64,
                              moe_intermediate_size=32, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=4, n_routed_experts=2,
                              num_experts_per_tok=1, n_group=1, topk_group=1, kv_lora_rank=16,
                              q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=16,
                              v_head_dim=16, first_k_dense_replace=2,
                              max_position_embeddings=128, pad_token_id=0)
    ours, eager = _ours_and_eager(config)
    ids = torch.randint(1, 128, (2, 40), generator=torch.Generator().manual_seed(3)).to(DEVICE)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    got = []
    for model in (ours, eager):
        past = DynamicCache(config=config)
        with torch.no_grad():
            padded = model(ids[:, :21], attention_mask=mask[:, :21], past_key_values=past,
                           use_cache=True).logits.float()
            chunk = model(ids[:, 21:], attention_mask=mask, past_key_values=past,
                          use_cache=True).logits.float()
        got.append((padded[mask[:, :21].bool()], chunk))
    tol = 2e-2 if DTYPE == torch.float16 else 4e-2  # bfloat16: 8 bits of mantissa
    for a, b in zip(*got, strict=True):
        assert (a - b).abs().max().item() < tol * b.abs().max().item()


@pytest.mark.parametrize("padding", [None, "left", "right"])
def test_mixed_precision_training_under_autocast_runs_flashtune(kernel_calls, varlen_calls,
                                                               padding):
    """float32 weights under autocast: the rotary embedding's float32 cos/sin hand the
    attention float32 queries and keys. They run in autocast's dtype, as transformers' FA2
    path casts them (a padded batch was refused: q must be float16 or bfloat16; one without
    padding ran torch's float32 SDPA); the gradients match eager's under the same autocast,
    the loss taken on the tokens a padded row predicts from real ones."""
    ours, eager = _ours_and_eager(_config(), dtype=torch.float32)
    ids = torch.randint(1, 128, (2, 23), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    mask, labels = None, ids.clone()
    if padding is not None:
        mask = torch.ones_like(ids)
        pad = slice(None, 5) if padding == "left" else slice(-5, None)
        mask[1, pad] = 0
        labels[mask == 0] = -100
        labels[1, 5] = -100 if padding == "left" else labels[1, 5]  # predicted from padding
    grads = []
    for model in (ours, eager):
        model.train()
        with torch.autocast(DEVICE, dtype=DTYPE):
            model(ids, attention_mask=mask, labels=labels).loss.backward()
        grads.append(model.model.layers[0].self_attn.q_proj.weight.grad)
    tol = 1e-2 if DTYPE == torch.float16 else 4e-2  # bfloat16: 8 bits of mantissa
    assert ((grads[0] - grads[1]).norm() / grads[1].norm()).item() < tol
    # one call per layer on flashtune's kernels: unpadded, or through the SDPA drop-in
    assert (len(kernel_calls), len(varlen_calls)) == ((2, 0) if padding is None else (0, 2))


class _Decoder(torch.nn.Module):  # BART's and Whisper's encoder_attn
    is_decoder, is_causal = True, False


class _Flagged(torch.nn.Module):
    is_cross_attention, is_causal = True, False


class BertCrossAttention(torch.nn.Module):  # named so in transformers
    is_causal = False


@pytest.mark.parametrize("layer", [_Decoder, _Flagged, BertCrossAttention])
@pytest.mark.parametrize("lq", [19, 23])
@pytest.mark.parametrize("padding", ["left", "right"])
def test_cross_attention_keeps_every_query_row_of_the_other_sequence(layer, lq, padding):
    """Cross-attention's mask is the encoder's, over the keys only: every decoder query row
    attends to its sequence's real keys (as eager does). The mask's last Lq positions, what
    a padded self-attention's query rows are, said nothing of them: rows were dropped or
    misplaced (errors of 1-2 on outputs of magnitude 1), with a decoder longer than 16 rows
    or as long as the encoder."""
    from flashtune.integrations.transformers import flashtune_attention_forward

    g = torch.Generator().manual_seed(lq)
    q = torch.randn(2, 4, lq, 16, generator=g).to(DEVICE, DTYPE)
    k, v = (torch.randn(2, 2, 19, 16, generator=g).to(DEVICE, DTYPE) for _ in range(2))
    mask = torch.ones(2, 19, dtype=torch.bool, device=DEVICE)
    mask[1, slice(None, 6) if padding == "left" else slice(-6, None)] = False
    out, _ = flashtune_attention_forward(layer(), q, k, v, mask)
    scores = q.double() @ k.double().repeat_interleave(2, 1).transpose(-1, -2) / 4.0
    scores = scores.masked_fill(~mask[:, None, None, :], float("-inf"))
    want = (scores.softmax(-1) @ v.double().repeat_interleave(2, 1)).transpose(1, 2)
    assert (out.double() - want).abs().max().item() < 3e-2  # the bug: errors of 1-2


def test_bart_cross_attention_is_told_from_self_attention(monkeypatch):
    """In a real encoder-decoder (BART) the layers say which attention is which: the
    encoder's self-attention drops its padded query rows (FA2's reading of the mask), the
    decoder's cross-attention keeps every row; the logits match eager's."""
    from transformers import AutoModelForSeq2SeqLM, BartConfig

    from flashtune.integrations import transformers as integration

    config = BartConfig(vocab_size=128, d_model=64, encoder_layers=1, decoder_layers=1,
                        encoder_attention_heads=4, decoder_attention_heads=4,
                        encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
                        pad_token_id=1)
    ours, eager = _ours_and_eager(config, AutoModelForSeq2SeqLM)
    seen = []
    real = integration._padded
    monkeypatch.setattr(integration, "_padded", lambda q, k, v, mask, options, rows=True:
                        seen.append((q.shape[2], k.shape[2], rows))
                        or real(q, k, v, mask, options, rows))
    g = torch.Generator().manual_seed(1)
    src = torch.randint(3, 128, (2, 19), generator=g).to(DEVICE)
    tgt = torch.randint(3, 128, (2, 23), generator=g).to(DEVICE)
    mask = torch.ones_like(src)
    mask[1, -6:] = 0
    with torch.no_grad():
        got = ours(input_ids=src, attention_mask=mask, decoder_input_ids=tgt).logits.float()
        want = eager(input_ids=src, attention_mask=mask, decoder_input_ids=tgt).logits.float()
    assert seen == [(19, 19, True), (23, 19, False)]  # encoder self-, decoder cross-
    assert (got - want).abs().max().item() < 2e-2 * want.abs().max().item()

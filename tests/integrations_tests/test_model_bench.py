"""flashtune.integrations.model_bench (``flashtune bench --model``): the tiny models under the
interpreter run every phase, are checked against sdpa, and report fallbacks and routes."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

pytest.importorskip("transformers")

from flashtune.integrations import model_bench as mb  # noqa: E402
from tests.conftest import DEVICE  # noqa: E402


def _run(family, rounds=1, **work):
    spec = mb.TINY[family]
    w = replace(mb.default_workload(family, tiny=True), **work)
    return mb.bench_model(spec, w, contenders=("flashtune", "sdpa"), rounds=rounds,
                          interpret=DEVICE == "cpu")


def test_llama_runs_every_phase_on_flashtune_checked_against_sdpa():
    assert mb.default_workload("llama").phases == ("prefill", "train", "generate",
                                                   "generate_static", "generate_new")
    result = _run("llama", rounds=2, phases=("prefill", "train", "generate", "generate_static"))
    json.dumps(result)  # JSON-ready as it is
    rows = {r["phase"]: r for r in result["phases"]}
    assert list(rows) == ["prefill", "train", "generate", "generate_static"]
    for name in ("prefill", "train"):
        r = rows[name]
        assert r["errors"] == {}, r["errors"]
        assert 0 <= r["check"]["flashtune"] <= mb.TOL
        assert set(r["ms"]) == {"flashtune", "sdpa"} and r["ms"]["flashtune"] > 0
        assert r["speedup"]["sdpa"] == pytest.approx(r["ms"]["sdpa"] / r["ms"]["flashtune"])
        xs = r["round_ms"]["sdpa"]
        assert len(xs) == 2 and r["ms"]["sdpa"] == pytest.approx(sum(xs) / 2)
        assert r["spread"]["sdpa"] == pytest.approx(abs(xs[0] - xs[1]) / r["ms"]["sdpa"])
        assert r["spread"]["sdpa"] > 0  # two host timings of the CPU run never agree exactly
        assert r["speedup_fastest"]["sdpa"] == pytest.approx(
            min(xs) / min(r["round_ms"]["flashtune"]))
        assert r["fallbacks"] == {}
        # one attention call per layer, every one on flashtune's own route
        assert sum(c["calls"] for c in r["routes"]) == mb.TINY["llama"].layers
        assert all(not c["route"].startswith("torch") for c in r["routes"])
    assert any("causal" in c["call"] and "grad" in c["call"] for c in rows["train"]["routes"])
    gen = rows["generate"]
    w = mb.default_workload("llama", tiny=True)
    # the prompt's forward, then one step per new token after the first, per layer
    assert sum(c["calls"] for c in gen["routes"]) == w.new_tokens * mb.TINY["llama"].layers
    assert any(c["call"].startswith("q (2, 4, 1, 16)") for c in gen["routes"])  # decode
    assert gen["decode_ms_per_token"]["flashtune"] >= 0
    assert 0 <= gen["check"]["flashtune"] <= 1  # the share of generated tokens that differ
    static = rows["generate_static"]
    assert static["errors"] == {} and "static cache" in static["label"]
    # the prompt (12 rows, more keys: the cache) and the steps run over the whole cache; the
    # last step fills the cache, and FA2's builder drops a mask of nothing but tokens there
    assert sum(c["calls"] for c in static["routes"]) == w.new_tokens * mb.TINY["llama"].layers
    steps = [c for c in static["routes"] if c["call"].endswith(" mask")]
    assert sum(c["calls"] for c in steps) == (w.new_tokens - 1) * mb.TINY["llama"].layers
    assert all(c["route"].startswith("attn_decode: a generation step") for c in steps), \
        json.dumps(static["routes"])
    cache = f" k (2, 2, {w.gen_prompt + w.new_tokens - 1}, 16) "
    assert all(cache in c["call"] for c in static["routes"])  # one key shape: the whole cache
    assert static["check"]["flashtune"] == 0  # the same tokens as sdpa's
    text = mb.render_model(result)
    assert "generate" in text and "all 6 attention calls ran on flashtune's route" in text


def test_the_static_phase_keeps_one_cache_emptied_between_calls():
    """generate_static's cache is made once: the same tensors every call (a compiled step's
    CUDA graphs are not recorded again), emptied before each, so each call generates what
    a fresh cache does."""
    spec, w = mb.TINY["llama"], mb.default_workload("llama", tiny=True)
    torch.manual_seed(0)
    model = spec.build(torch.bfloat16, DEVICE)
    prompt = torch.randint(1, spec.vocab, (w.gen_batch, w.gen_prompt), device=DEVICE)
    mask = torch.ones_like(prompt)
    reused = mb._ReusedCache(model, w.gen_prompt + w.new_tokens - 1)
    fresh = mb._greedy(model, prompt, mask, w.new_tokens, cache_implementation="static")
    first = mb._greedy(model, prompt, mask, w.new_tokens, past_key_values=reused.emptied())
    keys = reused.cache.layers[0].keys
    second = mb._greedy(model, prompt, mask, w.new_tokens, past_key_values=reused.emptied())
    assert reused.cache.layers[0].keys is keys
    assert keys.data_ptr() == reused.cache.layers[0].keys.data_ptr()
    assert torch.equal(first, fresh) and torch.equal(second, fresh)


def test_round_stats_and_the_fastest_rounds_of_a_swinging_phase():
    """A phase's rounds give the median, the spread and each contender's fastest round over
    flashtune's; the table adds the fastest rounds' ratios where the rounds swing past
    UNRESOLVED (generation on a busy host), not where they agree."""
    from flashtune.integrations.fresh_generation import round_stats

    stats = round_stats({"flashtune": [650.0, 1000.0, 660.0], "sdpa": [990.0, 700.0, 640.0]})
    assert stats["ms"] == {"flashtune": 660.0, "sdpa": 700.0}
    assert stats["spread"]["flashtune"] == pytest.approx(350 / 660)
    assert stats["speedup_fastest"] == {"sdpa": pytest.approx(640 / 650)}
    steady = round_stats({"flashtune": [100.0, 101.0], "sdpa": [110.0, 111.0]})
    result = {"contenders": ["flashtune", "sdpa"], "rounds": 3, "device": "x",
              "model": {"family": "llama", "layers": 1, "hidden": 64, "heads": 4,
                        "kv_heads": 2},
              "phases": [{"phase": "generate", "label": "swinging", "errors": {},
                          "speedup": {"sdpa": 700 / 660}, **stats},
                         {"phase": "prefill", "label": "steady", "errors": {},
                          "speedup": {"sdpa": 1.1}, **steady}]}
    text = mb.render_model(result)
    assert "generate swinging: rounds spread 53%; fastest rounds: vs sdpa 0.985x" in text
    assert "steady: rounds spread" not in text


def test_gemma3_runs_its_local_layers_in_a_window_checked_against_sdpa():
    """Gemma 3's local layers reach flashtune as a sliding window (transformers hands SDPA
    an explicit mask for them): the tiny model's prompts outrun its window of 8, so a
    window dropped or misread would fail the check against sdpa's masked output."""
    spec = mb.TINY["gemma3"]
    assert spec.layer_types == ["sliding_attention", "full_attention"]
    result = _run("gemma3", phases=("prefill", "train", "generate", "generate_static"))
    rows = {r["phase"]: r for r in result["phases"]}
    for name in ("prefill", "train"):
        r = rows[name]
        assert r["errors"] == {} and r["fallbacks"] == {}, (r["errors"], r["fallbacks"])
        assert 0 <= r["check"]["flashtune"] <= mb.TOL
        calls = {c["call"]: c["route"] for c in r["routes"]}
        # one local layer in a window of 8, one global layer, both on flashtune's kernels
        assert sum(" window 8" in c for c in calls) == 1 and len(calls) == 2, calls
        assert all(not route.startswith("torch") for route in calls.values())
    gen = rows["generate"]
    w = mb.default_workload("gemma3", tiny=True)
    assert sum(c["calls"] for c in gen["routes"]) == w.new_tokens * spec.layers
    # a local layer's cache keeps the window's last keys: its steps need no window
    steps = [c["call"] for c in gen["routes"] if c["call"].startswith("q (2, 4, 1, 16)")]
    assert any(" k (2, 2, 8, 16) " in c for c in steps), steps
    assert gen["check"]["flashtune"] == 0  # the same tokens as sdpa's
    # a static cache: the local layer's holds the window's last keys as a ring, the global
    # layer's the whole length, its steps run over it with the lengths on the device
    static = rows["generate_static"]
    assert static["errors"] == {} and static["check"]["flashtune"] == 0, static["errors"]
    assert any(c["route"].startswith("attn_decode: a generation step") for c in
               static["routes"]), static["routes"]


def test_mistral_runs_every_layer_in_its_window_checked_against_sdpa():
    """Mistral's every layer reaches flashtune as a sliding window (transformers hands
    SDPA a mask once a sequence outruns it): the tiny model's prompt (24) and training
    sequences (16) outrun its window of 8, so a window dropped or misread would fail the
    check against sdpa's masked output; its default training step is twice the preset's
    window."""
    assert mb.default_workload("mistral").train_seqlen == 2 * mb.PRESETS["mistral"].window
    result = _run("mistral", phases=("prefill", "train", "generate", "generate_static"))
    rows = {r["phase"]: r for r in result["phases"]}
    for name in ("prefill", "train"):
        r = rows[name]
        assert r["errors"] == {} and r["fallbacks"] == {}, (r["errors"], r["fallbacks"])
        assert 0 <= r["check"]["flashtune"] <= mb.TOL
        calls = {c["call"]: c["route"] for c in r["routes"]}
        assert calls and all(" window 8" in c for c in calls), calls
        assert all(not route.startswith("torch") for route in calls.values())
    _check_windowed_generation(rows, "mistral", prompt_calls=("window 8",))


def _check_windowed_generation(rows, family, prompt_calls):
    """The generation phases of a family whose local layers attend within a window of 8
    (the tiny prompt of 12 outruns it): the same tokens as the reference, every call on
    flashtune's route, the prompt's calls as ``prompt_calls`` name them, and the steps of
    a local layer over the cache's last 8 keys with no window left to apply."""
    w = mb.default_workload(family, tiny=True)
    layers = mb.TINY[family].layers
    for name in ("generate", "generate_static"):
        r = rows[name]
        assert r["errors"] == {} and r["fallbacks"] == {}, (name, r["errors"], r["fallbacks"])
        assert r["check"]["flashtune"] == 0, name  # the same tokens as the reference's
        assert sum(c["calls"] for c in r["routes"]) == w.new_tokens * layers, r["routes"]
        assert all(not c["route"].startswith("torch") for c in r["routes"]), r["routes"]
        prompt = [c["call"] for c in r["routes"] if c["call"].startswith("q (2, 4, 12, 16)")]
        assert all(any(p in c for c in prompt) for p in prompt_calls), (name, prompt)
        steps = [c["call"] for c in r["routes"] if c["call"].startswith("q (2, 4, 1, 16)")]
        local = [c for c in steps if " k (2, 2, 8, 16) " in c]
        assert local and not any(" window " in c for c in steps), (name, steps)


def test_a_window_dropped_on_the_way_fails_gemma3s_check(monkeypatch):
    """The check above can fail: the integration running the local layer without its
    window is caught against sdpa's masked output."""
    from flashtune.integrations import transformers as ft

    real = ft._forward

    def unwindowed(*args, **kwargs):
        kwargs.pop("sliding_window", None)
        return real(*args, **kwargs)

    monkeypatch.setattr(ft, "_forward", unwindowed)
    (row,) = _run("gemma3", phases=("prefill",))["phases"]
    assert "output differs from sdpa's" in row["errors"]["flashtune"]


def test_gemma2_runs_on_flashtune_checked_against_eager():
    """Gemma 2's softcap (and its local layers' window): transformers runs the family on its
    eager attention, the reference here, since SDPA has no softcap. (The tiny model's
    logits hardly move with its attention's scores: a dropped softcap passes this check,
    where a dropped window does not; test_transformers.py checks the softcap's numerics
    through the integration.)"""
    assert mb.REFERENCE["gemma2"] == "eager"
    spec = mb.TINY["gemma2"]
    w = replace(mb.default_workload("gemma2", tiny=True),
                phases=("prefill", "train", "generate", "generate_static"))
    result = mb.bench_model(spec, w, contenders=("flashtune",), rounds=1,
                            interpret=DEVICE == "cpu")
    assert result["contenders"] == ["flashtune", "eager"]
    rows = {r["phase"]: r for r in result["phases"]}
    for name in ("prefill", "train"):
        r = rows[name]
        assert r["errors"] == {} and r["fallbacks"] == {}, (r["errors"], r["fallbacks"])
        assert 0 <= r["check"]["flashtune"] <= mb.TOL and set(r["ms"]) == {"flashtune", "eager"}
        calls = [c["call"] for c in r["routes"]]
        assert all(" softcap 1.0" in c for c in calls) and len(calls) == 2, calls
        assert sum(" window 8 " in c for c in calls) == 1
    # every call of the generations keeps its softcap, decoding steps too
    assert all(" softcap 1.0" in c["call"] for name in ("generate", "generate_static")
               for c in rows[name]["routes"])
    _check_windowed_generation(rows, "gemma2", prompt_calls=("causal window 8 softcap",))


def test_fresh_lengths_never_share_a_key_length():
    """A generation from n tokens calls attention with n to n + new keys: the rounds' and
    the warm-up's ranges are disjoint, so no decoding step of a timed round meets a shape
    planned before."""
    from flashtune.integrations.fresh_generation import fresh_lengths

    for prompt, new, rounds in ((2048, 64, 5), (12, 3, 2), (7, 1, 4)):
        warm, timed = fresh_lengths(prompt, new, rounds)
        assert timed[0] == prompt and len(timed) == rounds
        spans = [set(range(n, n + new + 1)) for n in [*timed, warm]]
        assert all(not (a & b) for i, a in enumerate(spans) for b in spans[i + 1:])


def test_generate_new_runs_each_contender_in_a_process_of_its_own():
    """``generate_new``: a child process per contender, the same prompt tokens for each
    (flashtune's first round's tokens compared with sdpa's), a ratio per round; a contender
    whose process fails is an error of its own, the others are timed."""
    from flashtune.integrations.fresh_generation import fresh_generation_row

    spec = mb.TINY["llama"]
    work = replace(mb.default_workload("llama", tiny=True), phases=("generate_new",))
    result = mb.bench_model(spec, work, contenders=("flashtune", "sdpa"), rounds=2,
                            interpret=DEVICE == "cpu")
    [row] = result["phases"]
    assert row["phase"] == "generate_new" and row["errors"] == {}, row["errors"]
    assert row["lengths"] == [work.gen_prompt, work.gen_prompt + work.new_tokens + 1]
    assert set(row["ms"]) == {"flashtune", "sdpa"} and len(row["round_ms"]["sdpa"]) == 2
    ratios = [s / f for s, f in zip(row["round_ms"]["sdpa"], row["round_ms"]["flashtune"])]
    assert row["speedup"]["sdpa"] == pytest.approx(sum(ratios) / 2)
    assert 0 <= row["check"]["flashtune"] <= 1
    assert "new lengths" in mb.render_model(result)
    broken = fresh_generation_row(spec, work, ("flashtune", "sdpa", "sdpa_nothing"), 1,
                                  "cpu" if DEVICE == "cpu" else "cuda")
    assert set(broken["ms"]) == {"flashtune", "sdpa"}
    assert "its process failed" in broken["errors"]["sdpa_nothing"]


def test_bert_training_with_dropout_runs_on_flashtune_and_is_not_compared():
    """Attention dropout runs flashtune's kernels (no fallback); the training phase's outputs
    are not compared (each run draws its own dropout mask)."""
    result = _run("bert")
    fwd, train = result["phases"]
    assert fwd["phase"] == "forward" and fwd["fallbacks"] == {} and fwd["errors"] == {}
    layers = mb.TINY["bert"].layers
    assert train["fallbacks"] == {} and train["errors"] == {}
    assert sum(c["calls"] for c in train["routes"]) == layers
    assert all("dropout" in c["call"] and not c["route"].startswith("torch")
               for c in train["routes"])
    assert "flashtune" not in train["check"]


def test_vit_forward_and_train():
    result = _run("vit", phases=("forward",))
    (row,) = result["phases"]
    tokens = (mb.TINY["vit"].image // mb.TINY["vit"].patch) ** 2 + 1
    assert row["label"] == f"B2 x {tokens} tokens" and row["errors"] == {}
    assert row["check"]["flashtune"] <= mb.TOL


def test_a_contender_whose_output_is_wrong_is_reported_and_not_timed(monkeypatch):
    real = mb._rel_err
    monkeypatch.setattr(mb, "_rel_err", lambda got, ref: 0.5 if got is not ref else real(got, ref))
    result = _run("llama", phases=("prefill",))
    (row,) = result["phases"]
    assert "relative error 5.00e-01" in row["errors"]["flashtune"]
    assert "flashtune" not in row["ms"] and row["speedup"] == {}
    assert "flashtune not timed" in mb.render_model(result)


def test_nothing_is_timed_unchecked_when_the_reference_fails(monkeypatch):
    real = mb._contender

    def broken_sdpa(model, name):
        if name == "sdpa":
            raise RuntimeError("no kernel for this shape")
        return real(model, name)

    monkeypatch.setattr(mb, "_contender", broken_sdpa)
    (row,) = _run("llama", phases=("prefill",))["phases"]
    assert row["errors"] == {"sdpa": "RuntimeError: no kernel for this shape",
                             "flashtune": "not checked: sdpa, the reference, failed"}
    assert row["ms"] == {}


def test_attention_share_counts_attention_kernels_of_every_backend():
    kernels = [("attn_fwd_kernel", 2.0), ("gluon_attn_fwd_kernel", 1.0),
               ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128>>", 1.0),
               ("cudnn_generated_fort_native_sdpa_sm90_knob_7_64x128x128", 1.0),
               ("fmha_cutlassF_bf16_aligned_64x128_rf_sm80", 1.0),
               ("sm90_xmma_gemm_bf16bf16_bf16f32", 3.0), ("softmax_warp_forward", 1.0)]
    assert mb.attention_share(kernels) == pytest.approx(6 / 10)
    assert mb.attention_share([]) is None


@pytest.mark.parametrize("change,match", [
    (dict(hidden=66), "hidden 66 is not a multiple of heads 4"),
    (dict(kv_heads=3), "heads 4 is not a multiple of kv_heads 3"),
    (dict(layers=0), "layers must be at least 1"),
])
def test_a_spec_that_makes_no_model_names_the_field(change, match):
    with pytest.raises(ValueError, match=match):
        replace(mb.TINY["llama"], **change).check()
    with pytest.raises(ValueError, match="no grouped-query attention"):
        replace(mb.TINY["bert"], kv_heads=2).check()


def test_gemma3s_fields_are_its_own():
    """A head dim apart from hidden / heads, the window and the global layers' period:
    gemma3 needs the last two, no other family takes any of them."""
    spec = mb.PRESETS["gemma3"]
    spec.check()
    assert spec.head_dim == 256 and spec.hidden // spec.heads == 240
    assert spec.layer_types.count("full_attention") == 1  # layer 6 of 8
    assert spec.config().layer_types == spec.layer_types
    with pytest.raises(ValueError, match="window must be at least 1 for gemma3"):
        replace(spec, window=0).check()
    with pytest.raises(ValueError, match="head_size, window and global_every are the Gemma"):
        replace(mb.TINY["llama"], window=8).check()
    with pytest.raises(ValueError, match="softcap is gemma2's"):
        replace(spec, softcap=50.0).check()
    mistral = mb.PRESETS["mistral"]
    mistral.check()
    assert mistral.config().sliding_window == 4096 and mistral.head_dim == 128
    with pytest.raises(ValueError, match="window must be at least 1 for mistral"):
        replace(mistral, window=0).check()
    with pytest.raises(ValueError, match="head_size and global_every are the Gemma"):
        replace(mistral, global_every=2).check()
    gemma2 = mb.PRESETS["gemma2"]
    gemma2.check()
    assert gemma2.layer_types[:2] == ["sliding_attention", "full_attention"]
    assert gemma2.config().attn_logit_softcapping == 50.0


def test_unknown_contender_is_refused_before_any_work():
    with pytest.raises(ValueError, match="unknown contenders"):
        mb.bench_model(mb.TINY["llama"], mb.default_workload("llama", tiny=True),
                       contenders=("flashtune", "flex"), interpret=True)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU refusal")
def test_without_a_gpu_and_without_interpret_it_says_so():
    with pytest.raises(RuntimeError, match="no CUDA GPU.*--interpret"):
        mb.bench_model(mb.TINY["llama"], mb.default_workload("llama", tiny=True))


@pytest.mark.gpu
def test_on_the_gpu_a_small_llama_reports_attention_share_and_routes():
    spec = replace(mb.PRESETS["llama"], layers=2, hidden=1024, heads=8, kv_heads=2,
                   intermediate=2048, vocab=1024)
    work = mb.Workload(1, (1024,), 1, 512, 2, 256, 4)
    result = mb.bench_model(spec, work, contenders=("flashtune", "sdpa", "sdpa_flash"),
                            rounds=1)
    for row in result["phases"]:
        assert row["errors"] == {}, row["errors"]
        if row["phase"] == "generate_new":  # its contenders ran in processes of their own
            continue
        assert 0 < row["attention_share"]["flashtune"] < 1
        assert row["fallbacks"] == {}


def test_the_probe_names_a_later_chunk_against_the_cache():
    """A call the route table describes as run: a later chunk over a dynamic cache goes to
    flashtune.attention (causal bottom-right), not to the SDPA drop-in's top-left mask."""
    from transformers import AutoModelForCausalLM, DynamicCache, LlamaConfig

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                         max_position_embeddings=64)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=mb.NAME,
                                             dtype=torch.float16).to(DEVICE).eval()
    ids = torch.randint(1, 64, (1, 30), generator=torch.Generator().manual_seed(0))
    past = DynamicCache(config=config)
    with torch.no_grad(), mb._probing(model) as calls:
        model(ids[:, :12].to(DEVICE), past_key_values=past, use_cache=True)
        model(ids[:, 12:].to(DEVICE), past_key_values=past, use_cache=True)
    routes = {c["call"]: c["route"] for c in calls.values()}
    (chunk,) = [r for call, r in routes.items() if "q (1, 2, 18, 16) k (1, 1, 30, 16)" in call]
    assert chunk.endswith("a chunk against the cache, causal aligned bottom-right"), routes


@pytest.mark.gpu
def test_on_the_gpu_gemma3s_local_layers_run_in_their_window():
    """Prompts longer than the window: the local layer's calls carry it and the model's
    output matches sdpa's, which masks the window out of the full square."""
    spec = replace(mb.PRESETS["gemma3"], layers=2, hidden=1024, heads=4, kv_heads=2,
                   intermediate=2048, vocab=1024, window=256, global_every=2)
    work = mb.Workload(1, (1000,), 1, 600, 2, 300, 4, phases=("prefill", "train", "generate"))
    result = mb.bench_model(spec, work, contenders=("flashtune", "sdpa"), rounds=1)
    for row in result["phases"]:
        assert row["errors"] == {}, row["errors"]
        assert row["fallbacks"] == {}
        assert any(" window 256" in c["call"] for c in row["routes"]), row["routes"]

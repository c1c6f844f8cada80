"""The user op ``train`` (flashtune.kernel_templates.training, tune_op's train path, the
training route of flashtune.attention): pairs of flashtune's kernels and SDPA backends as
implementations, their steps checked as a whole, the search, the stored choice served to a
call with gradients, and op files of train choices. Under the interpreter, with torch's
math SDPA standing in for an extern."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

import flashtune
from flashtune.autotune.options import TuneOptions
from flashtune.autotune.runners import LocalRunner
from flashtune.autotune.select import applicable, tune_op
from flashtune.core.device import DeviceFingerprint, interpreter_device
from flashtune.core.errors import ImportRejected, InputError
from flashtune.core.problem import AttentionProblem
from flashtune.core.spec import Limits, join_pair, op_implementations, split_pair
from flashtune.db import open_store
from flashtune.db.exchange_choices import export_choice_documents, parse_choice_document
from flashtune.db.records import SoftwareVersions, TrialState
from flashtune.kernel_templates import catalog, get_template, implementations
from flashtune.kernel_templates.registry import train_step
from flashtune.kernel_templates.training import TrainStep, train_spec
from flashtune.runtime import autograd
from tests.conftest import DEVICE

DEV = interpreter_device()
# odd shapes: GQA, ragged lengths, causal with Nq != Nk
GQA = AttentionProblem(1, 4, 2, 37, 53, 32, True, "fp16")
SQUARE = AttentionProblem(1, 2, 2, 40, 40, 32, True, "fp16")
interpreter_only = pytest.mark.skipif(DEVICE != "cpu", reason="runs kernels under the "
                                      "Triton interpreter on CPU tensors")


def test_the_implementations_of_train_are_forwards_with_a_backward():
    specs = {s.name: s for s in implementations("train")}
    assert set(specs) == {"attn_fwd", "attn_fwd_bwd_gluon", "attn_fwd_gluon",
                          "attn_fwd_gluon_bwd_cudnn", "attn_fwd_gluon_bwd_gluon", "sdpa_cudnn",
                          "sdpa_cudnn_bwd_gluon", "sdpa_efficient", "sdpa_flash",
                          "sdpa_math"}  # not attn_decode
    # the Gluon forward pairs with attn_bwd, and as attn_fwd_gluon_bwd_gluon with the Gluon
    # backward; attn_fwd's forward with the Gluon backward is attn_fwd_bwd_gluon, SDPA
    # cuDNN's sdpa_cudnn_bwd_gluon; the Gluon forward with cuDNN's backward
    # attn_fwd_gluon_bwd_cudnn
    for pair in ("attn_fwd_gluon_bwd_gluon", "attn_fwd_bwd_gluon", "sdpa_cudnn_bwd_gluon"):
        assert get_template(pair).backward == "attn_bwd_gluon"
    assert get_template("attn_fwd_gluon_bwd_cudnn").backward == "sdpa_cudnn_bwd"
    for name, spec in specs.items():
        assert spec.op == "train" and spec.serves == ("train",)
        forward = get_template(name)
        if spec.kind == "extern":  # torch differentiates it; its LSE has no gradient
            assert spec.space.size == 1 and spec.source_hash == forward.source_hash
            assert not spec.limits.lse
        else:  # the pair's space: the forward's knobs and its backward's under bwd.
            bwd = get_template(forward.backward)
            assert bwd.name == ("attn_bwd_gluon" if name.endswith("_bwd_gluon")
                                else "sdpa_cudnn_bwd" if name.endswith("_bwd_cudnn")
                                else "attn_bwd")
            assert set(spec.space.params) == set(forward.space.params) | {
                f"bwd.{n}" for n in bwd.space.params}
            assert spec.source_hash not in (forward.source_hash, bwd.source_hash)
    assert op_implementations(catalog(), "train") == specs
    assert train_step(get_template("attn_fwd")) is specs["attn_fwd"]  # built once
    with pytest.raises(ValueError, match="attn_decode.*no backward"):
        train_step(get_template("attn_decode"))
    # the pair is the forward's own: another backward (or none for a kernel that has one)
    # is refused by name
    with pytest.raises(ValueError, match="pairs with backward 'attn_bwd', got 'attn_decode'"):
        train_spec(get_template("attn_fwd"), get_template("attn_decode"))
    with pytest.raises(ValueError, match="pairs with backward 'attn_bwd', got None"):
        train_spec(get_template("attn_fwd"), None)
    assert train_spec(get_template("attn_fwd"), get_template("attn_bwd")) is specs["attn_fwd"]


def test_a_pair_config_splits_into_the_forward_s_and_the_backward_s():
    fwd, bwd = {"BLOCK_M": 64, "num_warps": 4}, {"BLOCK_M1": 32, "num_warps": 8}
    joined = join_pair(fwd, bwd)
    assert joined == {"BLOCK_M": 64, "num_warps": 4, "bwd.BLOCK_M1": 32, "bwd.num_warps": 8}
    assert split_pair(joined) == (fwd, bwd)
    spec = train_step(get_template("attn_fwd"))
    cfg = spec.default_config(GQA, DEV)
    assert spec.space.validate(cfg) == cfg and spec.space.check(cfg, GQA, DEV) is None
    d128 = AttentionProblem(1, 2, 2, 64, 64, 128, False, "fp16")
    bad = {**spec.default_config(d128, DEV), "bwd.num_warps": 2, "bwd.BLOCK_N1": 128}
    assert spec.space.check(bad, d128, DEV).startswith("backward: ")  # would spill


def test_a_pair_serves_what_both_kernels_serve():
    a = Limits(head_dims=(64, 128), gqa=True, max_seqlen_q=None)
    b = Limits(head_dims=(32, 64), gqa=False, max_seqlen_q=16, needs_gpu=True,
               available=lambda d: "not built")
    both = a.both(b)
    assert both.head_dims == (64,) and not both.gqa and both.max_seqlen_q == 16
    assert both.needs_gpu and both.refuse(AttentionProblem(1, 2, 2, 4, 8, 64, False, "fp16"),
                                          DEV) is not None
    assert Limits().both(Limits()) == Limits()


def test_a_pair_serves_a_causal_window_where_the_backward_serves_any_window():
    """The Gluon forward's causal sliding window and softcap, with attn_bwd's windows and
    softcap: the pair serves both on causal problems, a two-sided window on none, ALiBi
    (the forward's lack) on none."""
    gluon = Limits(score_mods=("causal_window", "softcap"))
    tl = Limits(score_mods=("window", "softcap", "alibi"))
    for pair in (gluon.both(tl), tl.both(gluon)):
        assert set(pair.score_mods) == {"causal_window", "softcap"}
    assert Limits(score_mods=("causal_window",)).both(Limits(score_mods=("softcap",))
                                                      ).score_mods == ()
    h100 = DeviceFingerprint("NVIDIA_H100_80GB_HBM3", "9.0", 132, 232448, 85 * 2**30)
    spec = get_template("attn_fwd_gluon")
    assert spec.backward == "attn_bwd"
    pair = spec.limits.both(get_template("attn_bwd").limits)
    local = AttentionProblem(2, 16, 8, 4096, 4096, 256, True, "bf16", 1023, -1, 50.0)
    assert pair.refuse(local, h100) is None
    assert "a local window" in pair.refuse(replace(local, causal=False, window_right=7), h100)
    assert "ALiBi" in pair.refuse(replace(local, alibi=True), h100)


def test_applicable_train_skips_an_extern_that_masks_causal_differently():
    names = [s.name for s in applicable("train", SQUARE, DEV)[0]]
    assert names == ["attn_fwd", "sdpa_math"]
    skipped = dict(applicable("train", GQA, DEV)[1])
    assert "causal" in skipped["sdpa_math"]
    with pytest.raises(InputError, match="'attn_decode' does not serve op 'train'"):
        applicable("train", SQUARE, DEV, ["attn_decode"])


@interpreter_only
@pytest.mark.parametrize("problem", [GQA, SQUARE], ids=["gqa-causal-unaligned", "square"])
def test_a_pair_s_step_is_checked_as_a_whole(problem):
    spec = train_step(get_template("attn_fwd"))
    cfg = spec.default_config(problem, DEV)
    assert LocalRunner(spec, problem, DEV).evaluate(cfg).ok

    bwd = get_template("attn_bwd")

    def wrong_dk(*args, **kwargs):  # a backward whose dK is 10% off
        dq, dk, dv = bwd.launcher(*args, **kwargs)
        return dq, dk * 1.1, dv

    broken = TrainStep(get_template("attn_fwd"), bwd)
    broken.bwd = type("B", (), {"launcher": staticmethod(wrong_dk)})()
    result = LocalRunner(spec, problem, DEV, launcher=broken).evaluate(cfg)
    assert result.state is TrialState.WRONG_RESULT, result


@interpreter_only
def test_an_extern_s_step_runs_through_torch_s_autograd():
    spec = train_step(get_template("sdpa_math"))
    assert LocalRunner(spec, SQUARE, DEV).evaluate({}).ok


def _store_pair_choice(url, problem, cfg):
    spec = train_step(get_template("attn_fwd"))
    with open_store(url) as store:
        dev = store.ensure_device(DEV)
        store.put_choice(dev.id, "train", problem.key(), implementation="attn_fwd",
                         source_hash=spec.source_hash, config=cfg, median_ms=1.0,
                         tflops=None, runner_up="sdpa_math", runner_up_ms=2.0,
                         extern="sdpa_math", extern_ms=2.0, candidates=[],
                         software=SoftwareVersions(cuda="", driver="", flashtune="x",
                                                   torch="y", triton="z"))


def _qkv(problem, seed=0):
    g = torch.Generator().manual_seed(seed)
    dt = torch.float16
    q = torch.randn(problem.batch, problem.heads_q, problem.seqlen_q, problem.head_dim,
                    generator=g).to(dt).requires_grad_()
    k, v = (torch.randn(problem.batch, problem.heads_kv, problem.seqlen_k, problem.head_dim,
                        generator=g).to(dt).requires_grad_() for _ in range(2))
    return q, k, v


def _grads_close(problem, out, q, k, v):
    from flashtune.kernel_templates.attn_bwd.reference import attn_bwd_reference

    do = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), do)
    ref = attn_bwd_reference(q, k, v, do, causal=problem.causal, dtype=torch.float64)
    for g, r in zip(got, ref, strict=True):
        err = float((g.double() - r).norm() / r.norm())
        assert err < 5e-3, err


@interpreter_only
def test_tune_train_stores_the_fastest_step_and_attention_with_grad_runs_it(
        tmp_path, monkeypatch):
    url = f"sqlite:///{tmp_path / 't.db'}"
    monkeypatch.setenv("FLASHTUNE_DB", url)
    result, = tune_op([SQUARE], "train", TuneOptions(trials=2, interpret=True),
                      db_url=url, progress=False, _device=DEV)
    # the pair's forward and backward were searched, each once; the extern was not
    assert [r.template for r in result.results] == ["attn_fwd", "attn_bwd"]
    timed = {x.implementation: x for x in result.leaders}
    assert set(timed) == {"attn_fwd", "sdpa_math"} and all(x.median_ms for x in timed.values())
    step_flops = SQUARE.flops() + SQUARE.flops(backward=True)  # what a step does
    for x in timed.values():
        assert x.tflops == pytest.approx(step_flops / x.median_ms / 1e9)
    pair_cfg = timed["attn_fwd"].config
    assert split_pair(pair_cfg)[1]  # the pair's config holds the backward's
    with open_store(url) as store:
        choice, = store.list_choices(op="train")
    assert choice.implementation == result.winner.implementation
    flashtune.reload_configs()
    q, k, v = _qkv(SQUARE)
    picked = flashtune.lookup_config(q, k, v, causal=True)
    assert (picked.source, picked.template) == ("exact", choice.implementation)
    out = flashtune.attention(q, k, v, causal=True)
    _grads_close(SQUARE, out, q, k, v)
    # without gradients the fwd op's route: no fwd choice, but the pair's forward was
    # searched as attn_fwd, so its tuned config serves inference too
    inference = flashtune.lookup_config(q.detach(), k.detach(), v.detach(), causal=True)
    assert (inference.template, inference.source) == ("attn_fwd", "exact")
    flashtune.reload_configs()


@interpreter_only
def test_a_stored_pair_runs_with_its_own_forward_and_backward_configs(tmp_path, monkeypatch):
    url = f"sqlite:///{tmp_path / 't.db'}"
    monkeypatch.setenv("FLASHTUNE_DB", url)
    spec = train_step(get_template("attn_fwd"))
    cfg = {**spec.default_config(GQA, DEV), "BLOCK_M": 32, "BLOCK_N": 32,
           "bwd.BLOCK_M1": 32, "bwd.BLOCK_N1": 16}
    cfg = spec.space.validate(cfg)
    _store_pair_choice(url, GQA, cfg)
    flashtune.reload_configs()
    used = []
    real = autograd.pair_fn
    monkeypatch.setattr(autograd, "pair_fn",
                        lambda *a: used.append(join_pair(a[6], a[8])) or real(*a))
    q, k, v = _qkv(GQA, seed=1)
    out, lse = flashtune.attention(q, k, v, causal=True, return_lse=True)
    assert used == [cfg]
    assert flashtune.lookup_config(q, k, v, causal=True, return_lse=True).config == cfg
    _grads_close(GQA, out, q, k, v)
    flashtune.reload_configs()


def test_a_training_choice_is_never_lent_across_gqa_groups(tmp_path, monkeypatch):
    """A pair's choice carries its backward's config, whose dK/dV programs split the GQA
    group: another group takes the default pair, not the nearest pair of this group; the
    forward op's choices are lent across groups (``test_lookup``)."""
    from dataclasses import replace

    from flashtune.runtime import routing

    url = f"sqlite:///{tmp_path / 't.db'}"
    monkeypatch.setenv("FLASHTUNE_DB", url)
    spec = train_step(get_template("attn_fwd"))
    _store_pair_choice(url, GQA, spec.space.validate(spec.default_config(GQA, DEV)))
    flashtune.reload_configs()
    router = routing._ROUTERS["train"]
    assert router.choose(GQA, DEV).source == "exact"
    assert router.choose(replace(GQA, seqlen_q=150), DEV).source == "nearest"  # its group
    assert router.choose(replace(GQA, heads_kv=1), DEV) is None  # 4:1 against 2:1
    assert router.choose(replace(GQA, heads_kv=4), DEV) is None  # MHA
    flashtune.reload_configs()


@interpreter_only
def test_an_extern_train_choice_is_not_served_a_call_that_asks_for_the_lse(tmp_path,
                                                                           monkeypatch):
    url = f"sqlite:///{tmp_path / 't.db'}"
    monkeypatch.setenv("FLASHTUNE_DB", url)
    with open_store(url) as store:
        dev = store.ensure_device(DEV)
        store.put_choice(dev.id, "train", SQUARE.key(), implementation="sdpa_math",
                         source_hash=get_template("sdpa_math").source_hash, config={},
                         median_ms=1.0, tflops=None, runner_up=None, runner_up_ms=None,
                         extern="sdpa_math", extern_ms=1.0, candidates=[],
                         software=SoftwareVersions("", "", "x", "y", "z"))
    flashtune.reload_configs()
    q, k, v = _qkv(SQUARE)
    assert flashtune.lookup_config(q, k, v, causal=True).template == "sdpa_math"
    # its LSE carries no gradient: a call that asks for it takes the default pair
    with_lse = flashtune.lookup_config(q, k, v, causal=True, return_lse=True)
    assert with_lse.template == "attn_fwd" and split_pair(with_lse.config)[1]
    out = flashtune.attention(q, k, v, causal=True)
    assert out.grad_fn is not None and "Pair" not in type(out.grad_fn).__name__
    _grads_close(SQUARE, out, q, k, v)
    flashtune.reload_configs()


@interpreter_only
def test_forced_implementations_with_gradients():
    q, k, v = _qkv(SQUARE)
    with pytest.raises(InputError, match="'attn_decode' has no backward"):
        flashtune.attention(q, k, v, impl="attn_decode")
    with pytest.raises(InputError, match="attn_fwd_gluon.*needs a CUDA GPU"):
        flashtune.attention(q, k, v, impl="attn_fwd_gluon")
    with pytest.raises(InputError, match="'sdpa_math' cannot serve .*LSE"):
        flashtune.attention(q, k, v, causal=True, impl="sdpa_math", return_lse=True)
    spec = train_step(get_template("attn_fwd"))
    cfg = spec.default_config(SQUARE, DEV)
    fwd_only, _ = split_pair(cfg)
    for config in (cfg, fwd_only):  # the pair's config, or the forward's alone
        out = flashtune.attention(q, k, v, causal=True, config=config)
        _grads_close(SQUARE, out, q, k, v)
    with pytest.raises(ValueError, match="bwd.BLOCK_M1"):
        flashtune.attention(q, k, v, causal=True, config={**cfg, "bwd.BLOCK_M1": 7})


def test_an_op_file_of_train_choices_round_trips_and_a_bad_pair_config_is_rejected(tmp_path):
    url = f"sqlite:///{tmp_path / 't.db'}"
    spec = train_step(get_template("attn_fwd"))
    cfg = spec.default_config(GQA, DEV)
    _store_pair_choice(url, GQA, cfg)
    with open_store(url) as store:
        doc, = export_choice_documents(store, specs=catalog(), op="train")
    assert doc.op == "train" and doc.implementations["attn_fwd"] == spec.source_hash
    assert doc.entries[0].config == cfg
    from flashtune.db.exchange_choices import choice_document_to_json

    text = choice_document_to_json(doc)
    assert parse_choice_document(text, specs=catalog()).entries[0].config == cfg
    data = json.loads(text)
    data["entries"][0]["config"]["bwd.BLOCK_M1"] = 7
    with pytest.raises(ImportRejected, match=r"bwd\.BLOCK_M1"):
        parse_choice_document(json.dumps(data), specs=catalog())


# -- on the GPU ---------------------------------------------------------------------------------

GPU_SHAPES = [AttentionProblem(2, 8, 2, 333, 333, 128, True, "bf16"),  # GQA, ragged, causal
              AttentionProblem(1, 4, 4, 200, 517, 64, False, "fp16")]  # Nq != Nk


@pytest.mark.gpu
@pytest.mark.parametrize("problem", GPU_SHAPES, ids=["gqa-causal", "nq-ne-nk"])
def test_every_training_step_that_serves_a_shape_passes_its_check_on_the_gpu(problem):
    from flashtune.core.device import cuda_device

    device = cuda_device()
    specs, skipped = applicable("train", problem, device)
    assert "attn_fwd" in [s.name for s in specs], skipped
    for spec in specs:
        if spec.name == "sdpa_math":
            continue  # the reference's own algorithm; slow at these sizes
        runner = LocalRunner(spec, problem, device)
        result = runner.evaluate(spec.default_config(problem, device) if spec.backward
                                 else {})
        assert result.ok, (spec.name, result)


@pytest.mark.gpu
def test_the_gluon_forward_trains_with_attn_bwd_on_hopper():
    from flashtune.core.device import cuda_device

    problem = GPU_SHAPES[0]
    if train_step(get_template("attn_fwd_gluon")).refuse(problem, cuda_device()):
        pytest.skip("the Gluon forward runs on sm_90 only")
    q, k, v = (t.cuda() for t in _qkv(problem))
    q, k, v = (t.to(torch.bfloat16).detach().requires_grad_() for t in (q, k, v))
    out = flashtune.attention(q, k, v, causal=True, impl="attn_fwd_gluon")
    from flashtune.kernel_templates.attn_bwd.reference import attn_bwd_reference

    do = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), do)
    ref = attn_bwd_reference(q, k, v, do, causal=True, dtype=torch.float32)
    for g, r in zip(got, ref, strict=True):
        assert float((g.float() - r).norm() / r.norm()) < 2e-2


def test_untuned_training_on_hopper_defaults_to_cudnn_where_it_serves(tmp_path, monkeypatch):
    from dataclasses import replace

    from flashtune.core.device import DeviceFingerprint
    from flashtune.runtime import routing

    monkeypatch.setenv("FLASHTUNE_DB", f"sqlite:///{tmp_path / 'none.db'}")
    flashtune.reload_configs()
    h100 = DeviceFingerprint(name="NVIDIA H100 80GB HBM3", compute_capability="9.0",
                             sm_count=132, shared_mem_per_block=232448,
                             total_memory=80 * 2**30)
    spec = routing._ROUTERS["train"].specs["sdpa_cudnn"]  # as if cuDNN were loaded here
    monkeypatch.setitem(routing._ROUTERS["train"].specs, "sdpa_cudnn",
                        replace(spec, limits=replace(spec.limits, available=None)))
    choice = routing._train_choice(SQUARE, h100, tune=False)
    assert (choice.template, choice.source, choice.config) == ("sdpa_cudnn", "default", {})
    # not where it cannot serve the call (the LSE asked for, causal with Nq != Nk), off
    # sm_90, or on the torch.compile path (flashtune's custom ops) while cuDNN's own
    # backward (its paired_backward) cannot run
    for problem, device, kw in ((SQUARE, h100, {"return_lse": True}), (GQA, h100, {}),
                                (SQUARE, replace(h100, compute_capability="8.0"), {}),
                                (SQUARE, h100, {"paired": True})):
        other = routing._train_choice(problem, device, tune=False, **kw)
        assert other.template == "attn_fwd" and split_pair(other.config)[1], (problem, kw)
    # with it (as if cuDNN were loaded here): the compiled path runs cuDNN's step too, the
    # LSE's gradient included (that backward hands such a call to one that takes it)
    from flashtune.kernel_templates import registry

    bwd = registry.get_template("sdpa_cudnn_bwd")
    monkeypatch.setitem(registry._REGISTRY, "sdpa_cudnn_bwd",
                        replace(bwd, limits=replace(bwd.limits, available=None)))
    for kw in ({"paired": True}, {"paired": True, "return_lse": True}):
        choice = routing._train_choice(SQUARE, h100, tune=False, **kw)
        assert (choice.template, choice.source) == ("sdpa_cudnn", "default"), kw
    assert routing._train_choice(GQA, h100, tune=False, paired=True).template == "attn_fwd"
    flashtune.reload_configs()


def test_deterministic_algorithms_keep_a_training_call_off_the_atomic_backward(monkeypatch):
    """Under ``torch.use_deterministic_algorithms(True)`` a training call whose routed pair
    has a backward declared not deterministic (the Gluon backward's atomic dQ) runs attn_fwd
    with attn_bwd instead; without it, the routed pair; the memo keeps the two apart."""
    from flashtune.runtime import routing
    from flashtune.runtime.lookup import ConfigChoice

    pair = get_template("attn_fwd_gluon_bwd_gluon")
    assert not get_template(pair.backward).limits.deterministic
    gluon = ConfigChoice(join_pair(pair.default_config(SQUARE, DEV),
                                   get_template(pair.backward).default_config(SQUARE, DEV)),
                         "exact", template=pair.name)
    monkeypatch.setattr(routing, "_train_choice", lambda *a, **kw: gluon)
    monkeypatch.setattr(routing, "check_grid", lambda *a, **kw: None)
    routing._TRAIN_FAST.clear()
    q = torch.zeros(1, 2, 40, 32, dtype=torch.float16)
    try:
        assert routing._train_route(q, q, True, False).fwd.name == pair.name
        torch.use_deterministic_algorithms(True)
        route = routing._train_route(q, q, True, False)
        assert (route.fwd.name, route.bwd.name) == ("attn_fwd", "attn_bwd")
        assert set(route.bwd_config) == set(get_template("attn_bwd").space.params)
    finally:
        torch.use_deterministic_algorithms(False)
        routing._TRAIN_FAST.clear()
    assert routing._train_route(q, q, True, False).fwd.name == pair.name
    routing._TRAIN_FAST.clear()

"""flashtune.attention's route for short queries: attn_decode (split-KV) when tuned timings
say it is faster, or, untuned, from DECODE_MIN_KEYS keys on; attn_fwd otherwise. Tuned
attn_decode configs serve attention_with_kvcache too (CPU: the interpreter device)."""

from __future__ import annotations

import pytest
import torch

import flashtune
from flashtune.core.device import interpreter_device
from flashtune.core.problem import AttentionProblem
from flashtune.core.spec import join_pair
from flashtune.runtime import autograd, kvcache, routing
from tests.conftest import DEVICE
from tests.decode_helpers import make_cache
from tests.helpers import assert_close_to_reference
from tests.runtime_tests import test_lookup
from tests.runtime_tests.test_lookup import BASE, populate

env = test_lookup.env  # the fixture: isolated config sources

pytestmark = pytest.mark.skipif(DEVICE != "cpu", reason="the interpreter device's own tables")

HERE = interpreter_device()
DEC = {"BLOCK_N": 32, "NUM_SPLITS": 2, "num_warps": 2, "num_stages": 1}
MIN_KEYS = kvcache.DECODE_MIN_KEYS


def qkv(nq: int, nk: int, b: int = 2, hq: int = 4, hkv: int = 2, d: int = 32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, nq, d, generator=g).half()
    k = torch.randn(b, hkv, nk, d, generator=g).half()
    return q, k, torch.randn(b, hkv, nk, d, generator=g).half()


def problem(q, k, causal):
    return AttentionProblem.from_tensors(q, k, causal=causal)


@pytest.mark.parametrize("nq,nk,template", [
    (1, MIN_KEYS + 5, "attn_decode"),            # long KV: split it
    (4, MIN_KEYS + 37, "attn_decode"),
    (kvcache.DECODE_MAX_QUERIES, MIN_KEYS, "attn_decode"),
    (1, MIN_KEYS - 1, "attn_fwd"),               # short KV: one fwd program per head
    (kvcache.DECODE_MAX_QUERIES + 1, 2 * MIN_KEYS, "attn_fwd"),  # not a decode problem
])
def test_untuned_route_follows_the_heuristic(env, nq, nk, template):
    q, k, v = qkv(nq, nk)
    assert flashtune.lookup_config(q, k, v, causal=True).template == template


@pytest.mark.parametrize("causal", [False, True])
def test_routed_calls_are_correct(env, causal):
    q, k, v = qkv(3, MIN_KEYS + 21, seed=1)
    assert flashtune.lookup_config(q, k, v, causal=causal).template == "attn_decode"
    out, lse = flashtune.attention(q, k, v, causal=causal, return_lse=True)
    assert_close_to_reference(out, q, k, v, causal=causal, lse=lse)
    out2 = flashtune.attention(q, k, v, causal=causal)  # the memoised route
    assert torch.equal(out, out2)


def test_tuned_timings_of_both_templates_decide(env):
    q, k, v = qkv(1, MIN_KEYS - 16)  # below MIN_KEYS: untuned, attn_fwd
    p = problem(q, k, True)
    populate(env["db"], [(HERE, p, dict(DEC), 1.0)], template="attn_decode")
    flashtune.reload_configs()
    # a tuned attn_decode config alone (no fwd timing to compare): decode
    assert flashtune.lookup_config(q, k, v, causal=True).template == "attn_decode"
    populate(env["db"], [(HERE, p, dict(BASE), 0.5)])  # attn_fwd measured faster
    flashtune.reload_configs()
    choice = flashtune.lookup_config(q, k, v, causal=True)
    assert (choice.template, choice.source) == ("attn_fwd", "exact")
    populate(env["db"], [(HERE, p, dict(DEC), 0.25)], template="attn_decode")  # now faster
    flashtune.reload_configs()
    choice = flashtune.lookup_config(q, k, v, causal=True)
    assert (choice.template, choice.source, choice.config) == ("attn_decode", "exact", DEC)
    out = flashtune.attention(q, k, v, causal=True)
    assert_close_to_reference(out, q, k, v, causal=True)


def test_a_one_row_call_without_the_mask_is_the_causal_decode_step(env):
    """One query row sees every key with the causal mask or without it (bottom-right), so a
    model's decode step, which calls without it (transformers passes ``is_causal`` for
    several rows only), is the problem the decode tables tuned causal: the same key, the
    same exact entry, the same output."""
    q, k, v = qkv(1, MIN_KEYS - 16)
    assert problem(q, k, False) == problem(q, k, True)
    assert problem(q, k, False).key() == problem(q, k, True).key()
    assert AttentionProblem(2, 4, 2, 1, 64, 32, False, "fp16", 8, 3) == \
        AttentionProblem(2, 4, 2, 1, 64, 32, True, "fp16", 8)  # any right bound: none
    assert AttentionProblem(2, 4, 2, 2, 64, 32, False, "fp16").causal is False
    populate(env["db"], [(HERE, problem(q, k, True), dict(DEC), 1.0)],
             template="attn_decode")
    flashtune.reload_configs()
    choice = flashtune.lookup_config(q, k, v, causal=False)
    assert (choice.template, choice.source, choice.config) == ("attn_decode", "exact", DEC)
    out = flashtune.attention(q, k, v, causal=False)
    assert torch.equal(out, flashtune.attention(q, k, v, causal=True))
    assert_close_to_reference(out, q, k, v, causal=False)


def test_route_is_resolved_once_per_shape(env, monkeypatch):
    q, k, v = qkv(1, MIN_KEYS + 3)
    calls = []
    real = kvcache.decode_route
    monkeypatch.setattr(kvcache, "decode_route",
                        lambda *a, **kw: calls.append(a[0]) or real(*a, **kw))
    for _ in range(3):
        flashtune.attention(q, k, v)
    assert len(calls) == 1
    assert next(iter(routing._FAST.values()))[0].name == "attn_decode"  # memoised as the decode route


def test_inputs_that_need_grad_stay_on_the_differentiable_forward(env):
    q, k, v = qkv(1, MIN_KEYS + 3)
    q.requires_grad_(True)
    out = flashtune.attention(q, k, v)
    out.float().sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()


def test_lookup_config_reports_the_template_a_call_with_grad_runs(env, monkeypatch):
    q, k, v = qkv(1, MIN_KEYS + 3)
    q.requires_grad_(True)
    used = []
    real = autograd.pair_fn  # the training route: attn_fwd and attn_bwd with these configs
    monkeypatch.setattr(autograd, "pair_fn",
                        lambda *a: used.append(join_pair(a[6], a[8])) or real(*a))
    choice = flashtune.lookup_config(q, k, v)
    assert choice.template == "attn_fwd"
    flashtune.attention(q, k, v)
    assert used == [choice.config]  # what lookup_config said: the pair's config
    with torch.no_grad():  # no autograd path: the decode route
        assert flashtune.lookup_config(q, k, v).template == "attn_decode"
    assert flashtune.lookup_config(q.detach(), k, v).template == "attn_decode"


def test_tuned_decode_config_serves_attention_with_kvcache(env, monkeypatch):
    q, k, v, lens, table = make_cache([5, 40], 4, 2, 1, 32, torch.float16, DEVICE,
                                      page_size=16, capacity=48, seed=2)
    # the cache's problem key: seqlen_k is its capacity (3 pages x 16)
    p = AttentionProblem(2, 4, 2, 1, 48, 32, True, "fp16")
    populate(env["db"], [(HERE, p, dict(DEC), 1.0)], template="attn_decode")
    flashtune.reload_configs()
    used = []
    real = kvcache.attn_decode_kvcache
    monkeypatch.setattr(kvcache, "attn_decode_kvcache",
                        lambda *a, **kw: used.append(a[4]) or real(*a, **kw))
    flashtune.attention_with_kvcache(q, k, v, lens, block_table=table)
    assert used == [DEC]

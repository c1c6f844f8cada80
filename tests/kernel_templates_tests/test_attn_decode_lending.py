"""A decode config tuned for one shape, lent to another (the router's nearest entry): its
split count follows the batch (attn_decode/lending.py, SearchSpace.lent); served through
both routers."""

from __future__ import annotations

from dataclasses import replace

import pytest

from flashtune.core.device import DeviceFingerprint, interpreter_device
from flashtune.core.problem import AttentionProblem
from flashtune.core.space import SearchSpace
from flashtune.core.spec import op_implementations
from flashtune.db import open_store
from flashtune.kernel_templates import catalog, get_template
from flashtune.kernel_templates.attn_decode.lending import lend, programs
from flashtune.kernel_templates.attn_decode.space import PARAMS, check
from flashtune.runtime.choices import OpRouter
from flashtune.runtime.lookup import Dispatcher

SPEC = get_template("attn_decode")
H100 = DeviceFingerprint("NVIDIA_H100_80GB_HBM3", "9.0", 132, 232448, 85 << 30)
# Gemma-2's decode step: 16 query heads over 8 KV heads, D256, softcap 50
GEMMA = AttentionProblem(16, 16, 8, 1, 16384, 256, True, "bf16", softcap=50.0)


def cfg(splits: int, bn: int = 64, warps: int = 4, stages: int = 2) -> dict[str, int]:
    return {"BLOCK_N": bn, "NUM_SPLITS": splits, "num_warps": warps, "num_stages": stages}


def test_programs_count_batch_kv_heads_and_row_blocks():
    assert programs(GEMMA) == 16 * 8
    # 128 query rows a KV head (a 64:1 group over 2 queries) are one block; 256 are two
    assert programs(AttentionProblem(2, 64, 1, 2, 4096, 128, True, "bf16")) == 2
    assert programs(AttentionProblem(2, 64, 1, 4, 4096, 128, True, "bf16")) == 4


@pytest.mark.parametrize("tuned_batch, splits, batch, want", [
    (16, 1, 8, 2),    # the held-out H100 shape: B 16's one split over 128 programs -> 2
    (16, 1, 16, 1),   # the same batch keeps its splits
    (64, 1, 8, 2),    # an unsplit grid of 512 programs lends at most one program per SM
    (4, 4, 8, 2),     # 32 programs x 4 -> 64 x 2
    (1, 16, 16, 1),   # 8 x 16 -> 128 x 1
    (1, 16, 2, 8),
    (16, 1, 1, 16),
])
def test_the_split_count_keeps_the_programs_the_tuning_found(tuned_batch, splits, batch, want):
    tuned = replace(GEMMA, batch=tuned_batch)
    got = lend(cfg(splits), tuned, replace(GEMMA, batch=batch), H100)
    assert got == cfg(want)  # the other knobs kept


def test_no_split_shorter_than_the_tuned_ones_or_the_minimum():
    # B 16 split 32 ways over 16k keys (512 a split): lent to B 8 over 8k, the 64 splits
    # the programs ask for would be 128 keys each; 256 is the floor -> 32
    tuned = replace(GEMMA, batch=16)
    got = lend(cfg(32, bn=32, warps=2, stages=1), tuned, replace(GEMMA, batch=8, seqlen_k=8192),
               H100)
    assert got["NUM_SPLITS"] == 32
    # a tuning that chose 128-key splits lends them: B 1 28:4 over 16k, 128 splits
    llama = AttentionProblem(1, 28, 4, 1, 16384, 128, True, "bf16")
    got = lend(cfg(128, bn=32, warps=1, stages=1), llama, replace(llama, batch=2, seqlen_k=8192),
               H100)
    assert got["NUM_SPLITS"] == 64


def test_a_lent_count_is_one_of_the_space_and_passes_the_predicate():
    tuned = replace(GEMMA, batch=3)
    for batch in (1, 2, 5, 7, 9, 33, 100):
        for seqlen_k in (64, 300, 5000):
            problem = replace(GEMMA, batch=batch, seqlen_k=seqlen_k)
            got = lend(cfg(6), tuned, problem, H100)
            assert got["NUM_SPLITS"] in PARAMS["NUM_SPLITS"]
            assert check(got, problem, H100) is None, (batch, seqlen_k, got)


def test_the_space_lends_only_to_another_problem_and_only_what_it_accepts():
    tuned, problem = replace(GEMMA, batch=16), replace(GEMMA, batch=8)
    assert SPEC.space.lent(cfg(1), tuned, problem, H100) == cfg(2)
    assert SPEC.space.lent(cfg(1), problem, problem, H100) == cfg(1)  # its own problem
    bare = SearchSpace(params=PARAMS, predicate=check)
    assert bare.lent(cfg(1), tuned, problem, H100) == cfg(1)  # a space with no rule
    refusing = SearchSpace(params=PARAMS, predicate=lambda c, p, d: (
        "NUM_SPLITS 2 refused" if c["NUM_SPLITS"] == 2 else None), lend=lend)
    assert refusing.lent(cfg(1), tuned, problem, H100) == cfg(1)  # the rule's pick refused


def test_the_op_router_lends_the_h100s_shipped_decode_choice(monkeypatch):
    """The held-out Gemma-2 step that the H100 served at 0.72x its exact tuning (B 16's one
    split, benchmarks/results/ship_check_heldout_decode_h100.json) now gets the config that
    exact tuning chose and timed: two splits."""
    monkeypatch.setenv("FLASHTUNE_DB", "")
    monkeypatch.setenv("FLASHTUNE_CONFIG_DIR", "")
    router = OpRouter("decode", op_implementations(catalog(), "decode"))
    got = router.choose(replace(GEMMA, batch=8, seqlen_k=8192), H100)
    assert got is not None and (got.template, got.source) == ("attn_decode", "nearest")
    # (lent through the space: its optional knobs filled in, at the values they had)
    assert got.tuned_problem == GEMMA and got.config == SPEC.space.validate(cfg(2))
    exact = router.choose(GEMMA, H100)  # the entry itself serves its own shape as tuned
    assert exact is not None and (exact.source, exact.config) == (
        "exact", SPEC.space.validate(cfg(1)))


def test_the_template_dispatcher_lends_its_nearest_config(tmp_path, monkeypatch):
    here = interpreter_device()
    tuned = AttentionProblem(4, 4, 1, 1, 4096, 32, True, "fp16")
    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    monkeypatch.setenv("FLASHTUNE_CONFIG_DIR", "")
    with open_store(url) as store:
        d = store.ensure_device(here)
        t = store.ensure_template(SPEC.name, SPEC.source_hash)
        pr = store.ensure_problem(SPEC.name, tuned.key(), tuned.bucket())
        store.offer_best(d.id, t.id, pr.id, config=cfg(1, bn=16), median_ms=1.0, tflops=1.0,
                         trial_id=None, trials_count=1)
    dispatch = Dispatcher(SPEC)
    dispatch.reload(db_url=url)
    assert dispatch.choose(tuned, here).config == cfg(1, bn=16)
    near = dispatch.choose(replace(tuned, batch=1), here)
    # 4 unsplit programs lend at most one program per SM (2 on the interpreter): B 1 -> 2
    assert near.source in ("bucket", "nearest") and near.config == cfg(2, bn=16)
    assert near.tuned_problem == tuned

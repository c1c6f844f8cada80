"""A model check of the Gluon forward's barrier protocol (``kernel.py``; no GPU, no triton).

Each partition of the kernel (the producer, one or two consumers) is written here as the
sequence of its mbarrier operations, in the kernel's order; a scheduler runs them in random
interleavings. An mbarrier completes a phase after ``count`` arrivals; ``wait(parity)``
passes once the phase of that parity has completed (a fresh barrier counts as phase 1
complete). Every wait also carries the absolute phase it means, and the model fails if a
barrier has run a whole phase past a waiter (parity would then lie) or if no partition can
move (deadlock).

    python -m flashtune.kernel_templates.attn_fwd_gluon.protocol
    # one tile of up to 8 key blocks (every n_mine) or 2-4 tiles, stages 2-4: check_all()

A persistent CTA (``PERSISTENT``) runs several tiles: the model runs a sequence of them, with
the phases carried over as the kernel carries them (``kv_base``, steps, the tile count) and
``q_empty`` guarding each consumer's Q buffer; with ``Q_BUFFERS`` 2 the tiles alternate
between two sets of Q buffers, each set's barriers a phase per two tiles. ``SPLIT_KV``: a
K buffer is released (``kv_empty``) once its ``S`` is done, a V buffer (``v_empty``) once
its ``P V`` is. The model also tracks which K, V and Q buffers a consumer's wgmmas read,
and fails when a load lands in one. :data:`MUTATIONS` are bugs the model must catch
(a test plants each). It checks the protocol, not the kernel: keep it in step with
``_producer``/``_consumer``.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

__all__ = ["MUTATIONS", "Bar", "check_all", "main", "run"]


class Bar:
    """An mbarrier: a phase completes after ``count`` arrivals."""

    def __init__(self, count: int) -> None:
        self.count, self.pending, self.phase = count, count, 0

    def arrive(self) -> None:
        """One arrival; the last of a phase completes it."""
        self.pending -= 1
        if self.pending == 0:
            self.phase, self.pending = self.phase + 1, self.count

    def passes(self, parity: int, absolute: int) -> bool:
        """Whether ``wait(parity)`` passes now, for a waiter that means phase ``absolute``
        (``AssertionError`` when the barrier has run a whole phase past it)."""
        if self.phase >= absolute + 2:
            raise AssertionError(f"barrier ran ahead: phase {self.phase}, waiter {absolute}")
        ok = (self.phase & 1) != parity
        assert not ok or self.phase == absolute + 1, \
            f"a wait meant to pass at phase {absolute + 1} passed at phase {self.phase}"
        return ok


# ("arrive", barrier) or ("wait", barrier, parity, absolute phase)
Op = tuple[Any, ...]

# deliberate bugs the model must catch (tests/kernel_templates_tests/test_gluon_fwd_compile.py)
MUTATIONS = ("no_drain", "no_q_empty_wait", "phases_per_tile", "kv_empty_count_1",
             "tma_store_early_q_release", "q_parity_per_tile", "split_kv_v_with_k")


def run(n_total: int | list[int], n_mine0: int | list[int], stages: int, consumers: int,
        pingpong: int, seed: int, mutation: str | None = None, tma_store: int = 0,
        q_buffers: int = 1, split_kv: int = 0) -> None:
    """One random interleaving of a CTA's partitions over its tiles: for tile ``i`` the
    producer loads each consumer's Q (once that consumer has released the last tile's) and
    ``n_total[i]`` key blocks into ``stages`` buffers; consumer 0 uses ``n_mine0[i]`` of them
    (fewer when causal), the others all. Integers mean one tile (a CTA per tile); lists, a
    persistent CTA. ``AssertionError`` on a deadlock, a barrier a phase ahead of its waiter,
    or a Q buffer overwritten while its consumer still reads it; ``mutation`` (one of
    :data:`MUTATIONS`) plants a bug. ``tma_store``: a consumer writes O into its Q buffer
    for the TMA store, so it releases the buffer after the tile's epilogue, not once its
    last ``S`` is done. ``q_buffers``: tile ``i`` uses set ``i % q_buffers`` of the Q
    buffers, whose barriers complete a phase per ``q_buffers`` tiles (the mutation
    ``q_parity_per_tile`` takes the parity from the tile count instead). ``split_kv``: K
    and V buffers released apart (the mutation ``split_kv_v_with_k`` releases V's with
    K's, before its ``P V`` is done)."""
    totals = [n_total] if isinstance(n_total, int) else list(n_total)
    mines0 = [n_mine0] if isinstance(n_mine0, int) else list(n_mine0)
    S = stages
    k_ready = [Bar(1) for _ in range(S)]
    v_ready = [Bar(1) for _ in range(S)]
    kv_empty = [Bar(1 if mutation == "kv_empty_count_1" else consumers) for _ in range(S)]
    v_empty = [Bar(consumers) for _ in range(S)] if split_kv else kv_empty
    k_reading = [0] * S  # consumers whose wgmmas read the buffer now
    v_reading = [0] * S
    turn = [Bar(1), Bar(1)]
    q_bar = [Bar(1) for _ in range(q_buffers * consumers)]
    q_empty = [Bar(1) for _ in range(q_buffers * consumers)]
    q_reading = [False] * (q_buffers * consumers)  # a consumer reads the buffer (S, epilogue)

    def q_slot(i: int, c: int) -> tuple[int, int, int]:
        """(buffer, parity, absolute phase) of consumer ``c``'s Q in tile ``i``."""
        n = i // q_buffers
        parity = (i if mutation == "q_parity_per_tile" else n) & 1
        return (i % q_buffers) * consumers + c, parity, n

    def bases() -> Iterator[tuple[int, int, int]]:
        """(tile index, key blocks before it, steps before it) per tile."""
        kv = 0
        for i, n in enumerate(totals):
            if mutation == "phases_per_tile":
                kv = 0
            yield i, kv, kv + i
            kv += n

    def load_q(slot: int) -> Iterator[Op]:
        assert not q_reading[slot], f"Q buffer {slot} overwritten while its consumer reads it"
        yield ("arrive", q_bar[slot])

    def producer() -> Iterator[Op]:
        for i, kv, _ in bases():
            for c in range(consumers):
                slot, parity, n = q_slot(i, c)
                if mutation != "no_q_empty_wait":
                    yield ("wait", q_empty[slot], parity ^ 1, n - 1)
                yield from load_q(slot)
            for j in range(totals[i]):
                g = kv + j
                yield ("wait", kv_empty[g % S], ((g // S) & 1) ^ 1, g // S - 1)
                assert not k_reading[g % S], f"K buffer {g % S} overwritten while read"
                yield ("arrive", k_ready[g % S])
                if split_kv:
                    yield ("wait", v_empty[g % S], ((g // S) & 1) ^ 1, g // S - 1)
                assert not v_reading[g % S], f"V buffer {g % S} overwritten while read"
                yield ("arrive", v_ready[g % S])

    def consumer(cid: int) -> Iterator[Op]:
        def my_turn(step: int) -> Iterator[Op]:
            if pingpong:
                yield ("wait", turn[cid], (step & 1) ^ (1 - cid), step - 1 if cid == 0 else step)

        def their_turn() -> Iterator[Op]:
            if pingpong:
                yield ("arrive", turn[1 - cid])

        def wait(bar: list[Bar], g: int) -> Op:
            return ("wait", bar[g % S], (g // S) & 1, g // S)

        early_v = split_kv and mutation == "split_kv_v_with_k"

        def release_k(g: int) -> Iterator[Op]:
            """S of block g is done: K's read ends (SPLIT_KV: its buffer is free)."""
            k_reading[g % S] -= 1
            if split_kv:
                yield ("arrive", kv_empty[g % S])
            if early_v:
                yield ("arrive", v_empty[g % S])

        def release_v(g: int) -> Iterator[Op]:
            """P V of block g is done: V's read ends, the buffer (both, without
            SPLIT_KV) is free."""
            v_reading[g % S] -= 1
            if not early_v:
                yield ("arrive", v_empty[g % S])

        for i, kv, steps in bases():
            n_tot = totals[i]
            n_mine = mines0[i] if cid == 0 else n_tot
            slot, parity, n = q_slot(i, cid)
            yield ("wait", q_bar[slot], parity, n)
            q_reading[slot] = True
            yield from my_turn(steps)
            yield wait(k_ready, kv)
            k_reading[kv % S] += 1
            yield from their_turn()
            yield from release_k(kv)
            for j in range(1, n_mine):
                yield from my_turn(steps + j)
                yield wait(k_ready, kv + j)
                k_reading[(kv + j) % S] += 1
                yield wait(v_ready, kv + j - 1)
                v_reading[(kv + j - 1) % S] += 1
                yield from their_turn()
                yield from release_k(kv + j)
                yield from release_v(kv + j - 1)
            if not tma_store:
                q_reading[slot] = False
            if not tma_store or mutation == "tma_store_early_q_release":
                yield ("arrive", q_empty[slot])
            last = kv + n_mine - 1
            yield from my_turn(steps + n_mine)
            yield wait(v_ready, last)
            v_reading[last % S] += 1
            yield from their_turn()
            yield from release_v(last)
            if mutation != "no_drain":
                for j in range(n_mine, n_tot):
                    yield from my_turn(steps + j + 1)
                    yield from their_turn()
                    yield wait(k_ready, kv + j)
                    yield wait(v_ready, kv + j)
                    yield ("arrive", kv_empty[(kv + j) % S])
                    if split_kv:
                        yield ("arrive", v_empty[(kv + j) % S])
            if tma_store:  # the epilogue: O through the Q buffer, then the buffer is free
                q_reading[slot] = False
                if mutation != "tma_store_early_q_release":
                    yield ("arrive", q_empty[slot])

    parts = [producer()] + [consumer(c) for c in range(consumers)]
    ops = [next(p) for p in parts]
    alive = [True] * len(parts)
    rnd = random.Random(seed)
    while any(alive):
        ready = [i for i, op in enumerate(ops) if alive[i]
                 and (op[0] == "arrive" or op[1].passes(op[2], op[3]))]
        if not ready:
            raise AssertionError(f"deadlock: {[op[0] for op in ops]}")
        i = rnd.choice(ready)
        if ops[i][0] == "arrive":
            ops[i][1].arrive()
        try:
            ops[i] = next(parts[i])
        except StopIteration:
            alive[i] = False


def _shapes(consumers: int) -> Iterator[tuple[Any, Any]]:
    """``(n_total, n_mine0)`` cases: one tile of up to 8 key blocks with every causal split,
    then persistent CTAs of 2-4 tiles (causal tiles shrink, as the scheduler orders them)."""
    for n_total in range(1, 9):
        for n_mine0 in range(1, n_total + 1):
            if consumers == 1 and n_mine0 != n_total:
                continue
            yield n_total, n_mine0
    for totals in ([3, 3], [1, 1, 1], [5, 2, 1], [4, 3, 2, 1], [2, 7, 1], [6, 6, 6]):
        for split in (0, 1):
            mines = [max(1, n - split) if consumers > 1 else n for n in totals]
            yield totals, mines


def check_all(mutation: str | None = None, seeds: int = 30) -> int:
    """Every case of :func:`_shapes`, stages 2-4, one to three consumers (two with and
    without ping-pong), with and without ``TMA_STORE`` and ``SPLIT_KV``, persistent CTAs
    with one and two sets of Q buffers, ``seeds`` seeds each; returns the number of interleavings run
    (``AssertionError`` on the first bad one)."""
    runs = 0
    for stages in (2, 3, 4):
        for consumers, pingpong in ((1, 0), (2, 0), (2, 1), (3, 0)):
            for totals, mines in _shapes(consumers):
                for tma_store in (0, 1):
                    for q_buffers in (1, 2) if isinstance(totals, list) else (1,):
                        for split_kv in (0, 1):
                            for seed in range(seeds):
                                run(totals, mines, stages, consumers, pingpong, seed,
                                    mutation, tma_store, q_buffers, split_kv)
                                runs += 1
    return runs


def main() -> None:
    """:func:`check_all`, and a line saying so."""
    print(f"{check_all()} interleavings: no deadlock, no barrier a phase ahead of its waiter")


if __name__ == "__main__":
    main()

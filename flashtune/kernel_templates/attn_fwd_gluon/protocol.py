"""A model check of the Gluon forward's barrier protocol (``kernel.py``; no GPU, no triton).

Each partition of the kernel (the producer, one or two consumers) is written here as the
sequence of its mbarrier operations, in the kernel's order; a scheduler runs them in random
interleavings. An mbarrier completes a phase after ``count`` arrivals; ``wait(parity)``
passes once the phase of that parity has completed (a fresh barrier counts as phase 1
complete). Every wait also carries the absolute phase it means, and the model fails if a
barrier has run a whole phase past a waiter (parity would then lie) or if no partition can
move (deadlock).

    python -m flashtune.kernel_templates.attn_fwd_gluon.protocol
    # all n_total <= 8, every n_mine, stages 2-4: check_all()

It checks the protocol, not the kernel: keep it in step with ``_producer``/``_consumer``.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

__all__ = ["Bar", "check_all", "main", "run"]


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
        assert not ok or self.phase == absolute + 1
        return ok


# ("arrive", barrier) or ("wait", barrier, parity, absolute phase)
Op = tuple[Any, ...]


def run(n_total: int, n_mine0: int, stages: int, consumers: int, pingpong: int,
        seed: int) -> None:
    """One random interleaving of a CTA's partitions: the producer loads ``n_total`` key
    blocks into ``stages`` buffers, consumer 0 uses ``n_mine0`` of them (fewer when causal),
    the others all; ``AssertionError`` on a deadlock or a barrier a phase ahead."""
    S = stages
    k_ready = [Bar(1) for _ in range(S)]
    v_ready = [Bar(1) for _ in range(S)]
    kv_empty = [Bar(consumers) for _ in range(S)]
    turn = [Bar(1), Bar(1)]
    q_bar = [Bar(1) for _ in range(consumers)]

    def producer() -> Iterator[Op]:
        for c in range(consumers):
            yield ("arrive", q_bar[c])
        for j in range(n_total):
            yield ("wait", kv_empty[j % S], ((j // S) & 1) ^ 1, j // S - 1)
            yield ("arrive", k_ready[j % S])
            yield ("arrive", v_ready[j % S])

    def consumer(cid: int, n_mine: int) -> Iterator[Op]:
        def my_turn(step: int) -> Iterator[Op]:
            if pingpong:
                yield ("wait", turn[cid], (step & 1) ^ (1 - cid), step - 1 if cid == 0 else step)

        def their_turn() -> Iterator[Op]:
            if pingpong:
                yield ("arrive", turn[1 - cid])

        yield ("wait", q_bar[cid], 0, 0)
        yield from my_turn(0)
        yield ("wait", k_ready[0], 0, 0)
        yield from their_turn()
        for j in range(1, n_mine):
            yield from my_turn(j)
            yield ("wait", k_ready[j % S], (j // S) & 1, j // S)
            yield ("wait", v_ready[(j - 1) % S], ((j - 1) // S) & 1, (j - 1) // S)
            yield from their_turn()
            yield ("arrive", kv_empty[(j - 1) % S])
        last = n_mine - 1
        yield from my_turn(n_mine)
        yield ("wait", v_ready[last % S], (last // S) & 1, last // S)
        yield from their_turn()
        yield ("arrive", kv_empty[last % S])
        for j in range(n_mine, n_total):
            yield from my_turn(j + 1)
            yield from their_turn()
            yield ("wait", k_ready[j % S], (j // S) & 1, j // S)
            yield ("wait", v_ready[j % S], (j // S) & 1, j // S)
            yield ("arrive", kv_empty[j % S])

    n_mines = [n_mine0] + [n_total] * (consumers - 1)
    parts = [producer()] + [consumer(c, n_mines[c]) for c in range(consumers)]
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


def check_all() -> int:
    """Every ``n_total`` <= 8, every ``n_mine`` of consumer 0, stages 2-4, one or two
    consumers, with and without ping-pong, 30 seeds each; returns the number of
    interleavings run (``AssertionError`` on the first bad one)."""
    runs = 0
    for n_total in range(1, 9):
        for n_mine0 in range(1, n_total + 1):
            for stages in (2, 3, 4):
                for consumers, pingpong in ((1, 0), (2, 0), (2, 1)):
                    if consumers == 1 and n_mine0 != n_total:
                        continue
                    for seed in range(30):
                        run(n_total, n_mine0, stages, consumers, pingpong, seed)
                        runs += 1
    return runs


def main() -> None:
    """:func:`check_all`, and a line saying so."""
    print(f"{check_all()} interleavings: no deadlock, no barrier a phase ahead of its waiter")


if __name__ == "__main__":
    main()

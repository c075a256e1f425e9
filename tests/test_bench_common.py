"""The benchmarks' timing loops (kvpool.bench.common): which op runs when.

Every ratio ``kvpool bench`` reports rests on these orders, so they are checked
exactly, as vLLM's block pool tests check its free list's order.
"""

from __future__ import annotations

from collections import Counter
from itertools import pairwise

import pytest

from kvpool.bench.common import balanced_orders, item_by_item


@pytest.mark.parametrize("n", range(1, 8))
def test_balanced_orders_give_every_position_and_every_predecessor_equally(n: int) -> None:
    orders = balanced_orders(n)
    assert len(orders) == (2 * n if n % 2 and n > 1 else n)
    assert all(sorted(order) == list(range(n)) for order in orders)
    positions = Counter((op, k) for order in orders for k, op in enumerate(order))
    assert set(positions.values()) == {len(orders) // n}  # each op in each place alike
    pairs = Counter((a, b) for order in orders for a, b in pairwise(order))
    assert len(pairs) == n * (n - 1)  # every op right after every other one ...
    assert len(set(pairs.values())) <= 1  # ... equally often


def test_item_by_item_runs_every_op_on_an_item_before_the_next_item() -> None:
    log: list[tuple[str, int]] = []

    def op(name: str) -> object:
        return lambda i: log.append((name, i))

    ops = {"a": op("a"), "b": op("b"), "c": op("c")}
    timings = item_by_item(64, ops, count=2, rounds=2, prepare={"b": op("prep-b")})
    orders = balanced_orders(3)  # [[0, 1, 2], [1, 2, 0], [2, 0, 1], their mirrors]
    names = "abc"
    expected = [("a", 0), ("prep-b", 0), ("b", 0), ("c", 0)]  # warm-up: the given order
    expected += [("a", 1), ("prep-b", 1), ("b", 1), ("c", 1)]
    for r in (1, 2):
        for i in (0, 1):
            for k in orders[(r * 2 + i) % len(orders)]:
                expected += [("prep-b", i)] if names[k] == "b" else []
                expected.append((names[k], i))
    assert log == expected
    assert all(len(t.latencies) == 4 and t.size == 64 for t in timings.values())  # untimed warm-up

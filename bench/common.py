"""Shared benchmark plumbing: size lists, timing loops, percentiles, output.

Every benchmark pre-faults its buffers before timing (first touch of fresh
memory runs at ~0.45 GB/s here and would swamp the result) and measures its
baseline in the same run, so the ratio survives a noisy shared machine.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from kvpool.config import format_size


def faulted(nbytes: int, fill: int | None = None) -> np.ndarray:
    """A uint8 buffer whose pages are all touched (random-ish contents if fill is None)."""
    buffer = np.empty(nbytes, dtype=np.uint8)
    if fill is None:
        buffer[:] = np.arange(nbytes, dtype=np.uint64).astype(np.uint8)
    else:
        buffer.fill(fill)
    return buffer


PAGE = 4096


def page_rounded(size: int) -> int:
    """``size`` rounded up to whole 4 KiB pages (what an arena allocation takes)."""
    return -(-size // PAGE) * PAGE


def count_for(size: int, working_set: int = 128 << 20, lo: int = 8, hi: int = 2048) -> int:
    """Buffers to rotate through so the working set exceeds the CPU caches.

    ``hi`` leaves small blocks their whole working set: capped at 512, 64 KiB blocks
    rotated over 32 MiB, which a host's shared last-level cache (480 MiB on the Intel
    class of session 31) partly holds, by an amount its other tenants decide. There two
    identical 64 KiB copies from two buffer sets of 32 MiB, paired op by op, read
    0.70-0.99x each other run to run; of 64 or 128 MiB, 0.98-1.01x (bench/RESULTS.md,
    "Session 31")."""
    return int(min(hi, max(lo, working_set // size)))


@dataclass
class Timing:
    """Per-operation latencies (seconds) for ops of ``size`` bytes."""

    size: int
    latencies: list[float]

    @property
    def gbps(self) -> float:
        """Throughput at the median latency: robust to a noisy neighbour's stalls."""
        return self.size / float(np.median(self.latencies)) / 1e9

    def percentile_us(self, q: float) -> float:
        return float(np.percentile(self.latencies, q) * 1e6)


def time_ops(
    size: int,
    op: Callable[[int], object],
    count: int,
    rounds: int,
    reset: Callable[[], object] | None = None,
    warm_up: bool = True,
) -> Timing:
    """Time ``op(i)`` for i in range(count), ``rounds`` times, after one warm-up round.

    ``reset`` runs untimed before every round (e.g. removing what puts stored).
    """
    if warm_up:
        for i in range(count):
            op(i)
    latencies = []
    clock = time.perf_counter
    for _ in range(rounds):
        if reset is not None:
            reset()
        for i in range(count):
            start = clock()
            op(i)
            latencies.append(clock() - start)
    return Timing(size, latencies)


def interleaved(
    size: int,
    ops: Mapping[str, Callable[[int], object]],
    count: int,
    rounds: int,
    resets: Mapping[str, Callable[[], object]] | None = None,
) -> dict[str, Timing]:
    """Time several ops round-robin (one round of each in turn, ``rounds`` times), so
    that a noisy neighbour hits ours and the baseline alike."""
    resets = resets or {}
    timings = {name: Timing(size, []) for name in ops}
    for name, op in ops.items():  # warm-up round of each
        time_ops(size, op, count, 0, resets.get(name))
    for _ in range(rounds):
        for name, op in ops.items():
            timings[name].latencies += time_ops(
                size, op, count, 1, resets.get(name), warm_up=False
            ).latencies
    return timings


def balanced_orders(n: int) -> list[list[int]]:
    """Orders of ``n`` ops in which each op takes every position equally often and
    follows every other op right before it equally often (a Williams design: n
    orders for even n, 2n for odd n)."""
    first = [0]
    low, high = 1, n - 1
    while len(first) < n:
        first.append(low)
        low += 1
        if len(first) < n:
            first.append(high)
            high -= 1
    orders = [[(op + shift) % n for op in first] for shift in range(n)]
    if n % 2 and n > 1:
        orders += [order[::-1] for order in orders]
    return orders


def item_by_item(
    size: int,
    ops: Mapping[str, Callable[[int], object]],
    count: int,
    rounds: int,
    prepare: Mapping[str, Callable[[int], object]] | None = None,
) -> dict[str, Timing]:
    """Time several ops item by item: every op on item i, then every op on item i+1.

    Item after item the ops take the next of the ``balanced_orders``, so each op
    runs first, second, ... equally often and right after each of the others
    equally often (a device that is faster for a write after a write favours no
    op). Where the measured resource drifts over the second a whole round takes
    (this class's virtual disk moved a raw 1 MiB read 390-720 us within minutes,
    issue 17 session 42), ``interleaved``'s round-level alternation lets the drift
    decide a comparison; here every op meets the same moment of the device.
    ``prepare[name](i)`` runs untimed right before ``ops[name](i)`` (e.g. dropping
    what the previous round's put of item i stored). One untimed warm-up pass runs
    first, the ops in their given order.
    """
    prepare = prepare or {}
    names = list(ops)
    orders = balanced_orders(len(names))
    timings = {name: Timing(size, []) for name in names}
    clock = time.perf_counter
    for r in range(rounds + 1):
        for i in range(count):
            order = orders[(r * count + i) % len(orders)] if r else range(len(names))
            for name in (names[k] for k in order):
                if (before := prepare.get(name)) is not None:
                    before(i)
                start = clock()
                ops[name](i)
                took = clock() - start
                if r:
                    timings[name].latencies.append(took)
    return timings


def paired(
    size: int,
    base: Callable[[int], object],
    ours: Callable[[int], object],
    n: int,
    rounds: int,
    reset: Callable[[], object] | None = None,
) -> tuple[Timing, Timing]:
    """(baseline, ours), alternated op by op after one untimed warm-up round.

    Op i of ours touches item (i + n/2) mod n, never the one the baseline just
    touched, so neither side reads the other's cache-warm data. Which side goes
    first in each pair alternates round by round: an op right after the other
    side's runs measurably slower (e.g. ~10-15 us at 64 KiB over TCP, issue 17),
    so a fixed order would favour one side. ``reset`` runs untimed before every
    round (e.g. removing the keys the previous puts stored).
    """
    b, o = Timing(size, []), Timing(size, [])
    clock = time.perf_counter
    half = n // 2
    for r in range(rounds + 1):
        if reset is not None:
            reset()
        first, second = (base, ours) if r % 2 else (ours, base)
        for i in range(n):
            j = (i + half) % n
            t0 = clock()
            first(i if r % 2 else j)
            t1 = clock()
            second(j if r % 2 else i)
            t2 = clock()
            if r:
                tb, to = (t1 - t0, t2 - t1) if r % 2 else (t2 - t1, t1 - t0)
                b.latencies.append(tb)
                o.latencies.append(to)
    return b, o


@dataclass
class Row:
    """One result line: ours against the baseline measured in the same run."""

    op: str
    tier: str
    size: int
    gbps: float
    baseline_gbps: float
    ratio: float
    p50_us: float
    p99_us: float
    baseline: str


def gbps_figure(gbps: float) -> float:
    """GB/s to four significant digits, not three decimals: a slow row (0.02 GB/s
    under load) keeps its precision, so value / baseline reproduces the ratio."""
    return float(f"{gbps:.4g}")


def make_row(op: str, tier: str, ours: Timing, base: Timing, baseline: str) -> Row:
    return Row(
        op=op,
        tier=tier,
        size=ours.size,
        gbps=gbps_figure(ours.gbps),
        baseline_gbps=gbps_figure(base.gbps),
        ratio=round(ours.gbps / base.gbps, 3),
        p50_us=round(ours.percentile_us(50), 1),
        p99_us=round(ours.percentile_us(99), 1),
        baseline=baseline,
    )


def print_table(rows: Sequence[Row]) -> None:
    tier = max([7, *(len(r.tier) for r in rows)])  # a veth link's name runs longer
    header = f"{'op':<9} {'tier':<{tier}} {'size':>7} {'GB/s':>7} {'base':>7} {'ratio':>6} "
    print(header + f"{'p50 us':>9} {'p99 us':>9}  baseline")
    for r in rows:
        print(
            f"{r.op:<9} {r.tier:<{tier}} {format_size(r.size):>7} {r.gbps:>7.2f} "
            f"{r.baseline_gbps:>7.2f} {r.ratio:>6.2f} {r.p50_us:>9.1f} {r.p99_us:>9.1f}  "
            f"{r.baseline}"
        )


def write_json(path: str | None, payload: Any) -> None:
    if path:
        if isinstance(payload, list):
            payload = [asdict(p) if hasattr(p, "__dataclass_fields__") else p for p in payload]
        with open(path, "w") as f:
            json.dump(payload, f, indent=2)

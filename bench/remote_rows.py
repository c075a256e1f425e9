"""The rows of ``kvpool bench remote``: one store's op against the raw baseline
measured in the same run, for kvpool and for a peer store (Mooncake) alike."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvpool.bench.common import Timing
from kvpool.config import format_size


@dataclass
class RemoteRow:
    """One result line: ours against the baseline measured in the same run."""

    op: str
    transport: str
    size: int  # bytes per block (batch rows: per block too)
    gbps: float
    baseline: str
    baseline_gbps: float
    ratio: float
    p50_us: float  # per call (batch rows: per batch call)
    p99_us: float
    batch: int = 1
    store: str = "kvpool"


def remote_row(op: str, transport: str, size: int, ours: Timing, base: Timing,
               baseline: str, batch: int = 1, store: str = "kvpool") -> RemoteRow:  # fmt: skip
    return RemoteRow(
        op=op,
        transport=transport,
        size=size,
        gbps=round(ours.gbps, 3),
        baseline=baseline,
        baseline_gbps=round(base.gbps, 3),
        ratio=round(ours.gbps / base.gbps, 3),
        p50_us=round(ours.percentile_us(50), 1),
        p99_us=round(ours.percentile_us(99), 1),
        batch=batch,
        store=store,
    )


def print_rows(rows: Sequence[RemoteRow]) -> None:
    header = f"{'store':<8} {'op':<15} {'transport':<9} {'size':>7} {'GB/s':>7} {'base':>7} "
    print(header + f"{'ratio':>6} {'p50 us':>9} {'p99 us':>9}  baseline")
    for r in rows:
        print(
            f"{r.store:<8} {r.op:<15} {r.transport:<9} {format_size(r.size):>7} {r.gbps:>7.2f} "
            f"{r.baseline_gbps:>7.2f} {r.ratio:>6.2f} {r.p50_us:>9.1f} {r.p99_us:>9.1f}  "
            f"{r.baseline}"
        )


def on_cpus(cpus: set[int] | None) -> Callable[[], None] | None:
    """A ``preexec_fn`` that pins a child process to ``cpus`` (None: no pinning)."""
    return (lambda: os.sched_setaffinity(0, cpus)) if cpus else None

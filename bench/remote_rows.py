"""The rows of ``kvpool bench remote``: one store's op against the raw baseline
measured in the same run, for kvpool and for a peer store (Mooncake) alike, and
those baselines (``Baselines``), so both stores are paired with the same ones."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from kvpool.bench.common import Timing, gbps_figure
from kvpool.bench.remote_transport import RawClient
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


@dataclass
class Baselines:
    """The raw side of each op, paired op by op with a store's: ``put`` / ``get`` take
    a block's index, the batches a group's index; with the names rows give them."""

    put: Callable[[int], object]
    get: Callable[[int], object]
    put_batch: Callable[[int], object]
    get_batch: Callable[[int], object]
    name: str  # of put and get
    put_batch_name: str
    get_batch_name: str

    @classmethod
    def numpy_copy(
        cls,
        srcs: list[np.ndarray],
        outs: list[np.ndarray],
        peer: list[np.ndarray],
        groups: list[list[int]],
    ) -> Baselines:
        """``np.copyto`` to and from ``peer`` (the same-host transport's ceiling)."""

        def put_batch(g: int) -> None:
            for i in groups[g]:
                np.copyto(peer[i], srcs[i])

        def get_batch(g: int) -> None:
            for i in groups[g]:
                np.copyto(outs[i], peer[i])

        batch = f"numpy copy (x{len(groups[0])})"
        return cls(
            lambda i: np.copyto(peer[i], srcs[i]),
            lambda i: np.copyto(outs[i], peer[i]),
            put_batch,
            get_batch,
            "numpy copy",
            batch,
            batch,
        )

    @classmethod
    def raw_socket(
        cls,
        raw: RawClient,
        size: int,
        srcs: list[np.ndarray],
        outs: list[np.ndarray],
        groups: list[list[int]],
    ) -> Baselines:
        """The raw socket server's request/response ops on block i's range (``i *
        size``), a batch of puts back to back, and one request streaming a batch's
        ranges (the socket's ceiling for a batch of reads)."""
        offs = [i * size for i in range(len(srcs))]

        def put_batch(g: int) -> None:
            for i in groups[g]:
                raw.put(offs[i], srcs[i])

        def get_batch(g: int) -> None:
            raw.stream(offs[groups[g][0]], [outs[i] for i in groups[g]])

        n = len(groups[0])
        return cls(
            lambda i: raw.put(offs[i], srcs[i]),
            lambda i: raw.get(offs[i], outs[i]),
            put_batch,
            get_batch,
            "raw socket req/resp",
            f"raw socket req/resp (x{n})",
            f"raw socket stream (x{n})",
        )


def remote_row(op: str, transport: str, size: int, ours: Timing, base: Timing,
               baseline: str, batch: int = 1, store: str = "kvpool") -> RemoteRow:  # fmt: skip
    return RemoteRow(
        op=op,
        transport=transport,
        size=size,
        gbps=gbps_figure(ours.gbps),
        baseline=baseline,
        baseline_gbps=gbps_figure(base.gbps),
        ratio=round(ours.gbps / base.gbps, 3),
        p50_us=round(ours.percentile_us(50), 1),
        p99_us=round(ours.percentile_us(99), 1),
        batch=batch,
        store=store,
    )


def print_rows(rows: Sequence[RemoteRow]) -> None:
    width = max([9, *(len(r.transport) for r in rows)])  # a veth link's name runs longer
    header = f"{'store':<8} {'op':<15} {'transport':<{width}} {'size':>7} {'GB/s':>7} "
    print(header + f"{'base':>7} {'ratio':>6} {'p50 us':>9} {'p99 us':>9}  baseline")
    for r in rows:
        print(
            f"{r.store:<8} {r.op:<15} {r.transport:<{width}} {format_size(r.size):>7} "
            f"{r.gbps:>7.2f} "
            f"{r.baseline_gbps:>7.2f} {r.ratio:>6.2f} {r.p50_us:>9.1f} {r.p99_us:>9.1f}  "
            f"{r.baseline}"
        )


def on_cpus(cpus: set[int] | None) -> Callable[[], None] | None:
    """A ``preexec_fn`` that pins a child process to ``cpus`` (None: no pinning)."""
    return (lambda: os.sched_setaffinity(0, cpus)) if cpus else None

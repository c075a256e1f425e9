"""``kvpool bench burst``: back-to-back same-host puts into a full pool, vs numpy's copy.

``kvpool bench remote`` times each put alone and reports the median: the put's
own path. A program that stores blocks in a loop gets the mean, and that also
pays for the work each put leaves to the servers -- the node adopting the seal
and committing the block, the claims and grants taken ahead for the next puts,
the master's commit and, once the pool is full, its eviction -- as soon as the
puts outrun it. So this suite starts a real master and node (``kvpool bench
remote``'s CPU split: client on one half of the CPUs, servers on the other)
whose node holds ``--pool`` bytes, fills it with blocks of each ``--sizes``,
then times ``--bursts`` bursts of ``--burst`` puts under new keys (each put
evicts an old block), interleaved burst by burst with as many ``np.copyto``
calls of the same bytes into pre-faulted buffers (the baseline, which leaves
no work behind).

Per size: the puts' mean and p50, the copies' mean, the ratio (copy / put mean,
higher is better) and the CPU time the master and the node spent per put
(``/proc/PID/stat``, in clock ticks: coarse for short bursts), each the median
over the bursts after one warm-up burst.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvpool.api import KVStore
from kvpool.args import positive_int, size_arg, sizes_arg


@dataclass
class BurstRow:
    size: int  # bytes per put
    fill: int  # blocks in the pool before the bursts (each put evicts one)
    burst: int  # puts per burst
    mean_us: float  # per put: the mean of the burst's put latencies
    p50_us: float
    copy_us: float  # per np.copyto of the same bytes, the copy burst's mean
    ratio: float  # copy_us / mean_us
    master_cpu_us: float  # per put
    node_cpu_us: float  # per put


def run_burst(
    sizes: Sequence[int], pool_bytes: int, burst: int, bursts: int, pin: bool = True
) -> list[BurstRow]:
    """One row per size, each from its own cluster (see the module docstring)."""
    from kvpool.bench.common import page_rounded

    if burst < 1 or bursts < 1:
        raise ValueError("--burst and --bursts must be at least 1")
    if any(pool_bytes < 2 * page_rounded(size) for size in sizes):
        raise ValueError("--pool must hold at least two blocks of every size")
    return [_one_size(size, pool_bytes, burst, bursts, pin) for size in sizes]


def _one_size(size: int, pool_bytes: int, burst: int, bursts: int, pin: bool) -> BurstRow:
    from kvpool.bench.common import count_for, faulted, page_rounded
    from kvpool.bench.machine import process_cpu_s
    from kvpool.bench.remote_procs import cluster_processes, connect_client
    from kvpool.bench.remote_transport import pinned, split_cpus
    from kvpool.cluster.client.grants import DEFAULT_GRANT_BYTES
    from kvpool.index.keys import Namespace, block_keys

    split = split_cpus() if pin else None
    client_cpus, server_cpus = split if split else (None, None)
    block = page_rounded(size)
    fill = pool_bytes // block
    # Room for the fill and for the client's stock of grants: from the first burst on,
    # every new block's space comes from evicting an old one.
    dram = fill * block + DEFAULT_GRANT_BYTES
    src = faulted(size)
    peers = [faulted(size, fill=1) for _ in range(count_for(size, 64 << 20))]
    puts: list[list[float]] = []
    copies, master_cpu, node_cpu = [], [], []
    with cluster_processes(dram, server_cpus, DEFAULT_GRANT_BYTES / dram) as (url, procs):
        pool = connect_client(url, "shm")
        try:
            with pinned(client_cpus):
                ns = Namespace(f"burst-fill-{size}")
                for start in range(0, fill, 512):
                    ids = np.arange(start, min(fill, start + 512), dtype=np.int32)
                    pool.put_batch(block_keys(ids, ns, block_tokens=1), [src] * ids.size)
                pool.flush()
                ns = Namespace(f"burst-{size}")
                for b in range(bursts + 1):  # the first warms up
                    ids = np.arange(b * burst, (b + 1) * burst, dtype=np.int32)
                    keys = block_keys(ids, ns, block_tokens=1)
                    copy_first = b % 2 == 0  # which side runs first alternates
                    if copy_first:
                        copy_us = _copy_burst(src, peers, burst)
                    cpu0 = [process_cpu_s(p.pid) for p in procs]
                    times = _put_burst(pool, keys, src)
                    cpu1 = [process_cpu_s(p.pid) for p in procs]
                    if not copy_first:
                        copy_us = _copy_burst(src, peers, burst)
                    if b:
                        puts.append(times)
                        copies.append(copy_us)
                        master_cpu.append((cpu1[0] - cpu0[0]) / burst * 1e6)
                        node_cpu.append((cpu1[1] - cpu0[1]) / burst * 1e6)
        finally:
            pool.close()
    means = [sum(t) / len(t) * 1e6 for t in puts]
    mean_us, copy_us = statistics.median(means), statistics.median(copies)
    return BurstRow(
        size=size,
        fill=fill,
        burst=burst,
        mean_us=round(mean_us, 1),
        p50_us=round(statistics.median(statistics.median(t) for t in puts) * 1e6, 1),
        copy_us=round(copy_us, 2),
        ratio=round(copy_us / mean_us, 3),
        master_cpu_us=round(statistics.median(master_cpu), 1),
        node_cpu_us=round(statistics.median(node_cpu), 1),
    )


def _put_burst(pool: KVStore, keys: list[bytes], src: np.ndarray) -> list[float]:
    """Seconds per put, back to back."""
    clock, out = time.perf_counter, []
    for key in keys:
        start = clock()
        if not pool.put(key, src):
            raise RuntimeError("a burst's put found its new key already stored")
        out.append(clock() - start)
    return out


def _copy_burst(src: np.ndarray, peers: list[np.ndarray], count: int) -> float:
    """Microseconds per ``np.copyto`` of ``src``, ``count`` back to back (rotating over
    ``peers``, a working set past the CPU caches)."""
    n = len(peers)
    start = time.perf_counter()
    for i in range(count):
        np.copyto(peers[i % n], src)
    return (time.perf_counter() - start) / count * 1e6


def register_burst(suites: Any) -> None:
    parser = suites.add_parser(
        "burst", help="back-to-back same-host puts into a full pool: mean per put vs copy"
    )
    parser.add_argument("--sizes", type=sizes_arg, default="64KiB,1MiB")
    parser.add_argument(
        "--pool", type=size_arg, default="512MiB", help="the node's DRAM, filled first"
    )
    parser.add_argument("--burst", type=positive_int, default=4096, help="puts per burst")
    parser.add_argument("--bursts", type=positive_int, default=5)
    parser.add_argument("--no-pin", action="store_true", help="do not split CPUs between sides")
    parser.add_argument("--json", default=None, metavar="F")
    parser.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    from kvpool.bench.common import write_json
    from kvpool.config import format_size

    rows = run_burst(args.sizes, args.pool, args.burst, args.bursts, not args.no_pin)
    print(
        f"{'size':>7} {'fill':>7} {'burst':>6} {'mean us':>8} {'p50 us':>7} {'copy us':>8}"
        f" {'ratio':>6} {'master cpu us':>14} {'node cpu us':>12}"
    )
    for r in rows:
        print(
            f"{format_size(r.size):>7} {r.fill:>7} {r.burst:>6} {r.mean_us:>8.1f} {r.p50_us:>7.1f}"
            f" {r.copy_us:>8.2f} {r.ratio:>6.3f} {r.master_cpu_us:>14.1f} {r.node_cpu_us:>12.1f}"
        )
    write_json(args.json, rows)
    return 0

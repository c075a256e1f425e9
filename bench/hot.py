"""``kvpool bench hot``: many readers hammering a few hot blocks, replication off vs on.

Starts a master and ``--nodes`` storage nodes as processes and stores
``--blocks`` hot blocks (one replica each, so they land on one or two nodes).
Then ``--readers`` reader processes read those blocks round robin for
``--seconds`` over TCP (so every read is served by a node's data server, as
it would be from another host), first with automatic replication off
(``--no-auto-replicate``), then on. Reports the aggregate GB/s of all
readers, per-read p50/p99 latency and how many replicas each block ended
with. Both modes run in the same invocation, against fresh clusters.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import textwrap
import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from kvpool.api import KVStore
from kvpool.args import positive_int, seconds_arg, size_arg
from kvpool.bench.common import write_json
from kvpool.procs import Child, spawn_kvpool

READER = textwrap.dedent(
    """
    import json, sys, time
    import numpy as np
    import kvpool
    url, keys_hex, size, seconds, transport = sys.argv[1:6]
    keys = [bytes.fromhex(k) for k in keys_hex.split(",")]
    out = np.empty(int(size), np.uint8)
    out.fill(0)
    latencies, nbytes = [], 0
    with kvpool.connect(url, transport=transport, lease_cache_s=0.2) as pool:
        start = time.perf_counter()
        i = 0
        while time.perf_counter() - start < float(seconds) and i < 1_000_000:
            t = time.perf_counter()
            got = pool.get_into(keys[i % len(keys)], out)
            latencies.append(time.perf_counter() - t)
            nbytes += got or 0
            i += 1
        elapsed = time.perf_counter() - start
    print(json.dumps({"bytes": nbytes, "elapsed": elapsed, "latencies": latencies}))
    """
)


@dataclass
class HotRow:
    replication: str
    gbps: float
    reads: int
    p50_us: float
    p99_us: float
    replicas_per_block: float


def register_hot(suites: Any) -> None:
    parser = suites.add_parser("hot", help="readers hammering hot blocks, replication off vs on")
    parser.add_argument("--nodes", type=positive_int, default=3)
    parser.add_argument("--readers", type=positive_int, default=3)
    parser.add_argument("--blocks", type=positive_int, default=4)
    parser.add_argument("--block-size", type=size_arg, default="4MiB")
    parser.add_argument("--seconds", type=seconds_arg, default=5.0)
    parser.add_argument(
        "--transport", default="tcp", help="what readers use (tcp: served by nodes)"
    )
    parser.add_argument("--json", default=None, metavar="F")
    parser.set_defaults(func=_main)


def run_hot(
    nodes: int, readers: int, blocks: int, size: int, seconds: float, transport: str
) -> list[HotRow]:
    rows = []
    for mode, flags in (("off", ["--no-auto-replicate"]), ("on", ["--hot-reads", "4"])):
        rows.append(_one_mode(mode, flags, nodes, readers, blocks, size, seconds, transport))
    return rows


def _one_mode(
    mode: str,
    flags: list[str],
    nodes: int,
    readers: int,
    blocks: int,
    size: int,
    seconds: float,
    transport: str,
) -> HotRow:
    import kvpool

    procs: list[Child] = [spawn_kvpool(["master", "--port", "0", "--node-ttl", "3", *flags])]
    try:
        dram = max(64 << 20, 4 * blocks * size)
        for _ in range(nodes):
            procs.append(
                spawn_kvpool(
                    [
                        "node",
                        "--master",
                        procs[0].address,
                        "--dram",
                        str(dram),
                        "--heartbeat",
                        "0.3",
                    ]
                )
            )
        url = f"kvpool://{procs[0].address}"
        with kvpool.connect(url) as pool:
            _wait_for_nodes(pool, nodes)
            keys = kvpool.block_keys(np.arange(blocks * 16), kvpool.Namespace("hot"), 16)
            data = np.random.default_rng(0).integers(0, 255, size, dtype=np.uint8)
            pool.put_batch(keys, [data] * blocks)
            results = _run_readers(url, keys, size, seconds, readers, transport)
            replicas = np.mean([len(n) for n in pool.locate(keys)])
    finally:
        for proc in reversed(procs):
            proc.stop()
    latencies = np.concatenate([np.asarray(r["latencies"]) for r in results])
    total = sum(r["bytes"] for r in results)
    wall = max(r["elapsed"] for r in results)
    return HotRow(
        replication=mode,
        gbps=round(total / wall / 1e9, 3),
        reads=int(latencies.size),
        p50_us=round(float(np.percentile(latencies, 50)) * 1e6, 1),
        p99_us=round(float(np.percentile(latencies, 99)) * 1e6, 1),
        replicas_per_block=round(float(replicas), 2),
    )


def _run_readers(
    url: str, keys: list[bytes], size: int, seconds: float, readers: int, transport: str
) -> list[dict[str, Any]]:
    args = [url, ",".join(k.hex() for k in keys), str(size), str(seconds), transport]
    procs = [
        subprocess.Popen([sys.executable, "-c", READER, *args], stdout=subprocess.PIPE, text=True)
        for _ in range(readers)
    ]
    results = []
    for proc in procs:
        out, _ = proc.communicate(timeout=seconds + 60)
        if proc.returncode != 0:
            raise RuntimeError(f"a reader failed (exit {proc.returncode})")
        results.append(json.loads(out))
    return results


def _wait_for_nodes(pool: KVStore, nodes: int, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while len(pool.stats()["nodes"]) < nodes:
        if time.monotonic() > deadline:
            raise RuntimeError(f"only {len(pool.stats()['nodes'])} of {nodes} nodes registered")
        time.sleep(0.1)


def _main(args: argparse.Namespace) -> int:
    rows = run_hot(
        args.nodes,
        args.readers,
        args.blocks,
        args.block_size,
        args.seconds,
        args.transport,
    )
    print(f"{'replication':<12} {'GB/s':>7} {'reads':>7} {'p50 us':>9} {'p99 us':>9} replicas")
    for r in rows:
        print(
            f"{r.replication:<12} {r.gbps:>7.2f} {r.reads:>7} {r.p50_us:>9.1f} {r.p99_us:>9.1f} "
            f"{r.replicas_per_block:.2f}"
        )
    off, on = rows
    print(
        f"replication on / off: {on.gbps / off.gbps:.2f}x GB/s, p99 {on.p99_us / off.p99_us:.2f}x"
    )
    write_json(args.json, [asdict(r) for r in rows])
    return 0

"""``kvpool bench failover``: how long a leader kill costs, and what HA costs when idle.

1. Unavailability: a real etcd, three masters (``--etcd``), two nodes; one
   client puts and another gets, continuously. The leader is killed (-9)
   ``--kills`` times (each killed master comes back as a standby); for each
   kill we record the time from the kill to the first put, and to the first
   get, that completed after it. Reported: p50 / p99 / max over the kills.
2. Overhead: the same single put and get_into loops against a standalone
   master and against an elected one (one master each, same nodes), in
   interleaved rounds; medians per operation and the HA / standalone ratio.

Needs the ``etcd`` binary (Debian ``etcd-server``) and ``kvpool[ha]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from kvpool.args import positive_int, size_arg


def register_failover(suites: Any) -> None:
    parser = suites.add_parser("failover", help="leader kill -> first put/get; HA overhead")
    parser.add_argument("--kills", type=positive_int, default=10)
    parser.add_argument("--size", type=size_arg, default="64KiB", help="block size")
    parser.add_argument("--rounds", type=positive_int, default=5, help="overhead rounds")
    parser.add_argument("--ops", type=positive_int, default=200, help="operations per round")
    parser.add_argument("--json", default=None, metavar="F")
    parser.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    from kvpool.bench.common import write_json

    result = {
        "failover": run_failover(args.kills, args.size),
        "overhead": run_overhead(args.rounds, args.ops, args.size),
    }
    print(json.dumps(result, indent=2))
    write_json(args.json, result)
    return 0


@contextmanager
def ha_cluster(masters: int, nodes: int, dram: str = "256MiB") -> Iterator[dict[str, Any]]:
    """etcd + ``masters`` elected masters + ``nodes`` nodes; yields the handles."""
    from kvpool.cluster.ha.local_etcd import free_port, start_etcd
    from kvpool.procs import spawn_kvpool

    etcd = start_etcd()
    ports = [free_port() for _ in range(masters)]
    addresses = ",".join(f"127.0.0.1:{p}" for p in ports)
    procs: dict[int, Any] = {}
    started: list[Any] = []

    def start_master(port: int) -> None:
        procs[port] = spawn_kvpool(
            ["master", "--port", str(port), "--etcd", etcd.url, "--cluster", "bench"]
        )

    try:
        for port in ports:
            start_master(port)
        for _ in range(nodes):
            started.append(
                spawn_kvpool(["node", "--master", addresses, "--dram", dram, "--heartbeat", "0.2"])
            )
        yield {"url": f"kvpool://{addresses}", "masters": procs, "start_master": start_master}
    finally:
        for proc in [*started, *procs.values()]:
            proc.stop()
        etcd.stop()


def _leader(masters: dict[int, Any]) -> int | None:
    from kvpool.errors import KVPoolError
    from kvpool.rpc.client import RpcClient

    for port, proc in masters.items():
        if not proc.alive:
            continue
        try:
            with RpcClient(("127.0.0.1", port), timeout=2) as rpc:
                rpc.call("stats")
            return port
        except (KVPoolError, OSError):
            continue
    return None


def run_failover(kills: int, size: int) -> dict[str, Any]:
    import kvpool

    with ha_cluster(3, 2) as cluster:
        done: dict[str, list[float]] = {"put": [], "get": []}
        stop = threading.Event()
        data = np.ones(size, np.uint8)

        def putter() -> None:
            with kvpool.connect(cluster["url"], timeout=5, failover_s=30) as pool:
                i = 0
                while not stop.is_set():
                    pool.put(b"p%015d" % i, data)
                    done["put"].append(time.monotonic())
                    i += 1
                    time.sleep(0.005)

        def getter() -> None:
            out = np.empty(size, np.uint8)
            # No lease cache: every get asks the master (a cached lease would
            # hide the outage).
            url = cluster["url"]
            with kvpool.connect(url, timeout=5, failover_s=30, lease_cache_s=0) as pool:
                pool.put(b"g" * 16, data)
                while not stop.is_set():
                    if pool.get_into(b"g" * 16, out) == size:
                        done["get"].append(time.monotonic())
                    time.sleep(0.005)

        threads = [threading.Thread(target=putter), threading.Thread(target=getter)]
        for t in threads:
            t.start()
        gaps: dict[str, list[float]] = {"put": [], "get": []}
        for _ in range(kills):
            time.sleep(1.5)
            port = _leader(cluster["masters"])
            waited = time.monotonic() + 20
            while port is None and time.monotonic() < waited:  # the last failover's end
                time.sleep(0.1)
                port = _leader(cluster["masters"])
            if port is None:
                raise RuntimeError("no leader was elected within 20 s")
            killed = time.monotonic()
            cluster["masters"][port].kill()
            deadline = killed + 30
            for op in gaps:
                while not any(t > killed for t in done[op][-50:]) and time.monotonic() < deadline:
                    time.sleep(0.01)
                gaps[op].append(min((t for t in done[op] if t > killed), default=deadline) - killed)
            cluster["start_master"](port)
        stop.set()
        for t in threads:
            t.join(60)
    return {op: _summary(v) for op, v in gaps.items()}


def _summary(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {
        "kills": len(values),
        "p50_s": round(statistics.median(ordered), 3),
        "p99_s": round(float(np.percentile(ordered, 99)), 3),
        "max_s": round(ordered[-1], 3),
    }


def run_overhead(rounds: int, ops: int, size: int) -> dict[str, Any]:
    """Single put and get_into, standalone vs elected master, interleaved rounds."""
    import kvpool
    from kvpool.bench.remote_procs import local_cluster

    data = [np.random.default_rng(i).integers(0, 256, size, dtype=np.uint8) for i in range(ops)]
    out = np.empty(size, np.uint8)
    keys = [b"o%015d" % i for i in range(ops)]
    times: dict[str, dict[str, list[float]]] = {
        m: {"put": [], "get": []} for m in ("standalone", "ha")
    }
    with local_cluster(256 << 20, None) as plain_url, ha_cluster(1, 1) as ha:
        pools = {
            "standalone": kvpool.connect(plain_url, timeout=10),
            "ha": kvpool.connect(ha["url"], timeout=10),
        }
        try:
            for pool in pools.values():
                _wait_for_node(pool)
            for _ in range(rounds):
                for mode, pool in pools.items():
                    t0 = time.perf_counter()
                    for key, d in zip(keys, data, strict=True):
                        pool.put(key, d)
                    times[mode]["put"].append((time.perf_counter() - t0) / ops)
                    t0 = time.perf_counter()
                    for key in keys:
                        pool.get_into(key, out)
                    times[mode]["get"].append((time.perf_counter() - t0) / ops)
                    for key in keys:
                        pool.remove(key)
        finally:
            for pool in pools.values():
                pool.close()
    result: dict[str, Any] = {"size": size, "rounds": rounds, "ops": ops}
    for op in ("put", "get"):
        plain = statistics.median(times["standalone"][op]) * 1e6
        ha_us = statistics.median(times["ha"][op]) * 1e6
        result[op] = {
            "standalone_us": round(plain, 1),
            "ha_us": round(ha_us, 1),
            "ratio": round(ha_us / plain, 3),
        }
    return result


def _wait_for_node(pool: Any) -> None:
    deadline = time.monotonic() + 30
    while not pool.stats()["nodes"]:
        if time.monotonic() > deadline:
            raise RuntimeError("no node registered")
        time.sleep(0.05)

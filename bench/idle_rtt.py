"""``kvpool bench idle-rtt``: a master round trip after the CPUs sat idle, vs a raw socket.

A put ends with one master round trip (its commit) right after the client
waited for the node to take the bytes, so the master (and often the client)
has been idle for the whole write. On virtual machines an idle vCPU halts,
and waking it costs far more than the round trip itself. This benchmark
shows how much, and that it is the machine, not kvpool: after each idle
gap (``time.sleep``) it times one master RPC (``exists`` of one key) and one
raw Python TCP ping-pong against an echo process on the same CPUs as the
master, alternating, and reports the median of each and their ratio.
"""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np

ECHO_SERVER = """
import os, socket, sys
cpus = sys.argv[1]
if cpus:
    os.sched_setaffinity(0, {int(c) for c in cpus.split(",")})
listener = socket.create_server(("127.0.0.1", 0))
print(listener.getsockname()[1], flush=True)
conn, _ = listener.accept()
conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
while data := conn.recv(64):
    conn.sendall(data)
"""


@dataclass
class IdleRow:
    idle_ms: float
    master_rtt_us: float  # p50 of kvpool's exists() round trip to the master
    raw_rtt_us: float  # p50 of a 40-byte raw TCP ping-pong, same CPUs
    ratio: float  # master / raw


def register_idle_rtt(suites: Any) -> None:
    parser = suites.add_parser("idle-rtt", help="master round trip after idle gaps vs raw socket")
    parser.add_argument("--idle-ms", default="0,0.2,1,5,20", help="comma list of idle gaps")
    parser.add_argument("--samples", type=int, default=200, help="round trips per gap and side")
    parser.add_argument("--json", default=None, metavar="F")
    parser.set_defaults(func=_main)


def run_idle_rtt(idle_ms: Sequence[float], samples: int, pin: bool = True) -> list[IdleRow]:
    from kvpool.bench.remote_procs import connect_client, local_cluster
    from kvpool.bench.remote_transport import pinned, split_cpus

    if samples < 1 or any(g < 0 for g in idle_ms):
        raise ValueError("--samples must be >= 1 and idle gaps >= 0")
    split = split_cpus() if pin else None
    client_cpus, server_cpus = split if split else (None, None)
    rows = []
    with local_cluster(64 << 20, server_cpus) as url, _echo(server_cpus) as echo:
        pool = connect_client(url, "tcp")
        try:
            with pinned(client_cpus):
                key = [b"\0" * 16]
                for gap in idle_ms:
                    master, raw = _alternate(
                        gap / 1e3, samples, lambda: pool.exists(key), lambda: _ping(echo)
                    )
                    rows.append(IdleRow(gap, master, raw, master / raw))
        finally:
            pool.close()
    return rows


def raw_wake_us(idle_ms: Sequence[float] = (0.0, 20.0), samples: int = 40) -> dict[str, float]:
    """p50 microseconds of a raw 40-byte TCP ping-pong to an echo process on the
    benchmarks' server CPUs, timed right after each idle gap (keys: the gap in ms):
    what a hand-off between processes costs on this machine at this hour. Every
    row that crosses processes pays it, more often than its baseline does, so a
    slow hour lowers those ratios (``kvpool bench all`` prints it before and after
    its suites; bench/RESULTS.md, session 36: 88 / 568 us in an hour whose remote
    rows ran 0.5-0.8, against 48 / 215 us on a quiet machine)."""
    from kvpool.bench.remote_transport import pinned, split_cpus

    split = split_cpus()
    client_cpus, server_cpus = split if split else (None, None)
    with _echo(server_cpus) as echo, pinned(client_cpus):
        return {
            f"{gap:g}": _alternate(gap / 1e3, samples, lambda: _ping(echo))[0] for gap in idle_ms
        }


def _alternate(gap_s: float, samples: int, *ops: Callable[[], object]) -> list[float]:
    """p50 microseconds of each op, alternated, each timed right after ``gap_s`` of sleep."""
    times: list[list[float]] = [[] for _ in ops]
    for _ in range(samples + 10):  # the first 10 warm up
        for i, op in enumerate(ops):
            if gap_s:
                time.sleep(gap_s)
            start = time.perf_counter()
            op()
            times[i].append(time.perf_counter() - start)
    return [float(np.median(t[10:]) * 1e6) for t in times]


def _ping(sock: socket.socket) -> None:
    sock.sendall(b"x" * 40)
    got = 0
    while got < 40:
        got += len(sock.recv(64))


@contextmanager
def _echo(cpus: set[int] | None) -> Iterator[socket.socket]:
    arg = ",".join(map(str, sorted(cpus))) if cpus else ""
    proc = subprocess.Popen(
        [sys.executable, "-c", ECHO_SERVER, arg], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline())
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            yield sock
    finally:
        proc.kill()
        proc.wait(10)


def _main(args: argparse.Namespace) -> int:
    from kvpool.bench.common import write_json

    gaps = [float(g) for g in args.idle_ms.split(",") if g.strip()]
    rows = run_idle_rtt(gaps, args.samples)
    print(f"{'idle ms':>8} {'master µs':>10} {'raw µs':>8} {'ratio':>6}")
    for r in rows:
        print(f"{r.idle_ms:>8g} {r.master_rtt_us:>10.1f} {r.raw_rtt_us:>8.1f} {r.ratio:>6.2f}")
    write_json(args.json, rows)
    return 0

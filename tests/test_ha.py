"""Master HA with real processes and a real etcd: kill -9 the leader under load,
a zombie leader (SIGSTOP past its TTL), etcd itself stopped."""

from __future__ import annotations

import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import pytest
from clusterhelpers import wait_until
from etcdhelpers import Etcd, free_port, start_etcd

import kvpool
from kvpool.errors import KVPoolError, NotLeaderError, StaleWriteError
from kvpool.procs import Child, kvpool_args, spawn_kvpool, start, wait_ready
from kvpool.rpc.client import RpcClient

BLOCK = 64 << 10


def payload(i: int) -> np.ndarray:
    return np.random.default_rng(7000 + i).integers(0, 256, BLOCK, dtype=np.uint8)


@dataclass
class HaCluster:
    etcd: Etcd
    ports: list[int]
    masters: dict[int, Child] = field(default_factory=dict)
    nodes: list[Child] = field(default_factory=list)

    @property
    def addresses(self) -> str:
        return ",".join(f"127.0.0.1:{p}" for p in self.ports)

    @property
    def url(self) -> str:
        return "kvpool://" + self.addresses

    def start_master(self, port: int) -> None:
        args = ["master", "--port", str(port), "--etcd", self.etcd.url, "--cluster", "t"]
        self.masters[port] = spawn_kvpool([*args, "--node-ttl", "3"])

    def leader(self) -> int | None:
        """The port of the master that serves now (None: none does)."""
        for port, child in self.masters.items():
            if not child.alive:
                continue
            try:
                with RpcClient(("127.0.0.1", port), timeout=2) as rpc:
                    rpc.call("stats")
                return port
            except (KVPoolError, OSError):  # a standby, fenced, or still starting
                continue
        return None

    def stop(self) -> None:
        for child in [*self.nodes, *self.masters.values()]:
            child.signal_group(signal.SIGCONT)
            child.stop()
        self.etcd.stop()


@pytest.fixture
def ha() -> Iterator[HaCluster]:
    etcd = start_etcd()
    cluster = HaCluster(etcd, [free_port() for _ in range(3)])
    try:
        for port in cluster.ports:
            cluster.start_master(port)
        args = ["node", "--master", cluster.addresses, "--dram", "48MiB", "--heartbeat", "0.2"]
        starting = [start("node", kvpool_args(*args), stderr=subprocess.DEVNULL) for _ in range(3)]
        cluster.nodes = [wait_ready(n, 30) for n in starting]
        assert wait_until(lambda: cluster.leader() is not None, 15)
        yield cluster
    finally:
        cluster.stop()


def epoch(pool: kvpool.RemotePool) -> int:
    return int(pool.stats()["epoch"])


def test_leader_killed_under_load(ha: HaCluster) -> None:
    """Writers (replicas=2) and readers run while the leader is killed -9 three
    times: no exception, no wrong bytes, every acknowledged put readable at the
    end, each gap under 5 s, epochs strictly increasing."""
    stop = threading.Event()
    errors: list[BaseException] = []
    wrong: list[bytes] = []
    acked: dict[bytes, int] = {}
    done_at: list[float] = []  # completion times of successful puts
    lock = threading.Lock()

    def writer(w: int) -> None:
        with kvpool.connect(ha.url, timeout=5) as pool:
            i = 0
            while not stop.is_set():
                key = (b"w%d-%06d" % (w, i)).ljust(16, b"\0")
                try:
                    pool.put(key, payload(w * 100000 + i), replicas=2)
                    with lock:
                        acked[key] = w * 100000 + i
                        done_at.append(time.monotonic())
                except BaseException as exc:
                    errors.append(exc)
                i += 1
                time.sleep(0.04)  # <= ~600 puts x 2 replicas: the pool never fills

    def reader() -> None:
        out = np.empty(BLOCK, np.uint8)
        with kvpool.connect(ha.url, timeout=5) as pool:
            while not stop.is_set():
                with lock:
                    items = list(acked.items())[-20:]
                for key, i in items:
                    try:
                        if pool.get_into(key, out) == BLOCK and not np.array_equal(out, payload(i)):
                            wrong.append(key)
                    except BaseException as exc:
                        errors.append(exc)
                time.sleep(0.01)

    threads = [threading.Thread(target=writer, args=(w,)) for w in range(2)]
    threads += [threading.Thread(target=reader) for _ in range(2)]
    for t in threads:
        t.start()
    gaps, epochs = [], []
    with kvpool.connect(ha.url, timeout=5) as probe:
        epochs.append(epoch(probe))
        for _ in range(3):
            time.sleep(2.0)
            port = ha.leader()
            assert port is not None
            killed = time.monotonic()
            ha.masters[port].kill()
            assert wait_until(lambda k=killed: any(t > k for t in done_at), 10, interval=0.02)
            gaps.append(min(t for t in done_at if t > killed) - killed)
            print(f"kill {len(gaps)}: first put {gaps[-1]:.2f} s later")
            ha.start_master(port)  # back as a standby
            epochs.append(epoch(probe))
    time.sleep(1.0)
    stop.set()
    for t in threads:
        t.join(30)
    assert not errors, errors[:3]
    assert not wrong
    assert all(g <= 5.0 for g in gaps), gaps
    assert epochs == sorted(set(epochs)) and len(epochs) == 4, epochs
    out = np.empty(BLOCK, np.uint8)
    with kvpool.connect(ha.url, timeout=5) as pool:
        for key, i in acked.items():
            assert pool.get_into(key, out) == BLOCK and np.array_equal(out, payload(i)), key


def test_zombie_leader_is_fenced(ha: HaCluster) -> None:
    """SIGSTOP the leader past its TTL: a standby takes over and takes writes; the
    stopped one, resumed, serves nothing, and its term's writes are refused."""
    with (
        kvpool.connect(ha.url, timeout=5, transport="tcp") as old,
        kvpool.connect(ha.url, timeout=5) as pool,
    ):
        writer = old.reserve(b"\x5a" * 16, BLOCK)  # a reservation of the first term
        assert writer is not None
        first = epoch(pool)
        port = ha.leader()
        assert port is not None
        zombie = ha.masters[port]
        zombie.signal_group(signal.SIGSTOP)
        try:
            assert pool.put(b"\x01" * 16, payload(1))  # served by the new leader
            assert epoch(pool) > first
            # every node joined the new term (one still calling the stopped leader
            # gives up after its RPC timeout, then follows the new one)
            assert wait_until(lambda: len(pool.stats()["nodes"]) == 3, 15)
        finally:
            zombie.signal_group(signal.SIGCONT)
        with RpcClient(("127.0.0.1", port), timeout=5) as rpc, pytest.raises(NotLeaderError):
            rpc.call("stats")
        with pytest.raises(StaleWriteError):
            writer.write(0, payload(2))  # nodes refuse the old term
        out = np.empty(BLOCK, np.uint8)
        assert pool.get_into(b"\x01" * 16, out) == BLOCK and np.array_equal(out, payload(1))


def test_etcd_stopped_the_leader_fences_itself(ha: HaCluster) -> None:
    port = ha.leader()
    assert port is not None
    ha.etcd.pause()
    try:
        stopped = time.monotonic()
        assert wait_until(lambda: ha.leader() is None, 3.0, interval=0.05)
        assert time.monotonic() - stopped < 3.0  # within the TTL
    finally:
        ha.etcd.resume()
    assert wait_until(lambda: ha.leader() is not None, 15)
    with kvpool.connect(ha.url, timeout=5) as pool:
        assert pool.put(b"\x02" * 16, payload(2))

"""Master HA with real processes and a real etcd: kill -9 the leader under load,
a zombie leader (SIGSTOP past its TTL), etcd itself stopped."""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import pytest
from clusterhelpers import wait_until
from etcdhelpers import Etcd, free_port, start_etcd
from storm import storm_clients

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


def start_ha(drams: list[str]) -> HaCluster:
    """etcd, three masters (one leads) and a node per entry of ``drams``."""
    etcd = start_etcd()
    cluster = HaCluster(etcd, [free_port() for _ in range(3)])
    try:
        for port in cluster.ports:
            cluster.start_master(port)
        args = ["node", "--master", cluster.addresses, "--heartbeat", "0.2"]
        starting = [
            start("node", kvpool_args(*args, "--dram", dram), stderr=subprocess.DEVNULL)
            for dram in drams
        ]
        cluster.nodes = [wait_ready(n, 30) for n in starting]
        assert wait_until(lambda: cluster.leader() is not None, 15)
    except BaseException:
        cluster.stop()
        raise
    return cluster


@pytest.fixture
def ha() -> Iterator[HaCluster]:
    # room for every put of a storm round (2 writers x ~25/s x 30 s x 2 replicas x
    # 64 KiB = ~190 MiB at most): nothing is evicted, so every ack must read back
    cluster = start_ha(["128MiB"] * 3)
    try:
        yield cluster
    finally:
        cluster.stop()


def epoch(pool: kvpool.RemotePool) -> int:
    return int(pool.stats()["epoch"])


@pytest.mark.parametrize("mode", ["replicas", "replicas", "node-commits"])
def test_leader_killed_under_load(ha: HaCluster, mode: str) -> None:
    """Two writer processes and two reader processes run for 30 s while the
    leader is killed -9 every few seconds (3 to 6 times, as many as fit with 8 s
    to spare): no exception, no wrong bytes, every acknowledged put readable at
    the end, each gap under 5 s, epochs strictly increasing. Run three times,
    each on a fresh cluster: twice with writers putting two replicas (their
    commits sent by the writer), once with single puts their node commits (one
    writer over TCP, one sealing in shared memory: tests/ha_client.py)."""
    seconds = 30.0
    started = time.monotonic()
    kills, epochs = [], []
    with storm_clients(ha.url, seconds, mode) as storm:
        with kvpool.connect(ha.url, timeout=5) as probe:
            epochs.append(epoch(probe))
            while len(kills) < 6 and time.monotonic() + 2.0 < started + seconds - 8.0:
                time.sleep(2.0)
                assert wait_until(lambda: ha.leader() is not None, 10)
                port = ha.leader()
                assert port is not None
                kills.append(time.monotonic())
                ha.masters[port].kill()
                assert wait_until(lambda p=port: ha.leader() not in (None, p), 10)
                ha.start_master(port)  # back as a standby
                epochs.append(epoch(probe))
        storm.collect()
    assert len(kills) >= 3, kills
    storm.check(kills, each_writer=False)
    if mode == "node-commits":  # most puts went the node's way (a refill's may not)
        assert all(w["by_node"][0] > len(w["acked"]) // 2 for w in storm.writers), storm.writers
    assert epochs == sorted(set(epochs)) and len(epochs) == len(kills) + 1, epochs
    with kvpool.connect(ha.url, timeout=5) as pool:
        storm.check_read_back(pool)


def registered_nodes(pool: kvpool.RemotePool) -> int:
    """How many nodes the serving master has (-1: none answers now)."""
    try:
        return len(pool.stats()["nodes"])
    except (KVPoolError, OSError):
        return -1


def test_zombie_leader_is_fenced(ha: HaCluster) -> None:
    """SIGSTOP the leader past its TTL: a standby takes over and takes writes; the
    stopped one, resumed, serves nothing, and its term's writes are refused.

    Every step waits on its condition with a generous deadline (nothing here
    depends on how fast a loaded machine runs the failover): the new leader,
    then all three nodes in its term (a node still calling the stopped leader
    gives up only after its RPC timeout, 5 s), then the put."""
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
            assert wait_until(lambda: ha.leader() not in (None, port), 20), "no new leader"
            assert wait_until(lambda: registered_nodes(pool) == 3, 30), registered_nodes(pool)
            assert epoch(pool) > first
            assert pool.put(b"\x01" * 16, payload(1))  # served by the new leader
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


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_a_stale_writer_is_fenced_after_a_failover(transport: str) -> None:
    """Hold a reservation, kill -9 the leader, let the new leader hand the same
    space to another client (the only node has room for one block), resume the
    first writer: every write and the commit are refused (stale), and the other
    block reads back exactly."""
    mib = 1 << 20
    cluster = start_ha(["1MiB"])
    try:
        first = kvpool.connect(cluster.url, timeout=5, transport=transport)
        other = kvpool.connect(cluster.url, timeout=5)
        k1, k2 = b"\x61" * 16, b"\x62" * 16
        data1 = np.random.default_rng(1).integers(0, 256, mib, dtype=np.uint8)
        data2 = np.random.default_rng(2).integers(0, 256, mib, dtype=np.uint8)
        writer = first.reserve(k1, mib)
        assert writer is not None
        writer.write(0, data1[: mib // 2])
        old = epoch(other)
        port = cluster.leader()
        assert port is not None
        cluster.masters[port].kill()
        assert wait_until(lambda: cluster.leader() not in (None, port), 15)
        assert other.put(k2, data2)  # the new term hands out the same (only) range
        assert epoch(other) > old
        with pytest.raises(StaleWriteError):
            writer.write(mib // 2, data1[mib // 2 :])
        with pytest.raises(StaleWriteError):
            writer.commit()
        out = np.empty(mib, np.uint8)
        assert other.get_into(k2, out) == mib and np.array_equal(out, data2)
        assert not first.exists([k1])[0]
        assert first.stats()["transport"] == transport
        first.close()
        other.close()
    finally:
        cluster.stop()

"""The distributed pool with real processes: master and nodes as subprocesses on loopback."""

from __future__ import annotations

import dataclasses
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator

import numpy as np
import pytest
from clusterhelpers import Cluster, start_cluster, wait_until
from poolhelpers import BLOCK, make_keys, payload

import kvpool
from kvpool import HandshakeRefusedError, RemotePool
from kvpool.cluster.client.handles import ReservationTicket


def nodes_up(pool: RemotePool, n: int) -> bool:
    return wait_until(lambda: len(pool.stats()["nodes"]) == n, timeout=15)


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    c = start_cluster(["8MiB", "8MiB"])  # 2 x 128 blocks of 64 KiB
    yield c
    c.stop()


@pytest.fixture
def pool(cluster: Cluster) -> Iterator[RemotePool]:
    with kvpool.connect(cluster.url, timeout=5) as p:
        assert nodes_up(p, 2)
        yield p


READER = textwrap.dedent(
    """
    import sys, numpy as np
    sys.path.insert(0, {tests!r})
    from poolhelpers import BLOCK, make_keys, payload
    import kvpool
    keys = make_keys({n})
    with kvpool.connect({url!r}) as pool:
        out = np.empty(BLOCK, np.uint8)
        bad = [i for i, k in enumerate(keys) if pool.get_into(k, out) != BLOCK
               or not np.array_equal(out, payload(i))]
        print(pool.prefix_match(keys), len(bad), pool.stats()["transport"])
    """
)


def run_reader(url: str, n: int, transport: str = "") -> list[str]:
    env = {"KVPOOL_TRANSPORT": transport} if transport else {}
    import os

    done = subprocess.run(
        [sys.executable, "-c", READER.format(tests=os.path.dirname(__file__), n=n, url=url)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **env},
        check=True,
    )
    return done.stdout.split()


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_put_here_get_in_another_process(
    pool: RemotePool, cluster: Cluster, transport: str
) -> None:
    keys = make_keys(20)
    assert pool.put_batch(keys, [payload(i) for i in range(20)]) == [True] * 20
    assert run_reader(cluster.url, 20, transport) == ["20", "0", transport]
    stats = pool.stats()
    assert stats["blocks"] == 20
    assert sorted(n["blocks"] for n in stats["nodes"].values()) == [10, 10]  # spread by free space


def test_eviction_under_pressure_across_two_nodes(cluster: Cluster) -> None:
    # No put grants: they would hold (and pre-evict) up to 1/16 of the space.
    pool = kvpool.connect(cluster.url, timeout=5, put_grant_bytes=0)
    assert nodes_up(pool, 2)
    keys = make_keys(300)
    for i in range(0, 300, 50):
        pool.put_batch(keys[i : i + 50], [payload(j) for j in range(i, i + 50)])
    stats = pool.stats()
    assert stats["blocks"] == 256 and stats["evictions"] == 44
    present = pool.exists(keys)
    assert all(present[-200:])  # LRU per node keeps the newest
    assert sum(present) == 256
    out = np.empty(BLOCK, np.uint8)
    for i in (299, 150, 100):
        assert pool.get_into(keys[i], out) == BLOCK and np.array_equal(out, payload(i))
    pool.close()


def test_a_leased_block_is_not_evicted_or_freed(pool: RemotePool) -> None:
    keys = make_keys(401)
    pool.put(keys[0], payload(0))
    with pool.lease(keys[:1]) as lease:
        assert lease.keys == keys[:1]
        for i in range(1, 400, 100):  # far more than the cluster holds
            pool.put_batch(keys[i : i + 100], [payload(j) for j in range(i, i + 100)])
        assert pool.exists(keys[:1]) == [True]  # survived all that pressure
        out = np.empty(BLOCK, np.uint8)
        assert pool.get_into(keys[0], out) == BLOCK and np.array_equal(out, payload(0))
        assert pool.remove(keys[0])  # hidden at once; its range is freed after the lease
        assert pool.get_into(keys[0], out) is None
    assert pool.exists(keys[:1]) == [False]


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_node_killed_mid_stream(cluster: Cluster, transport: str) -> None:
    pool = kvpool.connect(cluster.url, timeout=3, transport=transport)
    assert nodes_up(pool, 2)
    keys = make_keys(40)
    pool.put_batch(keys, [payload(i) for i in range(40)])
    cluster.nodes[0].kill()
    out = np.empty(BLOCK, np.uint8)
    start = time.monotonic()
    results = [pool.get_into(k, out) for k in keys]  # node gone mid-read: no hang
    assert time.monotonic() - start < 10
    served = [i for i, r in enumerate(results) if r is not None]
    # Over TCP the dead node's blocks are misses at once. Over shared memory the
    # dead node's arena is still mapped here, so its (correct) bytes keep being
    # served until the master drops the node.
    assert 15 <= len(served) <= 25 if transport == "tcp" else len(served) == 40
    for i in served:  # whatever is served is right (the node may be dropped meanwhile)
        if pool.get_into(keys[i], out) is not None:
            assert np.array_equal(out, payload(i))
    assert wait_until(lambda: len(pool.stats()["nodes"]) == 1, timeout=10)  # TTL 1.5 s
    alive = [i for i, ok in enumerate(pool.exists(keys)) if ok]
    assert 15 <= len(alive) <= 25
    for i in alive:
        assert pool.get_into(keys[i], out) == BLOCK and np.array_equal(out, payload(i))
    more = make_keys(10, seed=4)
    assert pool.put_batch(more, [payload(i) for i in range(10)]) == [True] * 10  # on the survivor
    pool.close()


def test_node_killed_mid_write_leaves_nothing_visible(cluster: Cluster) -> None:
    with kvpool.connect(cluster.url, timeout=3, transport="tcp") as pool:
        assert nodes_up(pool, 2)
        keys = make_keys(2)
        big = np.zeros(6 << 20, np.uint8)
        writer = pool.reserve(keys[0], big.nbytes)
        assert writer is not None
        writer.write(0, big[: 1 << 20])
        for node in cluster.nodes:
            node.kill()
        with pytest.raises((ConnectionError, TimeoutError)):
            writer.write(1 << 20, big[1 << 20 :])
        writer.abort()
        assert pool.exists(keys[:1]) == [False]
        assert wait_until(lambda: not pool.stats()["nodes"], timeout=10)
        assert pool.stats()["pending_allocations"] == 0


def test_master_restart_keeps_the_blocks(pool: RemotePool, cluster: Cluster) -> None:
    keys = make_keys(30)
    pool.put_batch(keys, [payload(i) for i in range(30)], [None, *keys[:-1]])
    time.sleep(0.6)  # nodes learn about their blocks through heartbeats
    cluster.restart_master()
    assert wait_until(lambda: pool.stats()["blocks"] == 30, timeout=15)
    assert pool.prefix_match(keys) == 30
    out = np.empty(BLOCK, np.uint8)
    for i, key in enumerate(keys):
        assert pool.get_into(key, out) == BLOCK and np.array_equal(out, payload(i))


def test_wrong_token_is_refused() -> None:
    cluster = start_cluster([], "--token", "s3cret")
    try:
        with pytest.raises(HandshakeRefusedError, match="wrong token"):
            kvpool.connect(cluster.url, token="guess")
        with pytest.raises(HandshakeRefusedError, match="missing token"):
            kvpool.connect(cluster.url)
        with kvpool.connect(cluster.url, token="s3cret") as pool:
            assert pool.stats()["blocks"] == 0
    finally:
        cluster.stop()


def test_master_survives_garbage_and_keeps_serving(pool: RemotePool, cluster: Cluster) -> None:
    for junk in (b"\x00" * 64, b"GET / HTTP/1.1\r\n\r\n", b"\xff" * 5000, b"KVP"):
        with socket.create_connection((cluster.master.host, cluster.master.port), timeout=5) as s:
            s.sendall(junk)
            s.shutdown(socket.SHUT_WR)
            s.settimeout(5)
            while s.recv(4096):
                pass
    keys = make_keys(1)
    assert pool.put(keys[0], b"still here")
    assert pool.get(keys[0]) == b"still here"


def test_bind_beyond_loopback_needs_a_token() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "kvpool", "master", "--host", "0.0.0.0", "--port", "0"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode != 0
    assert "token" in done.stderr.lower()


def test_metrics_endpoints(cluster: Cluster) -> None:
    import urllib.request

    from clusterhelpers import spawn

    master = spawn(["master", "--port", "0", "--metrics-port", "0"])
    node = spawn(
        [
            "node",
            "--master",
            master.address,
            "--dram",
            "4MiB",
            "--metrics-port",
            "0",
            "--heartbeat",
            "0.2",
        ]
    )
    try:
        with kvpool.connect(f"kvpool://{master.address}") as pool:
            assert wait_until(lambda: len(pool.stats()["nodes"]) == 1, timeout=15)
            key = make_keys(1)[0]
            pool.put(key, payload(0))
            pool.get(key)
            pool.get(make_keys(2)[1])
        master_port = int(master.line.split("metrics port ")[1].rstrip(")"))
        text = urllib.request.urlopen(f"http://127.0.0.1:{master_port}/metrics").read().decode()
        for name in (
            "kvpool_hits_total 1.0",
            "kvpool_misses_total 1.0",
            "kvpool_blocks 1.0",
            "kvpool_granted_bytes 0.0",  # the client gave its grants back on close
            "kvpool_nodes 1.0",
            "kvpool_capacity_bytes{",
            "kvpool_used_bytes{",
            "kvpool_op_seconds_bucket{",
        ):
            assert name in text, name
        node_port = int(node.line.split("metrics port ")[1].rstrip(")"))
        assert wait_until(
            lambda: (
                "kvpool_bytes_moved_total"
                in urllib.request.urlopen(f"http://127.0.0.1:{node_port}/metrics").read().decode()
            )
        )
    finally:
        node.stop()
        master.stop()


def test_a_client_can_lend_its_own_memory(cluster: Cluster) -> None:
    with kvpool.connect(cluster.url, contribute_dram=4 << 20) as lender:
        assert wait_until(lambda: len(lender.stats()["nodes"]) == 3, timeout=15)
        with kvpool.connect(cluster.url) as other:
            keys = make_keys(300)
            other.put_batch(keys, [payload(i) for i in range(300)])
            assert sum(n["blocks"] for n in other.stats()["nodes"].values()) == 300
            assert min(n["blocks"] for n in other.stats()["nodes"].values()) > 0


def test_a_writer_refuses_to_write_past_its_reservation(pool: RemotePool) -> None:
    key = make_keys(1)[0]
    writer = pool.reserve(key, 1000)
    assert writer is not None
    writer.write(0, b"x" * 10)
    writer.deadline = 0.0  # as if the master's allocation TTL had run out
    with pytest.raises(kvpool.KVPoolError, match="expired"):
        writer.write(10, b"y" * 10)
    writer.abort()
    assert pool.exists([key]) == [False]


def test_a_reservation_the_master_let_expire_is_not_committed_silently() -> None:
    """A writer slower than the master's ``--alloc-ttl``: its commit raises (the master
    no longer held the allocation), the key stays free. Another writer's earlier
    commit of the key is not such a loss (test_store_contract: first commit wins)."""
    cluster = start_cluster(["4MiB"], "--alloc-ttl", "0.5")
    try:
        with kvpool.connect(cluster.url, timeout=5) as pool:
            slow, quick = make_keys(2, seed=31)
            writer = pool.reserve(slow, BLOCK)
            assert writer is not None
            writer.write(0, payload(1))
            with pool.reserve(quick, BLOCK) as other:  # type: ignore[union-attr]
                other.write(0, payload(3))
            time.sleep(1.5)  # past the TTL, and the master's reaper (every 0.5 s) ran
            with pytest.raises(kvpool.KVPoolError, match="expired before the commit"):
                writer.commit()
            assert pool.exists([slow, quick]) == [False, True]
            assert pool.put(slow, payload(2)) is True  # the key is free
            assert pool.get(slow) == payload(2).tobytes()
    finally:
        cluster.stop()


def test_a_node_restarted_on_the_same_port_never_serves_stale_offsets() -> None:
    # A node with a fixed id and data port dies and comes back empty; a client
    # still holding a lease (and a TCP connection) for the old incarnation's
    # offsets must get a miss, not the bytes another client stored there since.
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    fixed = ("--node-id", "steady", "--data-port", str(port))
    cluster = start_cluster([])
    try:
        cluster.add_node("4MiB", *fixed)
        olds, news = make_keys(3, seed=21), make_keys(3, seed=22)
        with (
            kvpool.connect(cluster.url, timeout=5, transport="tcp", lease_cache_s=60) as reader,
            kvpool.connect(cluster.url, timeout=5, transport="tcp") as writer,
        ):
            assert nodes_up(reader, 1)
            out = np.empty(BLOCK, np.uint8)
            for i, key in enumerate(olds):
                writer.put(key, payload(i))
                writer.flush()  # visible to other clients (its commit was pipelined)
                assert reader.get_into(key, out) == BLOCK  # its lease is now cached
            cluster.nodes.pop().kill()
            assert wait_until(lambda: not reader.stats()["nodes"], timeout=10)
            cluster.add_node("4MiB", *fixed)
            assert nodes_up(reader, 1)
            for i, key in enumerate(news):  # the fresh arena reuses the same offsets
                writer.put(key, payload(10 + i))
            writer.flush()
            # The first read finds the dead connection; later ones connect afresh.
            assert [reader.get_into(key, out) for key in olds] == [None] * 3
            for i, key in enumerate(news):
                assert reader.get_into(key, out) == BLOCK and np.array_equal(out, payload(10 + i))
    finally:
        cluster.stop()


def test_a_reservation_exported_to_another_client(pool: RemotePool, cluster: Cluster) -> None:
    """Pipeline prefill's hand-off: one client reserves and commits, another fills
    the bytes through ``adopt`` of the exported ticket (plain, msgpack-safe data)."""
    import msgpack

    key = make_keys(1, seed=21)[0]
    writer = pool.reserve(key, BLOCK)
    assert writer is not None
    ticket = writer.export()
    wire = msgpack.unpackb(msgpack.packb(dataclasses.asdict(ticket)), use_list=True)
    assert wire["key"] == key and wire["size"] == BLOCK and 0 < wire["ttl_s"] <= 120
    with kvpool.connect(cluster.url, timeout=5) as other:
        adopted = other.adopt(
            ReservationTicket(
                key=wire["key"],
                size=wire["size"],
                allocations=[tuple(a) for a in wire["allocations"]],
                ttl_s=wire["ttl_s"],
                nodes=wire["nodes"],
                epoch=wire["epoch"],
                parent=wire["parent"],
            )
        )
        assert adopted.node_ids == writer.node_ids
        adopted.write(BLOCK // 2, payload(3)[BLOCK // 2 :])
        adopted.write(0, payload(3)[: BLOCK // 2])
        assert other.exists([key]) == [False]  # invisible until the owner commits
    writer.commit()
    assert pool.get(key) == payload(3).tobytes()

"""A standalone master (no etcd) killed -9 and restarted, with real processes:
acknowledged puts survive at any instant, a stale writer is fenced, clients
ride through the restart without connection errors."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from clusterhelpers import Cluster, spawn, start_cluster, wait_until

import kvpool
from kvpool.api import BlockWriter
from kvpool.errors import StaleWriteError

MIB = 1 << 20


def payload(i: int, size: int = MIB) -> np.ndarray:
    return np.random.default_rng(1000 + i).integers(0, 256, size, dtype=np.uint8)


@pytest.fixture
def cluster():
    c = start_cluster(["16MiB", "16MiB"])
    yield c
    c.stop()


def all_back(pool: kvpool.RemotePool, keys: list[bytes], datas: list[np.ndarray]) -> bool:
    out = np.empty(MIB, np.uint8)
    for key, data in zip(keys, datas, strict=True):
        if pool.get_into(key, out) != MIB or not np.array_equal(out, data):
            return False
    return True


@pytest.mark.parametrize("transport", [None, "tcp"])
def test_acknowledged_puts_survive_a_master_kill_right_after_the_ack(
    cluster: Cluster, transport: str | None
) -> None:
    keys = [bytes([i + 1]) * 16 for i in range(10)]
    datas = [payload(i) for i in range(10)]
    with kvpool.connect(cluster.url, timeout=5, transport=transport) as pool:
        for key, data in zip(keys, datas, strict=True):
            assert pool.put(key, data)
        cluster.master.kill()  # no heartbeat can have carried the commits
        cluster.master = cluster.restart_master_process()
        assert wait_until(lambda: pool.exists(keys) == [True] * 10, timeout=15)
        assert all_back(pool, keys, datas)


def test_a_stale_writer_is_fenced_after_a_restart() -> None:
    """Hold a reservation, restart the master, let the new term give the same
    space to another client, resume the first writer: it is refused, and the
    other block reads back exactly."""
    cluster = start_cluster(["1MiB"])  # one block of room: the new term must reuse it
    try:
        first = kvpool.connect(cluster.url, timeout=5, transport="tcp")
        other = kvpool.connect(cluster.url, timeout=5)
        k1, k2 = b"\x11" * 16, b"\x22" * 16
        writer = first.reserve(k1, MIB)
        assert writer is not None
        writer.write(0, payload(1)[: MIB // 2])
        cluster.master.kill()
        cluster.master = cluster.restart_master_process()
        assert other.put(k2, payload(2))  # the new term hands out the same range
        with pytest.raises(StaleWriteError):
            writer.write(MIB // 2, payload(1)[MIB // 2 :])
        with pytest.raises(StaleWriteError):
            writer.commit()
        out = np.empty(MIB, np.uint8)
        assert other.get_into(k2, out) == MIB and np.array_equal(out, payload(2))
        assert not first.exists([k1])[0]
        first.close()
        other.close()
    finally:
        cluster.stop()


def test_a_stale_writer_in_a_commit_all_is_refused_alone() -> None:
    """``BlockWriter.commit_all`` of a stale writer (reserved in the old term) and a
    fresh one (reserved after the restart, on the same node, in one seal
    exchange): the stale seal is refused and raises, the fresh block commits, and
    the block now owning the stale writer's range reads back exactly."""
    cluster = start_cluster(["2MiB"])  # two blocks of room: the new term reuses both
    try:
        first = kvpool.connect(cluster.url, timeout=5, transport="tcp")
        other = kvpool.connect(cluster.url, timeout=5)
        k1, k2, k3 = b"\x11" * 16, b"\x22" * 16, b"\x33" * 16
        stale = first.reserve(k1, MIB)
        assert stale is not None
        stale.write(0, payload(1))
        cluster.master.kill()
        cluster.master = cluster.restart_master_process()
        assert other.put(k2, payload(2))
        [fresh] = first.reserve_batch([k3], [MIB])
        assert fresh is not None
        fresh.write(0, payload(3))
        with pytest.raises(StaleWriteError, match="refused to seal"):
            BlockWriter.commit_all([stale, fresh])
        assert first.exists([k1, k2, k3]) == [False, True, True]
        out = np.empty(MIB, np.uint8)
        for key, i in ((k2, 2), (k3, 3)):
            assert first.get_into(key, out) == MIB and np.array_equal(out, payload(i))
        first.close()
        other.close()
    finally:
        cluster.stop()


def test_clients_ride_through_a_master_restart() -> None:
    """Puts and gets keep going across a kill -9 and restart: no exception, each
    call just waits; every acknowledged put is readable afterwards (the pool
    has room for all of them: nothing is evicted)."""
    cluster = start_cluster(["64MiB", "64MiB"])
    try:
        _ride_through(cluster)
    finally:
        cluster.stop()


def _ride_through(cluster: Cluster) -> None:
    stop = threading.Event()
    errors: list[BaseException] = []
    acked: list[tuple[bytes, int]] = []

    def writer() -> None:
        with kvpool.connect(cluster.url, timeout=5) as pool:
            i = 0
            while not stop.is_set():
                key = (b"w%06d" % i).ljust(16, b"\0")
                try:
                    if pool.put(key, payload(i, 64 << 10)):
                        acked.append((key, i))
                    pool.get(acked[-1][0]) if acked else None
                except BaseException as exc:
                    errors.append(exc)
                i += 1
                time.sleep(0.002)  # at most ~1,500 puts: 2 x 64 MiB holds 2,048

    thread = threading.Thread(target=writer)
    thread.start()
    time.sleep(1.0)
    cluster.master.kill()
    time.sleep(0.3)
    cluster.master = cluster.restart_master_process()
    time.sleep(2.0)
    stop.set()
    thread.join(30)
    assert not errors, errors[:3]
    with kvpool.connect(cluster.url, timeout=5) as pool:
        out = np.empty(64 << 10, np.uint8)
        for key, i in acked:
            assert pool.get_into(key, out) == out.size and np.array_equal(out, payload(i, 64 << 10))


def _ucxx_missing() -> bool:
    import importlib.util

    return importlib.util.find_spec("ucxx") is None


@pytest.mark.parametrize(
    "transport",
    [
        "tcp",
        "shm",
        pytest.param(
            "ucx",
            marks=pytest.mark.skipif(
                _ucxx_missing(), reason="ucxx not installed (pip install 'kvpool[ucx]')"
            ),
        ),
    ],
)
def test_a_reader_with_an_outdated_lease_never_gets_another_blocks_bytes(
    transport: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client holds a cached lease on a block; the master restarts, the block is
    removed and its range reused by another block. The old lease's read is a
    miss, not the other block's bytes: over TCP and UCX the node refuses it (the
    read names its block), over shared memory the block's identity record no
    longer names it."""
    from kvpool.errors import PoolFullError

    if transport == "ucx":  # nodes serve UCX over TCP here (no RDMA), with a token
        monkeypatch.setenv("KVPOOL_UCX", "on")
        monkeypatch.setenv("KVPOOL_TOKEN", "ucx-cluster-token")
    cluster = start_cluster(["1MiB"])  # one block of room: the range must be reused
    try:
        reader = kvpool.connect(cluster.url, timeout=5, transport=transport, lease_cache_s=60)
        other = kvpool.connect(cluster.url, timeout=5)
        k1, k2 = b"\x31" * 16, b"\x32" * 16
        out = np.empty(MIB, np.uint8)
        assert reader.put(k1, payload(1))
        assert reader.get_into(k1, out) == MIB  # the lease stays cached here
        cluster.restart_master()
        assert wait_until(lambda: other.exists([k1])[0], timeout=15)
        assert other.remove(k1)

        def reused() -> bool:
            try:
                return other.put(k2, payload(2))
            except PoolFullError:  # the re-join grace still pins k1's range
                return False

        assert wait_until(reused, timeout=15)
        got = reader.get_into(k1, out)
        assert got is None or np.array_equal(out, payload(1))
        assert not np.array_equal(out, payload(2))
        assert reader.stats()["transport"] == transport
        assert other.get_into(k2, out) == MIB and np.array_equal(out, payload(2))
        reader.close()
        other.close()
    finally:
        cluster.stop()


def test_claims_taken_ahead_for_grants_are_released_with_them() -> None:
    """Same-host puts claim their stocked grants on the node ahead of use; when a
    live client drops grants it did not use (they aged out), the claims go too,
    so the next allocation of those ranges is not kept waiting."""
    cluster = start_cluster(["4MiB"])
    try:
        block = 64 << 10
        first = kvpool.connect(cluster.url, timeout=5)
        for i in range(4):
            assert first.put(bytes([0x40 + i]) * 16, payload(i, block))
        time.sleep(2.5)  # the grants age out (1 s) and the client drops them
        with kvpool.connect(cluster.url, timeout=5, put_grant_bytes=0) as second:
            for i in range(40):  # fills the node: reuses the dropped grants' ranges
                t0 = time.monotonic()
                second.put(bytes([0x80 + i]) * 16, payload(100 + i, block))
                assert time.monotonic() - t0 < 1.5  # never a claim wait (2 s)
        first.close()
    finally:
        cluster.stop()


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_remove_and_re_put_into_the_same_ranges_keeps_every_block(transport: str) -> None:
    """Rounds of put, remove and put again of the same keys on a node with room
    for exactly those blocks: each key goes back into the range it just left,
    often before the node heard the old block's commit and free (frequent
    heartbeats split them from the new block's commit). Every checked read
    (TCP: by the node; shm: against the block's identity record) hits with the
    round's bytes, and after a kill -9 of the master right
    after the last ack the node re-registers every block. (Before events named
    their allocation, this failed within a few rounds; the deterministic
    interleaving is in test_event_allocations.)"""
    size, n = 64 << 10, 16
    cluster = Cluster(spawn(["master", "--port", "0", "--node-ttl", "3"]))
    try:
        cluster.add_node("1MiB", "--heartbeat", "0.02")  # the last flag wins
        keys = [bytes([0x50 + i]) * 16 for i in range(n)]
        out = np.empty(size, np.uint8)
        # no stocked grants: they would take room and make the puts evict
        with kvpool.connect(cluster.url, timeout=5, transport=transport, put_grant_bytes=0) as pool:
            round_, deadline = 0, time.monotonic() + 2.0
            while round_ < 2 or time.monotonic() < deadline:
                round_ += 1
                for i, key in enumerate(keys):
                    pool.remove(key)
                    assert pool.put(key, payload(i, size))  # the old block, soon removed
                    assert pool.remove(key)
                    assert pool.put(key, payload(100 * round_ + i, size))
                    assert pool.get_into(key, out) == size, (round_, i)
                    assert np.array_equal(out, payload(100 * round_ + i, size))
            cluster.master.kill()  # right after the last round's acks
            cluster.master = spawn(["master", "--port", str(cluster.master.port)])
            assert wait_until(lambda: pool.exists(keys) == [True] * n, timeout=15)
            for i, key in enumerate(keys):
                assert pool.get_into(key, out) == size
                assert np.array_equal(out, payload(100 * round_ + i, size))
    finally:
        cluster.stop()


@pytest.mark.parametrize("transport", [None, "tcp"])
def test_two_writers_of_one_key_after_a_master_restart(
    cluster: Cluster, transport: str | None
) -> None:
    """A put that won the race for its key (its writer was told True, its commit
    reached the master first) keeps the key across a master restart. The loser's
    block is whole on its node, never committed: the master's free of it is either
    applied by then (the node dropped it) or not (the node lists it unconfirmed,
    after its confirmed blocks, and the new master refuses a second block of a key
    unless confirmed, and replaces an unconfirmed one by a confirmed one)."""
    key = bytes([77]) * 16
    ours, theirs = payload(1), payload(2)
    with (
        kvpool.connect(cluster.url, timeout=5, transport=transport) as winner,
        kvpool.connect(cluster.url, timeout=5, transport=transport) as loser,
    ):

        def nodes_caught_up() -> bool:  # they applied every commit and free so far
            return not any(n["events_queued"] for n in winner.stats()["nodes"].values())

        winner.put(bytes([78]) * 16, payload(3))  # grants: the next put commits pipelined
        writer = loser.reserve(key, MIB)
        assert writer is not None
        writer.write(0, theirs)
        assert winner.put(key, ours)
        assert winner.exists([key]) == [True]  # committed first
        assert wait_until(nodes_caught_up, timeout=10)  # the winner's is confirmed there
        writer.commit()  # sealed on its node, its commit superseded
        cluster.master.kill()  # most often before the node heard of the free
        cluster.master = cluster.restart_master_process()
        assert wait_until(lambda: winner.exists([key]) == [True], timeout=15)
        assert wait_until(lambda: len(winner.stats()["nodes"]) == 2, timeout=15)
        assert len(winner.locate([key])[0]) == 1  # one block: the loser's was refused
        for _ in range(8):  # every replica the new master knows holds the winner's bytes
            assert all_back(winner, [key], [ours]) and all_back(loser, [key], [ours])

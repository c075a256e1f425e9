"""The single same-host put's short path (``RemotePutter._put_one``, issue 17), with
real master and node processes; the end of the file: ``put_batch``'s leading blocks
on the same path (``SealedPutter.put_batch``).

A single put of a new key with a grant in stock takes the short path when its
write is a TCP one (the stamp rides in it), or a same-host one whose grant
holds its claim and whose node publishes seal records (copy, seal record,
commit handed to the pipe). These tests hold that it is taken, that a
same-host one makes no round trip on the writer's thread, and that each way
it can fail ends as ``put_once`` would: the
grant is given back and the block is put again, so ``put`` answers True and
the bytes read back (the store contract: after ``put`` returns, the key holds
a block).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from clusterhelpers import Cluster, start_cluster, wait_until

import kvpool
import kvpool.cluster.client.claims as claims_module
import kvpool.cluster.client.puts as puts_module
import kvpool.cluster.client.sealed_put as sealed_put_module
from kvpool.cluster.client import fenced
from kvpool.cluster.wire import COMMIT
from kvpool.transport import tcp_wire as w
from kvpool.transport.shm_seal import now_ns

BLOCK = 256 << 10


def payload(i: int) -> np.ndarray:
    return np.random.default_rng(5200 + i).integers(0, 256, BLOCK, dtype=np.uint8)


def key(i: int) -> bytes:
    return bytes([0x60 + i]) * 16


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    c = start_cluster(["16MiB"])
    yield c
    c.stop()


def writer_with_grants(cluster: Cluster, transport: str = "shm") -> kvpool.RemotePool:
    """A writer whose stock holds grants (same host: claimed on their node)."""
    pool = kvpool.connect(cluster.url, timeout=10, transport=transport)
    assert wait_until(lambda: len(pool.stats()["nodes"]) == 1, timeout=15)
    assert pool.put(b"\x5f" * 16, payload(99))  # allocates, and asks for grants
    assert pool.stats()["transport"] == transport
    stock = pool._putter.grants  # claimed ahead, over TCP too (kvpool.cluster.client.claims)
    assert wait_until(lambda: stock.claimed_in_stock() > 2, timeout=10)
    return pool


def reads_back(cluster: Cluster, k: bytes, data: np.ndarray) -> bool:
    with kvpool.connect(cluster.url, timeout=10) as reader:
        out = np.empty(BLOCK, np.uint8)
        return reader.get_into(k, out) == BLOCK and np.array_equal(out, data)


def test_a_single_same_host_put_makes_no_round_trip_on_the_writers_thread(
    cluster: Cluster,
) -> None:
    with writer_with_grants(cluster) as pool:
        session = pool._session
        calls: list[str] = []
        real_call, real_control = session.rpc.call, session.control

        def call(method: str, *args: Any, **kwargs: Any) -> Any:
            calls.append(method)
            return real_call(method, *args, **kwargs)

        session.rpc.call = call  # type: ignore[method-assign]
        session.control = lambda n: calls.append("control") or real_control(n)  # type: ignore[method-assign,func-returns-value]
        shm_seals = session.counts["seals_shm"]
        try:
            assert pool.put(key(1), payload(1)) is True
        finally:
            session.rpc.call = real_call  # type: ignore[method-assign]
            session.control = real_control  # type: ignore[method-assign]
        # the control transport is looked up (for a late seal), never used
        assert [c for c in calls if c != "control"] == []
        assert session.counts["seals_shm"] == shm_seals + 1
        pool.flush()
        assert reads_back(cluster, key(1), payload(1))
        assert pool.put(key(1), payload(2)) is False  # its own duplicate: exact answer


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_a_single_put_of_a_new_key_takes_the_short_path(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch, transport: str
) -> None:
    with writer_with_grants(cluster, transport) as pool:
        putter = pool._putter
        general: list[int] = []
        real_put_once = putter.put_once

        def put_once(*args: Any, **kwargs: Any) -> Any:
            general.append(1)
            return real_put_once(*args, **kwargs)

        monkeypatch.setattr(putter, "put_once", put_once)
        used = putter.grants.used
        for i in range(3):
            assert pool.put(key(10 + i), payload(10 + i)) is True
        assert general == [] and putter.grants.used == used + 3
        assert pool.put(key(10), payload(0)) is False  # an own duplicate: the general path
        assert general == [1]
        monkeypatch.undo()
        pool.flush()
        for i in range(3):
            assert reads_back(cluster, key(10 + i), payload(10 + i))


@pytest.mark.parametrize(
    ("transport", "failure"), [("shm", "connection"), ("shm", "copy"), ("tcp", "connection")]
)
def test_a_failed_short_path_write_gives_its_grant_back_and_puts_again(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch, transport: str, failure: str
) -> None:
    """The node's connection breaks (the node releases the claim it held), or the
    copy itself fails (the write fence releases the claim): the grant is revoked,
    never committed, and the block is put again on a fresh allocation. (Same host:
    the general path, the client committing; the sealed path's own failures are
    the next test.)"""
    monkeypatch.setenv("KVPOOL_NODE_COMMITS", "0")
    with writer_with_grants(cluster, transport) as pool:
        supply = pool._putter.supply
        revoked: list[int] = []
        real_revoke = supply.revoke
        monkeypatch.setattr(supply, "revoke", lambda ids: revoked.extend(ids) or real_revoke(ids))
        real_write = fenced.write_blocks_begin
        failed: list[int] = []

        def write_blocks_begin(data: Any, control: Any, items: Any, *args: Any, **kw: Any) -> Any:
            if failed:
                return real_write(data, control, items, *args, **kw)
            stamp = items[0][0]
            failed.append(stamp.alloc_id)
            if failure == "connection":
                fenced.release_quietly(control, [stamp])  # what the node does on a broken link
                raise ConnectionResetError("injected")
            broken = FailingCopy(data)
            return real_write(broken, control, items, *args, **kw)

        monkeypatch.setattr(puts_module.fenced, "write_blocks_begin", write_blocks_begin)
        assert pool.put(key(2), payload(2)) is True
        monkeypatch.undo()
        assert failed and failed[0] in revoked
        pool.flush()
        assert reads_back(cluster, key(2), payload(2))


@pytest.mark.parametrize("failures", [1, 2])
def test_a_failed_sealed_put_copy_takes_the_general_path(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch, failures: int
) -> None:
    """Same host, the node committing (``sealed_put``): the copy fails once (the
    general path copies again into the same grant) or twice (the general path
    revokes the grant and puts again); either way ``put`` is True, nothing
    unwritten is sealed, and the bytes read back."""
    with writer_with_grants(cluster) as pool:
        putter = pool._putter
        assert putter.node_commits
        session = pool._session
        node_id = next(iter(session.regions))
        data = session.transport(node_id)
        real_write, calls = data.write, []

        def write(offset: int, src: Any) -> None:
            calls.append(offset)
            if len(calls) <= failures:
                raise OSError("injected: the copy failed")
            real_write(offset, src)

        revoked: list[int] = []
        real_revoke = putter.supply.revoke
        monkeypatch.setattr(
            putter.supply, "revoke", lambda ids: revoked.extend(ids) or real_revoke(ids)
        )
        monkeypatch.setattr(data, "write", write)
        watched = putter.commits.by_node.count
        assert pool.put(key(3), payload(3)) is True
        monkeypatch.undo()
        assert len(calls) == failures + 1
        if failures == 1:  # the same grant, sealed by the general path (still asking the node)
            assert calls[0] == calls[1] and not revoked
            assert putter.commits.by_node.count == watched + 1
        else:
            assert revoked  # the grant went back; a fresh allocation took the block
        pool.flush()
        assert reads_back(cluster, key(3), payload(3))


def test_a_tcp_put_that_fails_on_a_grant_claimed_ahead_releases_the_claim_and_puts_again(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The straight TCP path's write fails (its connection broke: the node ends that
    connection's hold); the claim taken ahead for the grant, held by another pooled
    connection, is released, the grant revoked, and the block put again."""
    with writer_with_grants(cluster, "tcp") as pool:
        supply = pool._putter.supply
        data = pool._session.transport(next(iter(pool._session.regions)))
        claimed = supply.stock.claimed_in_stock()
        released: list[int] = []
        real_release = fenced.release_quietly

        def release_quietly(control: Any, stamps: Any) -> None:
            released.extend(s.alloc_id for s in stamps)
            real_release(control, stamps)

        def stamped_one(*args: Any, **kwargs: Any) -> int:
            monkeypatch.setattr(data, "stamped_one", real_one)  # once
            raise ConnectionResetError("injected")

        real_one = data.stamped_one
        revoked: list[int] = []
        real_revoke = supply.revoke
        monkeypatch.setattr(supply, "revoke", lambda ids: revoked.extend(ids) or real_revoke(ids))
        monkeypatch.setattr(sealed_put_module.fenced, "release_quietly", release_quietly)
        monkeypatch.setattr(data, "stamped_one", stamped_one)
        assert pool.put(key(4), payload(4)) is True
        monkeypatch.undo()
        assert claimed > 0 and released and released[0] in revoked
        pool.flush()
        assert reads_back(cluster, key(4), payload(4))


def test_a_refill_that_raises_during_a_tcp_put_is_the_callers_error_not_the_nodes(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The stock's refill is asked for while the node lands a straight TCP put's
    bytes. An error of that request (here one a broken master link could raise,
    which the data path would take for the node's) surfaces from ``put`` once the
    write was answered: the block is acknowledged and reads back, the node is not
    suspected and no grant is revoked."""
    with writer_with_grants(cluster, "tcp") as pool:
        supply = pool._putter.supply
        revoked: list[int] = []
        real_revoke = supply.revoke
        monkeypatch.setattr(supply, "revoke", lambda ids: revoked.extend(ids) or real_revoke(ids))

        def top_up(size: int) -> None:
            raise ConnectionResetError("refill broke")

        monkeypatch.setattr(supply, "top_up", top_up)
        used = supply.stock.used
        with pytest.raises(ConnectionResetError, match="refill broke"):
            pool.put(key(6), payload(6))
        monkeypatch.undo()
        assert supply.stock.used == used + 1 and revoked == []  # the straight path took it
        assert not pool._session.suspects.current()
        assert pool.put(key(7), payload(7)) is True  # the connections still serve
        pool.flush()
        assert reads_back(cluster, key(6), payload(6))
        assert reads_back(cluster, key(7), payload(7))


def test_renewing_tcp_claims_taken_ahead_sends_nothing(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A renewal restarts a shared-memory seal deadline; a TCP claim has none, so
    the stock keeps its claims and no CLAIM leaves for them."""
    with writer_with_grants(cluster, "tcp") as pool:
        supply = pool._putter.supply
        claimed = supply.stock.claimed_in_stock()
        sent: list[int] = []
        real_ops = claims_module.fenced.ops
        monkeypatch.setattr(
            claims_module.fenced, "ops", lambda c, op, st: sent.append(op) or real_ops(c, op, st)
        )
        supply.renew_claims(now_ns() + 1)  # every claim is older: all renewed
        assert wait_until(lambda: supply.stock.claimed_in_stock() == claimed, timeout=10)
        assert w.OP_CLAIM not in sent
        assert pool.put(key(5), payload(5)) is True
        pool.flush()
        assert reads_back(cluster, key(5), payload(5))


def test_tcp_puts_after_a_master_restart_release_their_stale_claims_taken_ahead(
    cluster: Cluster,
) -> None:
    """The restarted master's term aborts the claims taken ahead (their connection
    still holds them); each put of an old term's grant is refused, releases its
    claim and is put again on the new master. Every put answers True and reads back."""
    with writer_with_grants(cluster, "tcp") as pool:
        cluster.restart_master()
        with kvpool.connect(cluster.url, timeout=10) as probe:
            assert wait_until(lambda: len(probe.stats()["nodes"]) == 1, timeout=15)
        for i in range(4):
            assert pool.put(key(20 + i), payload(20 + i)) is True
        pool.flush()
        for i in range(4):
            assert reads_back(cluster, key(20 + i), payload(20 + i))


class FailingCopy:
    """A data transport whose copies fail (``OSError``, as a closed mapping would)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def write_many(self, plan: list) -> None:
        raise OSError("injected: the copy failed")


def test_a_short_path_put_cut_by_a_master_restart_after_its_copy_is_stored(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The master restarts between the copy and the seal record: the node's new
    term aborts the claim once its seal deadline passed, the late seal is refused,
    and the put is made again on the new master. It answers True; the bytes read
    back, also after another restart (the retried block was sealed)."""
    with writer_with_grants(cluster) as pool:
        node_id = next(iter(pool._session.regions))
        data = pool._session.transport(node_id)
        real_write = data.write  # the sealed path's copy, and the general path's
        cut: list[str] = []

        def write(offset: int, src: Any) -> None:
            real_write(offset, src)
            if not cut:
                cut.append("restarted")
                cluster.restart_master()
                with kvpool.connect(cluster.url, timeout=10) as probe:
                    assert wait_until(lambda: len(probe.stats()["nodes"]) == 1, timeout=15)

        monkeypatch.setattr(data, "write", write)
        assert pool.put(key(3), payload(3)) is True
        monkeypatch.undo()
        assert cut == ["restarted"]
        assert reads_back(cluster, key(3), payload(3))
        cluster.restart_master()
        with kvpool.connect(cluster.url, timeout=10) as probe:
            assert wait_until(lambda: probe.exists([key(3)]) == [True], timeout=15)
        assert reads_back(cluster, key(3), payload(3))


# -- put_batch: its leading blocks take the same straight path -----------------------


class Recorder:
    """Counts the writer's calls to the general path and its master methods."""

    def __init__(self, pool: kvpool.RemotePool, monkeypatch: pytest.MonkeyPatch) -> None:
        self.general = 0
        self.methods: list[str] = []
        putter, rpc = pool._putter, pool._session.rpc
        real_put_once, real_call, real_submit = putter.put_once, rpc.call, rpc.submit

        def put_once(*args: Any, **kwargs: Any) -> Any:
            self.general += 1
            return real_put_once(*args, **kwargs)

        def call(method: str, *args: Any, **kwargs: Any) -> Any:
            self.methods.append(method)
            return real_call(method, *args, **kwargs)

        def submit(method: str, *args: Any, **kwargs: Any) -> Any:
            self.methods.append(method)
            return real_submit(method, *args, **kwargs)

        monkeypatch.setattr(putter, "put_once", put_once)
        monkeypatch.setattr(rpc, "call", call)
        monkeypatch.setattr(rpc, "submit", submit)


def test_a_same_host_batch_takes_the_single_puts_straight_path(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each block whose grant holds its claim: a copy and a seal record, its node
    commits it; the writer sends no COMMIT and the general path is not taken."""
    with writer_with_grants(cluster) as pool:
        session = pool._session
        n = min(4, pool._putter.grants.claimed_in_stock())
        assert n >= 3
        seals = session.counts["seals_shm"]
        keys, datas = [key(30 + i) for i in range(n)], [payload(30 + i) for i in range(n)]
        seen = Recorder(pool, monkeypatch)
        assert pool.put_batch(keys, datas) == [True] * n
        monkeypatch.undo()
        assert seen.general == 0 and COMMIT not in seen.methods
        assert session.counts["seals_shm"] == seals + n
        pool.flush()
        for k, data in zip(keys, datas, strict=True):
            assert reads_back(cluster, k, data)


def test_a_batch_goes_the_general_way_from_the_first_block_the_straight_path_declines(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The writer's own duplicate in the middle: the blocks before it went straight,
    it and those after it go together the general way (which flushes, then answers
    False for the duplicate); every stored key reads back its own bytes."""
    with writer_with_grants(cluster) as pool:
        assert pool.put(key(40), payload(40))
        seals = pool._session.counts["seals_shm"]
        keys = [key(41), key(40), key(42)]
        datas = [payload(41), payload(0), payload(42)]
        seen = Recorder(pool, monkeypatch)
        assert pool.put_batch(keys, datas) == [True, False, True]
        monkeypatch.undo()
        assert seen.general == 1
        assert pool._session.counts["seals_shm"] >= seals + 1  # key 41 at least
        pool.flush()
        for i in (41, 40, 42):
            assert reads_back(cluster, key(i), payload(i))


@pytest.mark.parametrize(("transport", "replicas"), [("tcp", 1), ("shm", 2)])
def test_a_batch_the_straight_path_does_not_take_goes_the_general_way_whole(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch, transport: str, replicas: int
) -> None:
    """Over TCP the general path pipelines the batch's writes (the straight path
    would wait a round trip per block: no ``stamped_one``); replicas > 1 commit
    synchronously. One general put for the whole batch, every block reads back."""
    with writer_with_grants(cluster, transport) as pool:
        stamped_one: list[int] = []
        if transport == "tcp":
            node_id = next(iter(pool._session.regions))
            data = pool._session.transport(node_id)
            real_one = data.stamped_one
            monkeypatch.setattr(
                data, "stamped_one", lambda *a: stamped_one.append(1) or real_one(*a)
            )
        seals = pool._session.counts["seals_shm"]
        keys, datas = [key(50 + i) for i in range(3)], [payload(50 + i) for i in range(3)]
        seen = Recorder(pool, monkeypatch)
        assert pool.put_batch(keys, datas, replicas=replicas) == [True] * 3
        monkeypatch.undo()
        assert seen.general == 1 and stamped_one == []
        assert pool._session.counts["seals_shm"] == seals
        pool.flush()
        for k, d in zip(keys, datas, strict=True):
            assert reads_back(cluster, k, d)

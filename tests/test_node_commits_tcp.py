"""Commits sent by the node for TCP puts (issue 17): the writer's final write asks for them.

A TCP put whose node takes such asks (``RegionInfo.tcp_node_commits``) writes
its block with ``WRITE_COMMIT``; the node's data server owes the commit to its
commit thread before it acknowledges the write (kvpool.cluster.node_commits),
which commits it with others in one frame and records the answer in a book
(kvpool.cluster.commit_answers) that the writer asks (``COMMITS``) when it
flushes, and each janitor tick (kvpool.cluster.client.node_watch). Unit tests
drive the real book, block table, data server and client connection (a fake
master link for the committer); the proof runs real master and node
processes: no COMMIT frame from the writer, read-your-writes, other clients
see the block within the stated bound, a master killed -9 right after such
puts loses none of them, a stopped node leaves its puts to the writer within
the bound.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

import numpy as np
import pytest
from clusterhelpers import start_cluster, wait_until
from poolhelpers import BLOCK, make_keys, payload
from sealhelpers import K1, K2, P1, PAGE, Link, real, sealed_by_tcp, table
from test_node_commits import reads_back, stock_claimed_grants

import kvpool
from kvpool.cluster.block_table import BlockTable
from kvpool.cluster.client import node_watch
from kvpool.cluster.client.acked import Acked
from kvpool.cluster.client.fenced import write_blocks_begin
from kvpool.cluster.client.node_watch import NodeWatch
from kvpool.cluster.commit_answers import CommitAnswers
from kvpool.cluster.node_commits import SealCommitter
from kvpool.errors import CallTimeoutError, ConnectionLostError, RemoteError
from kvpool.transport import tcp_wire as w
from kvpool.transport.base import RegionInfo
from kvpool.transport.fencing import FENCE_OK, WriteStamp
from kvpool.transport.shm_seal import NODE_COMMITS, NOT_COMMITTED, VISIBLE, SealRecords
from kvpool.transport.tcp import TcpTransport
from kvpool.transport.tcp_conn import DataConn
from kvpool.transport.tcp_server import TcpDataServer
from kvpool.transport.tcp_wire import UNKNOWN

# -- the book ------------------------------------------------------------------------------


def test_the_book_hands_each_answer_out_once_and_only_for_asks_it_holds() -> None:
    book = CommitAnswers()
    book.owed(7, PAGE, 3)
    assert book.ask([(7, PAGE), (8, 0)]) == bytes([NODE_COMMITS, UNKNOWN])
    assert not book.answer(8, 0, 3, VISIBLE)  # nobody asked for that one here: not kept
    assert book.answer(7, PAGE, 3, VISIBLE)
    assert book.ask([(7, PAGE)]) == bytes([VISIBLE])
    assert book.ask([(7, PAGE)]) == bytes([UNKNOWN]) and len(book) == 0  # handed out once
    book.owed(7, PAGE, 3)
    book.answer(7, PAGE, 3, VISIBLE)  # never asked for (its writer died) ...
    book.owed(7, PAGE, 4)  # ... and the same id, lent again by a newer master term
    assert book.ask([(7, PAGE)]) == bytes([NODE_COMMITS])  # never the older write's answer
    assert book.answer(7, PAGE, 3, NOT_COMMITTED)  # a late answer of the older write ...
    assert book.ask([(7, PAGE)]) == bytes([NODE_COMMITS])  # ... does not land on it either
    book.owed(9, 2 * PAGE, 4)
    book.answer(9, 2 * PAGE, 4, NOT_COMMITTED)
    assert book.ask([(9, PAGE), (9, 2 * PAGE)]) == bytes([UNKNOWN, NOT_COMMITTED])


def test_the_book_forgets_what_nobody_asks_for() -> None:
    now = [100.0]
    book = CommitAnswers(clock=lambda: now[0], keep_s=10.0, max_kept=3)
    for alloc in (1, 2, 3, 4):
        book.owed(alloc, 0, 3)
    assert len(book) == 3  # the oldest went first
    assert book.ask([(1, 0), (4, 0)]) == bytes([UNKNOWN, NODE_COMMITS])
    now[0] += 5.0
    book.answer(4, 0, 3, VISIBLE)  # answered (and so renewed) now
    now[0] += 6.0
    book.owed(5, 0, 3)  # 2 and 3 were asked 11 s ago: forgotten
    assert book.ask([(2, 0), (3, 0), (4, 0), (5, 0)]) == bytes(
        [UNKNOWN, UNKNOWN, VISIBLE, NODE_COMMITS]
    )


def test_an_ask_hurries_the_commit_and_waits_for_its_answer() -> None:
    book, hurried = CommitAnswers(), []
    book.owed(1, 0, 3)
    threading.Timer(0.05, lambda: book.answer(1, 0, 3, VISIBLE)).start()
    began = time.monotonic()
    assert book.ask([(1, 0)], wait_s=5.0, hurry=lambda: hurried.append(1)) == bytes([VISIBLE])
    assert time.monotonic() - began < 2.0 and hurried == [1]
    book.owed(2, 0, 3)
    began = time.monotonic()
    assert book.ask([(2, 0)], wait_s=0.1) == bytes([NODE_COMMITS])  # not answered in time
    assert 0.09 <= time.monotonic() - began < 2.0
    assert book.ask([(2, 0)], wait_s=0.0) == bytes([NODE_COMMITS])  # a janitor's ask: no wait


# -- the node: its table owes, its commit thread answers in the book -----------------------


def test_a_final_tcp_write_that_asks_is_owed_once(tmp_path) -> None:
    seals = SealRecords(str(tmp_path / "seal"), 16 * PAGE, create=True, node_commits=True)
    t = table(seals)
    sealed_by_tcp(t, real(1, 0), real(2, PAGE, key=K2))
    assert t.owe(real(1, 0))
    assert not t.owe(real(9, PAGE, key=K2))  # another allocation holds that range
    assert [e.stamp.alloc_id for e in t.adopt_owed()] == [1]
    assert t.adopt_owed() == []
    assert t.claim(real(3, 2 * PAGE), owner="conn") == FENCE_OK
    assert not t.owe(real(3, 2 * PAGE))  # not whole yet
    assert not BlockTable(lambda o, s: 1).owe(real(1, 0))  # a table that takes no asks
    seals.close()


def test_the_committer_answers_tcp_writers_in_the_book_not_the_records(tmp_path) -> None:
    seals = SealRecords(str(tmp_path / "seal"), 16 * PAGE, create=True, node_commits=True)
    t = table(seals)
    blocks = [real(i + 1, i * PAGE, key=bytes([i + 1]) * 16) for i in range(3)]
    sealed_by_tcp(t, *blocks)
    link = Link([True, False, None])
    committer = SealCommitter(t, seals, lambda: link)  # type: ignore[arg-type]
    for stamp in blocks:
        committer.owe(stamp)
    committer.owe(real(9, 5 * PAGE))  # nothing of it there: its writer settles it at once
    ids = [(s.alloc_id, s.offset) for s in blocks] + [(9, 5 * PAGE)]
    assert committer.outcomes(ids, 0.0) == bytes([NODE_COMMITS] * 3 + [NOT_COMMITTED])
    assert committer._commit(t.adopt_owed()) == []
    request = link.calls[0]
    assert request.ids == [1, 2, 3] and request.keys == [s.key for s in blocks]
    assert request.parents == [P1] * 3
    assert committer.outcomes(ids[:3], 0.0) == bytes([VISIBLE, VISIBLE, NOT_COMMITTED])
    assert all(seals.read(s.offset) is None for s in blocks)  # no record was touched
    assert (committer.committed, committer.not_committed) == (2, 2)
    seals.close()


# -- the wire: WRITE_COMMIT and COMMITS --------------------------------------------------


class Desk:
    """A commit desk that records what it owes and answers from a dict."""

    def __init__(self) -> None:
        self.owed: list[WriteStamp] = []
        self.states: dict[tuple[int, int], int] = {}

    def owe(self, stamp: WriteStamp) -> None:
        self.owed.append(stamp)

    def outcomes(self, ids: list[tuple[int, int]], wait_s: float) -> bytes:
        return bytes(self.states.get(i, UNKNOWN) for i in ids)


def serve(desk: Desk | None) -> tuple[TcpDataServer, TcpTransport, np.ndarray]:
    region = np.zeros(16 * PAGE, np.uint8)
    fence = BlockTable(lambda offset, size: 1, claim_wait=0.2)
    fence.new_term(3)
    server = TcpDataServer(region, fence=fence, commits=desk)
    server.start()
    info = RegionInfo("n", region.nbytes, tcp_host="127.0.0.1", tcp_port=server.address[1])
    info.tcp_instance, info.tcp_node_commits = server.instance, desk is not None
    return server, TcpTransport(info, timeout=5.0), region


def test_a_write_that_asks_is_owed_before_its_ack_and_its_answer_is_read_back() -> None:
    desk = Desk()
    server, client, region = serve(desk)
    try:
        data = np.full(PAGE, 7, np.uint8)
        asked: set[int] = set()
        statuses, sealing = write_blocks_begin(
            client, client, [(real(1, PAGE), PAGE, data)], node_commits=asked
        )
        assert statuses == [FENCE_OK] and sealing is None and asked == {0}
        assert desk.owed == [real(1, PAGE)]  # before the ack came back
        assert np.array_equal(region[PAGE : 2 * PAGE], data)
        write_blocks_begin(client, client, [(real(2, 2 * PAGE), 2 * PAGE, data)])
        assert desk.owed == [real(1, PAGE)]  # a plain final write asks nothing
        desk.states[(1, PAGE)] = VISIBLE
        ids = [(1, PAGE), (2, 2 * PAGE)] * 40_000  # more than one COMMITS carries
        assert client.commit_outcomes(ids, 0.0) == [VISIBLE, UNKNOWN] * 40_000
    finally:
        client.close()
        server.close()


def test_a_refused_write_that_asks_owes_nothing_and_leaves_the_stream_in_step() -> None:
    desk = Desk()
    server, client, region = serve(desk)
    try:
        data = np.full(PAGE, 9, np.uint8)
        asked: set[int] = set()
        stale = WriteStamp(2, 1, 0, PAGE, K1)  # an older master term: refused
        assert write_blocks_begin(client, client, [(stale, 0, data)], node_commits=asked)[0] == [
            w.ST_STALE
        ]
        assert desk.owed == [] and not region[:PAGE].any()  # its payload was drained, unused
        fresh = real(2, PAGE)
        assert write_blocks_begin(client, client, [(fresh, PAGE, data)], node_commits=asked)[0] == [
            FENCE_OK
        ]
        assert desk.owed == [fresh] and np.array_equal(region[PAGE : 2 * PAGE], data)
        out = np.empty(PAGE, np.uint8)
        assert client.read_block(PAGE, 0, out, K1) and np.array_equal(out, data)
    finally:
        client.close()
        server.close()


@pytest.mark.parametrize("length", [5, 16 * (w.MAX_COMMIT_IDS + 1)])
def test_a_malformed_commits_ask_is_refused_and_the_node_keeps_its_answers(length: int) -> None:
    """An ask whose ids are not whole (5 bytes) or too many: a clear error, that
    connection closed (its bytes were not read), and the node's answers untouched
    for the next ask on another connection."""
    desk = Desk()
    desk.states[(1, PAGE)] = VISIBLE
    server, client, _ = serve(desk)
    try:
        port = server.address[1]
        conn = DataConn("127.0.0.1", port, None, 5.0, server.instance)
        try:
            conn.sock.sendall(w.REQ.pack(w.OP_COMMITS, 0, 1, 0, length) + bytes(min(length, 64)))
            head = bytearray(w.RESP.size)
            w.recv_into_exact(conn.sock, memoryview(head))
            status, rid, n = w.RESP.unpack(head)
            message = bytearray(n)
            w.recv_into_exact(conn.sock, memoryview(message))
            assert (status, rid) == (w.ST_BAD_OP, 1) and b"bad COMMITS" in message
            assert conn.sock.recv(1) == b""  # then the node closed that connection
        finally:
            conn.close()
        assert client.commit_outcomes([(1, PAGE)], 0.0) == [VISIBLE]
    finally:
        client.close()
        server.close()


def test_a_node_that_takes_no_asks_is_never_asked_and_refuses_both_ops() -> None:
    server, client, _ = serve(None)
    try:
        asked: set[int] = set()
        data = np.full(PAGE, 3, np.uint8)
        assert write_blocks_begin(client, client, [(real(1, 0), 0, data)], node_commits=asked)[
            0
        ] == [FENCE_OK]
        assert asked == set()  # a plain final write: its writer commits it
        with pytest.raises(RemoteError, match="no commits by this node"):
            client.commit_outcomes([(1, 0)], 0.0)
        client.info.tcp_node_commits = True  # a client that wrongly thinks it does
        with pytest.raises(RemoteError, match="no such stamped writes"):
            write_blocks_begin(client, client, [(real(2, PAGE), PAGE, data)], node_commits=asked)
        assert client.read_block(0, 0, np.empty(PAGE, np.uint8), K1)  # the server still serves
    finally:
        client.close()
        server.close()


def test_an_ask_a_stopped_node_never_answers_times_out_after_its_wait() -> None:
    """A node that reads the ask but never answers (a stalled commit desk): the
    ask gives up after its wait plus the margin, not the connection's timeout."""
    desk = Desk()
    desk.outcomes = lambda ids, wait_s: time.sleep(3.0) or b""  # type: ignore[assignment]
    server, client, _ = serve(desk)
    try:
        began = time.monotonic()
        with pytest.raises(CallTimeoutError):
            client.commit_outcomes([(1, 0)], 0.2)
        assert time.monotonic() - began < 1.5
    finally:
        client.close()
        server.close()


# -- the writer's watch --------------------------------------------------------------------


class Node:
    """A TCP node's answers as the writer's asks read them."""

    def __init__(self) -> None:
        self.states: dict[int, int] = {}
        self.asks: list[float] = []
        self.down = False

    def commit_outcomes(self, ids: list[tuple[int, int]], wait_s: float = 0.0) -> list[int]:
        self.asks.append(wait_s)
        if self.down:
            raise CallTimeoutError("node stopped")
        return [self.states.get(alloc, NODE_COMMITS) for alloc, _ in ids]


def acked(alloc: int) -> Acked:
    return Acked(bytes([alloc]) * 16, None, alloc, "n", alloc * PAGE, PAGE, True)


def test_asked_puts_are_swept_by_asking_and_unsure_ones_go_to_settle_once() -> None:
    node, other, watch = Node(), Node(), NodeWatch()
    for alloc in (1, 2, 3, 4):
        watch.ask(acked(alloc), node)  # type: ignore[arg-type]
    watch.ask(acked(5), other)  # type: ignore[arg-type]
    assert watch.busy() and watch.count == 5 and node.asks == []  # no I/O on the put's thread
    node.states.update({1: VISIBLE, 2: NOT_COMMITTED, 4: UNKNOWN})  # 3: still owed
    other.down = True  # its node cannot be asked: settle decides
    unsure = watch.sweep_asked()
    assert sorted(a.alloc_id for a in unsure) == [2, 4, 5]
    assert [a.alloc_id for a, _ in watch.asked] == [3] and node.asks == [0.0]
    node.states[3] = VISIBLE
    assert watch.wait(time.monotonic() + 5) == [] and not watch.busy()
    assert 0 < node.asks[-1] <= node_watch.ASK_WAIT_S  # a flush's ask waits at the node


def test_a_flush_settles_what_its_tcp_node_does_not_answer_within_the_bound(
    monkeypatch,
) -> None:
    monkeypatch.setattr(node_watch, "ANSWER_S", 0.2)
    node, watch = Node(), NodeWatch()
    watch.ask(acked(1), node)  # type: ignore[arg-type]
    began = time.monotonic()
    assert [a.alloc_id for a in watch.wait(began + 60)] == [1]  # never answered
    assert 0.15 <= time.monotonic() - began < 1.0 and not watch.busy()


# -- the proof, with real processes ------------------------------------------------------


def tcp_writer(url: str) -> kvpool.RemotePool:
    pool = kvpool.connect(url, timeout=10, transport="tcp")
    assert wait_until(lambda: len(pool.stats()["nodes"]) == 1, timeout=15)
    return pool


def test_the_janitor_asks_the_node_so_nothing_stays_watched_without_a_flush() -> None:
    cluster = start_cluster(["16MiB"])
    try:
        keys = make_keys(12, seed=91)
        with tcp_writer(cluster.url) as writer:
            stock_claimed_grants(writer, keys[0], claimed=True)
            watch = writer._putter.commits.by_node
            for i in range(1, 12):
                assert writer.put(keys[i], payload(i))
            assert watch.busy() and watch.count >= 4
            assert wait_until(lambda: not watch.busy(), timeout=10)  # no read, no flush
            assert writer._putter.commits.idle()
        assert all(reads_back(cluster.url, keys[i], i) for i in range(12))
    finally:
        cluster.stop()


def test_tcp_puts_acknowledged_right_before_a_master_crash_are_all_kept() -> None:
    """The master is killed -9 right after a burst of TCP puts whose node commits
    them: some commits never reached it. The node re-registers every block it
    holds with the new master, so the writer's flush finds each put visible
    (answered, re-registered, or settled), and every block reads back."""
    cluster = start_cluster(["16MiB"])
    try:
        keys = make_keys(30, seed=92)
        with tcp_writer(cluster.url) as writer:
            stock_claimed_grants(writer, keys[0], claimed=True)
            for i in range(1, 25):
                assert writer.put(keys[i], payload(i))
            assert writer._putter.commits.by_node.count >= 4  # the path under test
            cluster.restart_master()  # killed -9, then a new one on its port
            writer.flush()
            assert writer._putter.commits.idle()
        with kvpool.connect(cluster.url, timeout=10, transport="tcp") as reader:
            assert wait_until(lambda: reader.exists(keys[:25]) == [True] * 25, timeout=15)
        for i in range(25):
            assert reads_back(cluster.url, keys[i], i)
    finally:
        cluster.stop()


def test_a_tcp_put_whose_node_stops_is_settled_by_the_writer_within_the_bound() -> None:
    """The node is stopped (SIGSTOP) right after a TCP put was acknowledged: the
    writer's flush cannot get the node's answer, gives up on it within the bound,
    and commits the put itself; once the node runs again the block reads back."""
    cluster = start_cluster(["16MiB"], "--node-ttl", "30")  # the stop must not drop the node
    try:
        keys = make_keys(2, seed=93)
        with tcp_writer(cluster.url) as writer:
            stock_claimed_grants(writer, keys[0], at_least=2, claimed=True)
            node = cluster.nodes[0]
            asked = writer._putter.commits.by_node.count
            assert writer.put(keys[1], payload(1))
            assert writer._putter.commits.by_node.count == asked + 1
            os.kill(node.pid, signal.SIGSTOP)
            try:
                began = time.monotonic()
                writer.flush()
                took = time.monotonic() - began
            finally:
                os.kill(node.pid, signal.SIGCONT)
            assert took < node_watch.ANSWER_S + 5
            assert reads_back(cluster.url, keys[1], 1)
    finally:
        cluster.stop()


def test_with_node_commits_off_tcp_puts_commit_from_the_writer(monkeypatch: Any) -> None:
    monkeypatch.setenv("KVPOOL_NODE_COMMITS", "0")
    cluster = start_cluster(["16MiB"])
    try:
        keys = make_keys(4, seed=94)
        with tcp_writer(cluster.url) as writer:
            for i in range(4):
                assert writer.put(keys[i], payload(i))
            writer.flush()
            assert writer._putter.commits.by_node.count == 0
            assert writer._putter.commits.sent >= 1
        assert all(reads_back(cluster.url, keys[i], i) for i in range(4))
    finally:
        cluster.stop()


def test_write_commit_keys_and_parents_reach_the_master() -> None:
    """What the node commits is what the writer wrote: key and parent (prefix match)."""
    cluster = start_cluster(["16MiB"])
    try:
        keys = make_keys(3, seed=95)
        with tcp_writer(cluster.url) as writer:
            stock_claimed_grants(writer, keys[0], at_least=2, claimed=True)
            assert writer.put(keys[1], payload(1), parent=keys[0])
            assert writer.put(keys[2], payload(2), parent=keys[1])
            assert writer._putter.commits.by_node.count >= 2
            assert writer.prefix_match(keys) == 3
    finally:
        cluster.stop()


def test_writer_threads_each_read_their_own_tcp_puts_back_at_once() -> None:
    """Four threads of one client put over TCP (their node commits) and each reads
    every block back right after its put: read-your-writes per call, whichever
    thread's flush or janitor tick asked the node; then another client reads all."""
    cluster = start_cluster(["32MiB"])
    try:
        keys = make_keys(80, seed=96)
        errors: list[BaseException] = []
        with tcp_writer(cluster.url) as writer:
            stock_claimed_grants(writer, keys[0], claimed=True)

            def work(t: int) -> None:
                out = np.empty(BLOCK, np.uint8)
                try:
                    for i in range(1 + t, len(keys), 4):
                        assert writer.put(keys[i], payload(i))
                        assert writer.get_into(keys[i], out) == BLOCK
                        assert np.array_equal(out, payload(i))
                except BaseException as exc:  # reported below
                    errors.append(exc)

            threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(60)
            assert not errors, errors
            assert writer._putter.commits.by_node.count >= 8  # the path under test
        assert all(reads_back(cluster.url, keys[i], i) for i in range(len(keys)))
    finally:
        cluster.stop()


def test_an_ask_for_many_commits_answered_one_by_one_takes_linear_time() -> None:
    """A flush of thousands of puts asks once; the commit thread answers them one by
    one, waking the ask each time: it must not rescan every id per answer."""
    book, ids = CommitAnswers(), [(alloc, 0) for alloc in range(20_000)]
    for alloc, offset in ids:
        book.owed(alloc, offset, 3)

    def answer_all() -> None:
        for alloc, offset in ids:
            book.answer(alloc, offset, 3, VISIBLE)

    answering = threading.Thread(target=answer_all)
    began = time.monotonic()
    answering.start()
    assert book.ask(ids, wait_s=1.0) == bytes([VISIBLE]) * len(ids)
    answering.join()
    assert time.monotonic() - began < 0.9 and len(book) == 0


def test_the_general_single_put_path_asks_the_node_too() -> None:
    """A single TCP put the straight path does not take (here: called past it) goes
    through ``RemotePutter._put_one``, which writes with ``WRITE_COMMIT`` as well."""
    cluster = start_cluster(["16MiB"])
    try:
        keys = make_keys(3, seed=97)
        with tcp_writer(cluster.url) as writer:
            stock_claimed_grants(writer, keys[0], claimed=True)
            commits = writer._putter.commits
            sent, asked = commits.sent, commits.by_node.count
            stored, full, _ = writer._putter.put([keys[1]], [payload(1)], [None], 1)
            assert stored == [True] and full == []
            assert commits.sent == sent and commits.by_node.count == asked + 1
            writer.flush()
        assert reads_back(cluster.url, keys[1], 1)
    finally:
        cluster.stop()


def test_a_failed_straight_tcp_write_is_put_again_by_the_general_path(monkeypatch: Any) -> None:
    """The straight path's write fails (the connection drops, once): its grant is
    revoked, the put goes the general way on another, and is stored all the same."""
    cluster = start_cluster(["16MiB"])
    try:
        keys = make_keys(2, seed=98)
        with tcp_writer(cluster.url) as writer:
            stock_claimed_grants(writer, keys[0], claimed=True)
            stamped_one = TcpTransport.stamped_one  # the straight path's write
            failed: list[int] = []

            def fail_once(self: TcpTransport, op: int, stamp: bytes, *args: Any) -> int:
                if not failed and op == w.OP_WRITE_COMMIT:
                    failed.append(1)
                    raise ConnectionLostError("dropped (test)")
                return stamped_one(self, op, stamp, *args)

            monkeypatch.setattr(TcpTransport, "stamped_one", fail_once)
            assert writer.put(keys[1], payload(1)) and failed == [1]
            writer.flush()
        assert reads_back(cluster.url, keys[1], 1)
    finally:
        cluster.stop()

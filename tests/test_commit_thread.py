"""The pipelined commits' sender thread (kvpool.cluster.client.commits, issue 17).

Unit tests drive ``CommitPipe`` with a recording stand-in for the master
connection (only the pipe's own rules are under test here); the tests with
real master and node processes hold the visibility rule with the sender
thread off (``KVPOOL_PUT_COMMIT_THREAD=0``, the fallback: the writer's thread
sends), since tests/test_put_pipeline.py runs everything with it on (its
master-kill test runs both ways).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any

import numpy as np
import pytest
from clusterhelpers import Cluster, start_cluster, wait_until
from poolhelpers import BLOCK, make_keys, payload

import kvpool
from kvpool.cluster.client.acked import Acked, Recovery
from kvpool.cluster.client.commits import CommitPipe
from kvpool.cluster.client.put_modes import commit_thread_default, node_commits_default
from kvpool.cluster.client.put_writes import read_back
from kvpool.cluster.wire import COMMIT, CommitRequest
from kvpool.errors import ConnectionLostError, PutCommitError


class Master:
    """Records each submitted COMMIT (ids, sending thread); answers on ``answer``."""

    def __init__(self) -> None:
        self.sent: list[tuple[list[int], str]] = []
        self.futures: list[Future[Any]] = []
        self.fail_next: BaseException | None = None
        self.calls: list[list[int]] = []
        self.lock = threading.Lock()

    def submit(self, method: str, params: CommitRequest) -> Future[Any]:
        assert method == COMMIT
        if self.fail_next is not None:
            exc, self.fail_next = self.fail_next, None
            raise exc
        fut: Future[Any] = Future()
        with self.lock:
            self.sent.append((list(params.ids), threading.current_thread().name))
            self.futures.append(fut)
        return fut

    def call(self, method: str, params: CommitRequest) -> list[bool | None]:
        assert method == COMMIT
        self.calls.append(list(params.ids))
        return [True] * len(params.ids)

    def answer(self) -> None:
        """Answer every frame sent so far: all committed."""
        with self.lock:
            pending = [(ids, f) for (ids, _), f in zip(self.sent, self.futures, strict=True)]
        for ids, fut in pending:
            if not fut.done():
                fut.set_result([True] * len(ids))

    def wait_sent(self, frames: int, timeout: float = 5.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.lock:
                if len(self.sent) >= frames:
                    return True
            time.sleep(0.001)
        return False


def acked(alloc_id: int) -> Acked:
    return Acked(bytes([alloc_id % 256]) * 16, None, alloc_id, "n", 0, 4096, True)


def no_recovery(items: list[Acked]) -> list[Recovery]:
    raise AssertionError("nothing here needs a recovery")


def pipe(master: Master, threaded: bool, linger_s: float) -> CommitPipe:
    p = CommitPipe(master, no_recovery, deadline_s=5.0, threaded=threaded)
    p.linger_s = linger_s
    return p


def test_puts_during_the_linger_share_one_frame_sent_by_the_sender_thread() -> None:
    master = Master()
    p = pipe(master, threaded=True, linger_s=1.0)
    try:
        for i in range(5):
            p.send([acked(i)])
            p.answered([acked(i)], [])
        assert master.wait_sent(1)
        time.sleep(0.05)
        assert master.sent == [([0, 1, 2, 3, 4], "kvpool-commits")]
        master.answer()
        p.flush()
        assert p.idle() and p.sent == 1
    finally:
        p.close()


def test_a_flush_cuts_the_linger_short() -> None:
    """Read-your-writes pays no linger: the flush wakes the sender at once."""
    master = Master()
    p = pipe(master, threaded=True, linger_s=30.0)
    answering = threading.Thread(target=lambda: master.wait_sent(1) and master.answer())
    answering.start()
    try:
        p.send([acked(1)])
        start = time.monotonic()
        p.flush()
        assert time.monotonic() - start < 5.0
        assert master.sent == [([1], "kvpool-commits")]
    finally:
        answering.join()
        p.close()


def test_commits_queued_behind_the_one_in_flight_go_when_it_is_answered() -> None:
    master = Master()
    p = pipe(master, threaded=True, linger_s=0.0)
    try:
        p.send([acked(1)])
        assert master.wait_sent(1)
        p.send([acked(2)])
        p.send([acked(3)])
        time.sleep(0.05)
        assert len(master.sent) == 1  # still in flight: the others wait for its answer
        master.answer()  # their linger is over: the answer sends them (here: on this thread)
        assert master.wait_sent(2)
        assert master.sent[1] == ([2, 3], threading.current_thread().name)
        master.answer()
        p.flush()
        assert p.idle()
    finally:
        p.close()


def test_commits_queued_behind_the_one_in_flight_linger_from_their_first_ack() -> None:
    """An answer does not send what queued behind it at once: the frame leaves
    ``linger_s`` after the first of those puts was acknowledged, so a stream of puts
    sends about one frame per linger, not one per master round trip."""
    master = Master()
    p = pipe(master, threaded=True, linger_s=0.0)
    try:
        p.send([acked(1)])
        assert master.wait_sent(1)
        p.linger_s = 0.3
        queued = time.monotonic()
        p.send([acked(2)])
        master.answer()
        p.send([acked(3)])  # joins the frame still lingering
        assert master.wait_sent(2)
        assert time.monotonic() - queued >= 0.25  # (timed waits may end a hair early)
        assert master.sent[1] == ([2, 3], "kvpool-commits")
        master.answer()
        p.linger_s = 0.0
        p.send([acked(4)])
        assert master.wait_sent(3)
        p.linger_s = 30.0
        p.send([acked(5)])
        master.answer()
        time.sleep(0.05)
        assert len(master.sent) == 3  # 5 lingers 30 s from its ack
        start = time.monotonic()
        answering = threading.Thread(target=lambda: master.wait_sent(4) and master.answer())
        answering.start()
        p.flush()  # cuts the queued frame's linger short
        answering.join()
        assert time.monotonic() - start < 5.0
        assert master.sent[3] == ([5], "kvpool-commits") and p.idle()
    finally:
        p.close()


def test_without_the_thread_the_writer_sends_at_once() -> None:
    master = Master()
    p = pipe(master, threaded=False, linger_s=0.2)
    try:
        p.send([acked(7)])
        assert master.sent == [([7], threading.current_thread().name)]
        master.answer()
        p.flush()
        assert p.idle()
    finally:
        p.close()


def test_a_failed_send_on_the_thread_is_retried_by_settle_not_lost() -> None:
    master = Master()
    master.fail_next = ConnectionLostError("master went away")
    p = pipe(master, threaded=True, linger_s=0.0)
    try:
        p.send([acked(4)])
        p.answered([acked(4)], [])
        p.flush()  # settle retries the commit synchronously: it lands
        assert master.calls == [[4]]
        assert p.idle()
    finally:
        p.close()


def test_an_unexpected_error_on_the_thread_keeps_the_thread_and_the_commit() -> None:
    master = Master()
    master.fail_next = RuntimeError("bug in an encoder")
    p = pipe(master, threaded=True, linger_s=0.0)
    try:
        p.send([acked(5)])
        p.answered([acked(5)], [])
        p.flush()
        assert master.calls == [[5]]
        p.send([acked(6)])  # the thread still serves
        assert master.wait_sent(1)
        assert master.sent == [([6], "kvpool-commits")]
        master.answer()
        p.flush()
    finally:
        p.close()


def test_close_stops_the_thread_and_later_sends_go_on_the_caller() -> None:
    master = Master()
    p = pipe(master, threaded=True, linger_s=0.0)
    p.send([acked(1)])
    assert master.wait_sent(1)
    master.answer()
    p.close()
    assert not any(t.name == "kvpool-commits" and t.is_alive() for t in threading.enumerate())
    p.send([acked(2)])
    assert master.sent[-1] == ([2], threading.current_thread().name)


@pytest.mark.parametrize(
    ("name", "read"),
    [
        ("KVPOOL_PUT_COMMIT_THREAD", commit_thread_default),
        ("KVPOOL_NODE_COMMITS", node_commits_default),
    ],
)
def test_the_setting_is_checked(
    monkeypatch: pytest.MonkeyPatch, name: str, read: Callable[[], bool]
) -> None:
    """The commit thread's and the node-commit switch (same-host puts leave their
    commit to the node) take 0 or 1; anything else fails before the client connects."""
    monkeypatch.setenv(name, "0")
    assert read() is False
    monkeypatch.setenv(name, " 1 ")
    assert read() is True
    monkeypatch.setenv(name, "on")
    with pytest.raises(ValueError, match=f"{name} must be 0 or 1, got 'on'"):
        read()
    with pytest.raises(ValueError, match=name):
        kvpool.connect("kvpool://127.0.0.1:1", timeout=1)  # before any connection


# --- real master and nodes, the writer's thread sending (the fallback) -------------


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    c = start_cluster(["16MiB", "16MiB"])
    yield c
    c.stop()


@pytest.fixture
def no_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVPOOL_PUT_COMMIT_THREAD", "0")


def connect(cluster: Cluster, transport: str | None = None) -> kvpool.RemotePool:
    pool = kvpool.connect(cluster.url, timeout=5, transport=transport)
    assert wait_until(lambda: len(pool.stats()["nodes"]) == 2, timeout=15)
    return pool


@pytest.mark.usefixtures("no_thread")
@pytest.mark.parametrize("transport", [None, "tcp"])
def test_without_the_thread_reads_see_own_writes_and_others_see_them(
    cluster: Cluster, transport: str | None
) -> None:
    keys = make_keys(40, seed=71)
    with connect(cluster, transport) as writer, connect(cluster) as reader:
        assert not writer._putter.commits.threaded
        out = np.empty(BLOCK, np.uint8)
        for i, key in enumerate(keys):
            assert writer.put(key, payload(i))
            assert writer.get_into(key, out) == BLOCK and np.array_equal(out, payload(i))
        assert wait_until(lambda: reader.exists(keys) == [True] * len(keys), timeout=5)
        assert not any(t.name == "kvpool-commits" for t in threading.enumerate())
        for key in keys:
            writer.remove(key)


def test_the_thread_sends_commits_that_others_see_without_a_writer_flush(
    cluster: Cluster,
) -> None:
    """No read-side call of the writer after its puts: the sender thread alone
    makes them visible to another client, within the linger plus a round trip
    (asserted loosely for a loaded machine)."""
    keys = make_keys(20, seed=72)
    with connect(cluster) as writer, connect(cluster) as reader:
        assert writer._putter.commits.threaded
        for i, key in enumerate(keys):
            assert writer.put(key, payload(i))
        assert wait_until(lambda: reader.exists(keys) == [True] * len(keys), timeout=5)
        assert writer.stats()["client"]["put_commits_pipelined"] <= len(keys)
        for key in keys:
            writer.remove(key)


def test_a_put_whose_write_outlasted_its_grant_window_commits_before_it_returns(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A write that took longer than the grant's use window (a contended node)
    is not acknowledged ahead of its commit: the master might expire the grant
    first. It commits synchronously, so it is visible to others on return."""
    import kvpool.cluster.client.puts as puts_module
    import kvpool.cluster.client.sealed_put as sealed_module

    keys = make_keys(6, seed=74)
    with connect(cluster) as writer, connect(cluster) as reader:
        for i, key in enumerate(keys[:4]):  # fills the writer's grant stock
            assert writer.put(key, payload(i))
        writer.flush()
        assert wait_until(lambda: len(writer._putter.grants) > 0, timeout=5)

        class Later:  # the put paths' clock only: the write "took" 5 s
            @staticmethod
            def monotonic() -> float:
                return time.monotonic() + 5.0

        monkeypatch.setattr(puts_module, "time", Later)  # the general path
        monkeypatch.setattr(sealed_module, "time", Later)  # same host: the straight path
        sent = writer._putter.commits.sent
        assert writer.put(keys[4], payload(4))
        assert writer._putter.late_commits == 1
        assert writer._putter.commits.sent == sent  # nothing left to the pipeline
        assert reader.exists([keys[4]]) == [True]  # no flush, no wait
        monkeypatch.undo()
        for key in keys[:5]:
            writer.remove(key)


def test_a_batch_commit_is_sent_by_the_caller_at_once() -> None:
    master = Master()
    p = pipe(master, threaded=True, linger_s=0.2)
    try:
        p.send([acked(1), acked(2)])
        assert master.sent == [([1, 2], threading.current_thread().name)]
        master.answer()
        p.flush()
        assert p.idle()
    finally:
        p.close()


class Refusing:
    """A master that knows none of the grants any more: COMMIT answers None for
    each, EXISTS False (what a settle meets after a restart or a node's drop)."""

    def submit(self, method: str, params: CommitRequest) -> Future[Any]:
        fut: Future[Any] = Future()
        fut.set_result([None] * len(params.ids))
        return fut

    def call(self, method: str, params: Any) -> list[Any]:
        return [None] * len(params.ids) if method == COMMIT else [False] * len(params.keys)


def test_a_put_whose_node_died_is_lost_with_it_not_raised() -> None:
    """Settling refused commits: bytes gone from a node that answered are an error
    (``PutCommitError``); a node that cannot be reached took the only copy with it,
    as it takes a visible block's: logged, and the writer's calls go on."""
    outcomes = {1: Recovery.NODE_LOST, 2: Recovery.GONE, 3: Recovery.VISIBLE}
    p = CommitPipe(Refusing(), lambda items: [outcomes[a.alloc_id] for a in items], 5.0, False)
    items = [acked(1), acked(2), acked(3)]
    p.send(items)
    p.answered(items, [])
    with pytest.raises(PutCommitError) as err:
        p.flush()
    assert err.value.keys == [acked(2).key] and p.recovered == 1
    p.flush()  # raised once; nothing else pending


class DeadNodes:
    """A session whose nodes refuse every connection: "gone" refuses at once and
    its port takes none; "stopped" times out but its port still answers."""

    def __init__(self) -> None:
        self.probes: list[str] = []
        self.reads: list[str] = []

    def control(self, node_id: str) -> Any:
        session = self

        class Control:
            def read_blocks(self, items: list[Any]) -> list[bool]:
                session.reads.append(node_id)
                raise (ConnectionRefusedError if node_id == "gone" else TimeoutError)("no")

        return Control()

    def node_alive(self, node_id: str) -> bool:
        self.probes.append(node_id)
        return node_id != "gone"


def test_a_read_back_asks_a_gone_node_once_and_a_stopped_node_every_time() -> None:
    """Settling refused commits reads the sealed bytes back: a node found gone is
    neither read nor probed again for the items after it (each try of a dead host
    can cost the whole timeout); a stopped node is not gone, its items each tried."""
    items = [acked(i)._replace(node_id="gone" if i % 2 else "stopped") for i in range(6)]
    session = DeadNodes()
    copies, unreachable = read_back(session, items)  # type: ignore[arg-type]
    assert copies == [None] * 6 and unreachable == {1, 3, 5}
    assert session.reads == ["stopped", "gone", "stopped", "stopped"]
    assert session.probes == ["stopped", "gone", "stopped", "stopped"]

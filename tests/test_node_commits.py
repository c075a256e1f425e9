"""Commits sent by the node (issue 17): a same-host put sealed in shared memory sends nothing.

The writer seals a claim taken ahead with ``NODE_COMMITS`` in its seal record
(kvpool.transport.shm_seal); the node adopts it, commits it to the master and
answers in the record (kvpool.cluster.node_commits); the writer's flush waits
for that answer (kvpool.cluster.client.node_watch). Unit tests drive the real
seal file and block table (a fake master link for the committer's answers);
the proof runs real master and node processes: no COMMIT frame from the
writer, read-your-writes, other clients see the block within the stated
bound, a stalled node leaves the put to the writer within the bound (a
master killed -9 right after such puts: test_shm_seal).
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
from sealhelpers import K2, P1, PAGE, Link, ahead, real, sealed_by_tcp, table

import kvpool
from kvpool.cluster import node_commits
from kvpool.cluster.block_entry import COMMITTED
from kvpool.cluster.block_table import BlockTable
from kvpool.cluster.client import node_watch
from kvpool.cluster.client.acked import Acked
from kvpool.cluster.client.node_watch import NodeWatch
from kvpool.cluster.node_commits import BUSY_S, IDLE_S, QUIET_S, SealCommitter
from kvpool.errors import MasterUnavailableError
from kvpool.transport import shm_doorbell
from kvpool.transport.fencing import FENCE_OK
from kvpool.transport.shm_seal import (
    NODE_COMMITS,
    NOT_COMMITTED,
    SEALED,
    VISIBLE,
    SealRecords,
)


def files(tmp_path: Any, node_commits: bool = True) -> tuple[SealRecords, SealRecords]:
    """(the node's seal file, a writer's mapping of it)."""
    path = str(tmp_path / "arena.seal")
    node = SealRecords(path, 16 * PAGE, create=True, node_commits=node_commits)
    return node, SealRecords(path, 16 * PAGE, create=False)


# -- the record: asking, ringing, answering ----------------------------------------------


def test_a_record_asks_the_node_only_where_the_node_commits(tmp_path) -> None:
    node, writer = files(tmp_path)
    assert writer.node_commits and not node.rung()
    assert writer.write(real(7, PAGE), node_commits=True)
    assert node.read(PAGE) == (real(7, PAGE), True)
    assert node.rung() and not node.rung()  # cleared by the node's read
    assert writer.write(real(8, 2 * PAGE))  # the writer commits this one itself
    assert node.read(2 * PAGE) == (real(8, 2 * PAGE), False)
    assert not node.rung()
    assert node.sealed_at([0, PAGE, 2 * PAGE, 3 * PAGE]) == [PAGE, 2 * PAGE]
    (tmp_path / "old").mkdir()
    old_node, old_writer = files(tmp_path / "old", node_commits=False)
    assert not old_writer.node_commits
    assert old_writer.write(real(9, PAGE), node_commits=True)  # the node would not: plain seal
    assert old_node.read(PAGE) == (real(9, PAGE), False)
    assert not old_node.rung()
    for f in (writer, node, old_writer, old_node):
        f.close()


def test_the_answer_lands_only_in_the_record_of_its_allocation(tmp_path) -> None:
    node, writer = files(tmp_path)
    writer.write(real(7, PAGE), node_commits=True)
    assert writer.outcome(PAGE, 7) == NODE_COMMITS
    node.answer(PAGE, 6, 3, VISIBLE)  # another allocation: left alone
    assert writer.outcome(PAGE, 7) == NODE_COMMITS
    node.answer(PAGE, 7, 2, NOT_COMMITTED)  # that id's write of an older term: left alone
    assert writer.outcome(PAGE, 7) == NODE_COMMITS
    node.answer(PAGE, 7, 3, VISIBLE)
    assert writer.outcome(PAGE, 7) == VISIBLE
    node.answer(PAGE, 7, 3, NOT_COMMITTED)  # answered once: a later answer does not flip it
    assert writer.outcome(PAGE, 7) == VISIBLE
    assert writer.outcome(PAGE, 8) is None  # reused for another claim: no answer for 8
    writer.write(real(9, 2 * PAGE))
    node.answer(2 * PAGE, 9, 3, VISIBLE)  # the writer commits that one: not the node's
    assert writer.outcome(2 * PAGE, 9) == SEALED
    writer.close()
    node.close()


# -- the block table: what the node owes ------------------------------------------------


def test_a_sealed_claim_is_owed_once_and_a_writer_committed_one_never(tmp_path) -> None:
    node, writer = files(tmp_path)
    t = table(node)
    for alloc, offset in ((1, 0), (2, PAGE), (3, 2 * PAGE)):
        assert t.claim(ahead(alloc, offset), owner="claims") == FENCE_OK
    assert t.adopt_owed() == []
    writer.write(real(1, 0), node_commits=True)
    writer.write(real(2, PAGE))  # SEALED: its writer commits it
    owed = t.adopt_owed()
    assert [e.stamp for e in owed] == [real(1, 0)]
    assert t.adopt_owed() == []  # once
    assert t.state_of(PAGE) == "written"  # adopted, but not owed
    # Sealed over TCP (the writer was past its deadline) with a record that asks: owed.
    writer.write(real(3, 2 * PAGE, key=K2), node_commits=True)
    done = t.finish(real(3, 2 * PAGE, key=K2), "writer", ok=True, seal=True, any_owner=True)
    assert done == FENCE_OK
    assert [e.stamp.alloc_id for e in t.adopt_owed()] == [3]
    writer.close()
    node.close()


def test_a_claim_aborted_by_a_new_term_is_never_owed(tmp_path) -> None:
    node, writer = files(tmp_path)
    node_clock = [10**12]
    t = BlockTable(lambda o, s: 1, claim_wait=0.2, seals=node, clock=lambda: node_clock[0])
    t.new_term(3)
    assert t.claim(ahead(1), owner="claims") == FENCE_OK
    node_clock[0] += 10**10  # far past its deadline: the new term aborts it
    t.new_term(4)
    writer.write(real(1, 0), node_commits=True)  # a late writer
    assert t.adopt_owed() == []
    writer.close()
    node.close()


# -- the committer's answers (a fake master link) ---------------------------------------


def owed_blocks(tmp_path: Any, n: int) -> tuple[SealRecords, SealRecords, BlockTable]:
    node, writer = files(tmp_path)
    t = table(node)
    for i in range(n):
        assert t.claim(ahead(i + 1, i * PAGE), owner="claims") == FENCE_OK
        writer.write(real(i + 1, i * PAGE, key=bytes([i + 1]) * 16), node_commits=True)
    return node, writer, t


def test_the_committer_answers_each_writer_by_the_masters_answer(tmp_path) -> None:
    node, writer, t = owed_blocks(tmp_path, 3)
    link = Link([True, False, None])
    committer = SealCommitter(t, node, lambda: link)  # type: ignore[arg-type]
    assert committer._commit(t.adopt_owed()) == []
    request = link.calls[0]
    assert request.ids == [1, 2, 3] and request.keys == [bytes([i]) * 16 for i in (1, 2, 3)]
    assert request.parents == [P1] * 3
    # True: committed; False: the key was stored already; None: no such grant (expired).
    assert [writer.outcome(i * PAGE, i + 1) for i in range(3)] == [VISIBLE, VISIBLE, NOT_COMMITTED]
    assert (committer.committed, committer.not_committed) == (2, 1)
    writer.close()
    node.close()


def test_an_unreachable_master_is_retried_and_a_new_term_answers_by_state(tmp_path) -> None:
    node, writer, t = owed_blocks(tmp_path, 2)
    link = Link(MasterUnavailableError("down"))
    committer = SealCommitter(t, node, lambda: link)  # type: ignore[arg-type]
    owed = t.adopt_owed()
    with pytest.raises(MasterUnavailableError):
        committer._commit(owed)
    assert writer.outcome(0, 1) == NODE_COMMITS  # no answer yet: the writer still waits
    t.suspend()  # the node re-registers with a new master: both blocks are listed
    assert len(t.listing()) == 2
    assert committer._commit(owed) == owed  # not registered yet: asked again later
    assert all(e.state == COMMITTED for e in owed)
    t.new_term(4)
    assert committer._commit(owed) == [] and link.calls == [link.calls[0]]  # no call needed
    assert [writer.outcome(0, 1), writer.outcome(PAGE, 2)] == [VISIBLE, VISIBLE]
    writer.close()
    node.close()


class CountedPolls(SealRecords):
    """The node's seal file, counting the commit thread's doorbell polls."""

    polls = 0

    def rung(self) -> bool:
        self.polls += 1
        return super().rung()


@pytest.mark.parametrize("rings_wake", [True, False])
def test_an_idle_committer_stops_polling_until_a_ring_or_an_owe_wakes_it(
    tmp_path, monkeypatch, rings_wake: bool
) -> None:
    """Nothing owed: the thread waits (``DOZE_S``, made long here so only a wake can
    explain a prompt commit) instead of polling every ``IDLE_S``, open claims taken
    ahead or not: a writer's ring, or a TCP write's owed commit, wakes it at once.
    Where rings cannot wake it (a writer without the futex attached: ``rings_wake``
    False) an open claim keeps it polling, and the claim taken ahead wakes it."""
    monkeypatch.setattr(node_commits, "DOZE_S", 60.0)
    path = str(tmp_path / "arena.seal")
    node = CountedPolls(path, 16 * PAGE, create=True, node_commits=True)
    if not rings_wake:
        monkeypatch.setattr(shm_doorbell, "AVAILABLE", False)
    writer = SealRecords(path, 16 * PAGE, create=False)
    assert node.rings_wake == (rings_wake and shm_doorbell.AVAILABLE)
    t = table(node)
    link = Link([True], [True])
    committer = SealCommitter(t, node, lambda: link)  # type: ignore[arg-type]
    committer.start()
    try:
        time.sleep(0.2)
        assert node.polls == 1  # one look, then it waits: ~100 polls at IDLE_S otherwise
        assert t.claim(ahead(1), owner="claims") == FENCE_OK
        time.sleep(0.1)
        if node.rings_wake:
            assert node.polls == 1  # an open claim: its writer's ring will wake it
        else:
            assert node.polls > 10  # the claim woke it, and it polls while it is open
        writer.write(real(1), node_commits=True)
        assert wait_until(lambda: writer.outcome(0, 1) == VISIBLE, timeout=10, interval=0.001)
        time.sleep(max(BUSY_S, QUIET_S) + 0.1)  # it polls a while after a block, then waits
        polls = node.polls
        time.sleep(0.2)
        assert node.polls == polls
        sealed_by_tcp(t, real(2, PAGE, key=K2))  # no claim taken ahead: it sleeps on
        time.sleep(0.05)
        assert node.polls == polls
        committer.owe(real(2, PAGE, key=K2))  # that write's final frame asked: wakes it
        assert wait_until(lambda: len(link.calls) == 2, timeout=10, interval=0.001)
        assert committer.outcomes([(2, PAGE)], 0.0) == bytes([VISIBLE])
    finally:
        committer.close()
        writer.close()
        node.close()


# -- the writer's watch --------------------------------------------------------------------


class Records:
    """A seal file's answers as the writer reads them (``outcome``)."""

    def __init__(self) -> None:
        self.states: dict[int, int | None] = {}

    def outcome(self, offset: int, alloc_id: int) -> int | None:
        return self.states.get(alloc_id, NODE_COMMITS)


def acked(alloc: int) -> Acked:
    return Acked(bytes([alloc]) * 16, None, alloc, "n", alloc * PAGE, PAGE, True)


def test_the_watch_forgets_visible_puts_and_hands_the_rest_to_settle(monkeypatch) -> None:
    monkeypatch.setattr(node_watch, "SWEEP_EVERY", 4)
    records, watch = Records(), NodeWatch()
    for alloc in (1, 2, 3):
        assert watch.watch(acked(alloc), records) == []  # type: ignore[arg-type]
    records.states.update({1: VISIBLE, 2: NOT_COMMITTED})  # 3: still waiting
    records.states[4] = None  # its record was reused before it was read: look it up
    unsure = watch.watch(acked(4), records)  # type: ignore[arg-type]  # the 4th: a sweep
    assert [a.alloc_id for a in unsure] == [2, 4]
    assert [a.alloc_id for a, _ in watch.watched] == [3] and watch.count == 4
    records.states[3] = VISIBLE
    assert watch.wait(time.monotonic() + 5) == [] and not watch.watched


def test_a_flush_settles_what_its_node_does_not_answer_within_the_bound(monkeypatch) -> None:
    monkeypatch.setattr(node_watch, "ANSWER_S", 0.2)
    records, watch = Records(), NodeWatch()
    watch.watch(acked(1), records)  # type: ignore[arg-type]
    began = time.monotonic()
    assert [a.alloc_id for a in watch.wait(began + 60)] == [1]  # the node never answers
    assert 0.15 <= time.monotonic() - began < 1.0 and not watch.watched  # (less a last pause)


def test_a_flush_hands_out_at_once_the_puts_of_a_node_that_died(monkeypatch) -> None:
    """A dead node's seal records never change: a flush that has waited PROBE_S asks
    whether the nodes owing answers are alive, and hands out a dead one's puts at
    once instead of waiting ANSWER_S for them; a live node is waited for as before."""
    monkeypatch.setattr(node_watch, "ANSWER_S", 30.0)
    records, watch = Records(), NodeWatch()
    dead, live = acked(1)._replace(node_id="dead"), acked(2)._replace(node_id="live")
    asked: list[str] = []
    watch.alive = lambda node: asked.append(node) or node != "dead"  # type: ignore[func-returns-value]
    for item in (dead, live):
        watch.watch(item, records)  # type: ignore[arg-type]
    threading.Timer(0.3, lambda: records.states.update({2: VISIBLE})).start()
    began = time.monotonic()
    assert watch.wait(began + 60) == [dead]  # the live node's answer came
    assert 0.25 <= time.monotonic() - began < 2.0 and not watch.watched
    assert sorted(asked) == ["dead", "live"]  # one probe per node, once per wait


# -- the proof, with real processes ------------------------------------------------------


def nodes_ready(pool: kvpool.RemotePool, n: int = 1) -> bool:
    return wait_until(lambda: len(pool.stats()["nodes"]) == n, timeout=15)


def reads_back(url: str, key: bytes, i: int) -> bool:
    """Another client reads ``key`` back as ``payload(i)``."""
    with kvpool.connect(url, timeout=10) as reader:
        out = np.empty(BLOCK, np.uint8)
        return reader.get_into(key, out) == BLOCK and np.array_equal(out, payload(i))


def stock_claimed_grants(
    writer: kvpool.RemotePool, key: bytes, at_least: int = 4, claimed: bool = True
) -> None:
    """Put ``key`` (payload 0; it allocates, grants come with it), then wait until
    the writer's stock holds grants (``claimed``: claimed on their node, so the
    next same-host puts are sealed). The first put's commit (the client's own: no
    grant yet) is answered first, so a caller counting the writer's commit frames
    never sees it late (a CI run under load once read the count before the commit
    thread had sent it)."""
    assert nodes_ready(writer)
    assert writer.put(key, payload(0))
    writer.flush()
    stock = writer._putter.grants
    held = stock.claimed_in_stock if claimed else stock.__len__
    assert wait_until(lambda: held() > at_least, timeout=10)


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_puts_their_node_commits_send_no_commit_and_are_read_back_by_all(
    transport: str,
) -> None:
    """Same host: sealed in shared memory with ``NODE_COMMITS``; TCP: written with
    ``WRITE_COMMIT`` (kvpool.cluster.client.node_watch asks the node)."""
    cluster = start_cluster(["16MiB"])
    try:
        keys = make_keys(24, seed=81)
        with (
            kvpool.connect(cluster.url, timeout=10, transport=transport) as writer,
            kvpool.connect(cluster.url, timeout=10, transport=transport) as reader,
        ):
            stock_claimed_grants(writer, keys[0], claimed=transport == "shm")
            commits = writer._putter.commits
            sent, by_node = commits.sent, commits.by_node.count
            for i in range(1, 5):
                assert writer.put(keys[i], payload(i))
            assert commits.sent == sent  # no COMMIT frame from the writer
            assert commits.by_node.count == by_node + 4
            # Read-your-writes: the writer's own read waits for the node's commit.
            out = np.empty(BLOCK, np.uint8)
            assert writer.get_into(keys[4], out) == BLOCK
            assert np.array_equal(out, payload(4))
            # Others: within a poll period and a round trip of the put (no flush).
            assert writer.put(keys[5], payload(5))
            began = time.monotonic()
            assert wait_until(lambda: reader.exists([keys[5]]) == [True], timeout=5, interval=0)
            assert time.monotonic() - began < 0.5 + IDLE_S
            for i in range(6):
                assert reader.get_into(keys[i], out) == BLOCK
                assert np.array_equal(out, payload(i))
            writer.flush()
            assert writer._putter.commits.idle()
    finally:
        cluster.stop()


def test_a_commit_the_node_could_not_make_is_settled_by_the_writer() -> None:
    """A NOT_COMMITTED answer in the record (written here over the node's own
    answer, once the node adopted and answered it): the writer's flush settles
    the put -- its commit retried (the master no longer knows that grant), the
    key looked up -- and nothing is raised or lost. (The node's side of the
    answer, a grant its master forgot, is the unit test above.)"""
    cluster = start_cluster(["16MiB"])
    try:
        keys = make_keys(3, seed=82)
        with kvpool.connect(cluster.url, timeout=10) as writer:
            stock_claimed_grants(writer, keys[0])
            watch = writer._putter.commits.by_node
            assert writer.put(keys[1], payload(1))
            (item, records), *_ = watch.watched
            assert wait_until(lambda: records.outcome(item.offset, item.alloc_id) == VISIBLE)
            word = records._word(item.offset)
            assert word is not None and records._words is not None
            records._words[word] = NOT_COMMITTED
            calls = writer._putter.commits.sent
            writer.flush()
            assert not watch.watched and writer._putter.commits.idle()
            assert writer._putter.commits.sent == calls  # settled by calls, not the pipe
            assert reads_back(cluster.url, keys[1], 1)
    finally:
        cluster.stop()


def test_a_put_whose_node_stalls_is_settled_by_the_writer_within_the_bound() -> None:
    """The node is stopped (SIGSTOP) right before a same-host put: the put is
    acknowledged on its seal record, the writer's flush waits ``ANSWER_S`` for the
    node's answer, then commits it itself; once the node runs again the block is
    read back by another client."""
    cluster = start_cluster(["16MiB"], "--node-ttl", "30")  # the stop must not drop the node
    try:
        keys = make_keys(2, seed=84)
        with kvpool.connect(cluster.url, timeout=10) as writer:
            stock_claimed_grants(writer, keys[0])
            node = cluster.nodes[0]
            os.kill(node.pid, signal.SIGSTOP)
            try:
                watched = writer._putter.commits.by_node.count
                assert writer.put(keys[1], payload(1))
                assert writer._putter.commits.by_node.count == watched + 1
                began = time.monotonic()
                writer.flush()
                took = time.monotonic() - began
            finally:
                os.kill(node.pid, signal.SIGCONT)
            assert node_watch.ANSWER_S - 0.1 <= took < node_watch.ANSWER_S + 5
            assert reads_back(cluster.url, keys[1], 1)
    finally:
        cluster.stop()


def wake_ups(pid: int, seconds: float) -> int:
    """Voluntary context switches of every thread of process ``pid`` over ``seconds``:
    how often it woke (each wake-up ends a sleep)."""

    def total() -> int:
        count = 0
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/status") as status:
                for line in status:
                    if line.startswith("voluntary_ctxt_switches:"):
                        count += int(line.split()[1])
        return count

    before = total()
    time.sleep(seconds)
    return total() - before


@pytest.mark.skipif(not shm_doorbell.AVAILABLE, reason="no futex doorbell: the node polls")
def test_a_node_idle_beside_a_same_host_client_sleeps_until_a_put_rings() -> None:
    """A same-host client holds its stock of grants claimed on the node (claims taken
    ahead stay open while it runs): the idle node's commit thread sleeps on the
    doorbell instead of polling it every ``IDLE_S`` (~500 wake-ups a second before),
    and the next put's ring still gets its block committed, read back by another
    client, within the bound."""
    cluster = start_cluster(["16MiB"])
    try:
        keys = make_keys(2, seed=85)
        with kvpool.connect(cluster.url, timeout=10, transport="shm") as writer:
            stock_claimed_grants(writer, keys[0])
            time.sleep(BUSY_S + QUIET_S + 0.2)  # past the busy and quiet spells
            woke = wake_ups(cluster.nodes[0].pid, 1.0)
            assert woke < 150, f"the idle node woke {woke} times in a second"
            with kvpool.connect(cluster.url, timeout=10) as reader:
                assert writer.put(keys[1], payload(1))
                began = time.monotonic()
                assert wait_until(lambda: reader.exists([keys[1]]) == [True], 5, interval=0)
                assert time.monotonic() - began < 0.5 + IDLE_S
            assert reads_back(cluster.url, keys[1], 1)
    finally:
        cluster.stop()

"""Nodes killed -9 under load, and the puts and reservations beside a dead node.

Real master and node processes, real client processes.

The master-failover storm (tests/test_ha.py) kills the leader; this one kills a
node, again and again, while two writers put two replicas of each block (one
over TCP, one through shared memory) and two readers check every byte they read
(one each way). One node is the victim: killed, replaced by a fresh node
process, killed again, so every block keeps a replica on a node that never died
and every acknowledged put must read back at the end (kvpool does not repair a
replica a dead node took with it: a block loses a copy with each node it had).
"""

from __future__ import annotations

import contextlib
import signal
import time
from pathlib import Path

import numpy as np
import pytest
from clusterhelpers import start_cluster, wait_until
from ha_client import BLOCK, key_of, payload
from storm import storm_clients

import kvpool


def biggest_node(pool: kvpool.RemotePool, count: int) -> str:
    """Once ``count`` nodes registered: the id of the one with the most capacity (the
    master places on it first; the tests below kill it)."""
    assert wait_until(lambda: len(pool.stats()["nodes"]) == count, 15)
    nodes = pool.stats()["nodes"]
    return max(nodes, key=lambda n: nodes[n]["capacity_bytes"])


def test_a_node_killed_again_and_again_under_load_loses_no_acknowledged_put() -> None:
    """30 s of load; the victim node is killed -9 every ~4 s (as many times as fit
    with 8 s to spare, at least 3) and a fresh node takes its place each time. No
    client raises, no read returns wrong bytes, each writer puts again within 5 s
    of each kill, and every acknowledged put reads back exactly at the end."""
    seconds = 30.0
    # room for every put: 2 writers x ~25/s x 30 s x 2 replicas x 64 KiB = ~190 MiB
    # on the two nodes that never die, so nothing is evicted
    cluster = start_cluster(["128MiB", "128MiB", "128MiB"])
    try:
        with kvpool.connect(cluster.url, timeout=5) as probe:
            assert wait_until(lambda: len(probe.stats()["nodes"]) == 3, 15)
            started = time.monotonic()
            kills: list[float] = []
            with storm_clients(cluster.url, seconds, "mixed") as storm:
                victim = cluster.nodes[0]
                while time.monotonic() + 4.0 < started + seconds - 8.0:
                    time.sleep(4.0)
                    kills.append(time.monotonic())
                    victim.kill()
                    victim = cluster.add_node("128MiB")
                storm.collect()
            assert len(kills) >= 3, kills
            storm.check(kills, each_writer=True)
            storm.check_read_back(probe)
    finally:
        cluster.stop()


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_puts_beside_a_dead_node_get_both_copies_on_live_ones(transport: str) -> None:
    """The master keeps a dead node until its heartbeats have been missing for the
    node TTL (30 s here), and it is the node with the most free space: every put
    would place a copy there. The first put whose copy fails there is put again
    whole, away from it; later puts ask the master to avoid it from the start.
    Each of 24 puts then has its two copies on the two live nodes, reads back
    exactly, and the client's stats name the node it avoids."""
    cluster = start_cluster(["64MiB", "32MiB", "32MiB"], "--node-ttl", "30")
    try:
        with kvpool.connect(cluster.url, timeout=5, transport=transport) as pool:
            dead = biggest_node(pool, 3)
            cluster.nodes[0].kill()  # the 64 MiB one
            keys = [key_of(transport == "tcp", i) for i in range(24)]
            for i, key in enumerate(keys):
                assert pool.put(key, payload(0, i), replicas=2)
            assert dead in pool.stats()["nodes"]  # the master has not dropped it yet
            placed = pool.locate(keys)
            assert all(len(set(p)) == 2 and dead not in p for p in placed), placed
            assert pool.stats()["client"]["avoided_nodes"] == [dead]
            writer = pool.reserve(key_of(2, 0), BLOCK)  # a reservation avoids it too
            assert writer is not None and dead not in writer.node_ids
            writer.abort()
            out = np.empty(BLOCK, np.uint8)
            for i, key in enumerate(keys):
                assert pool.get_into(key, out) == BLOCK and np.array_equal(out, payload(0, i))
    finally:
        cluster.stop()


def test_a_reservation_whose_node_died_sends_the_next_one_elsewhere() -> None:
    """A reserve lands on the dead node (the master still lists it, with the most
    room); the write fails with a connection error, nothing becomes visible, and the
    client avoids that node: the next reservation lands on the live one and commits."""
    cluster = start_cluster(["64MiB", "32MiB"], "--node-ttl", "30")
    try:
        with kvpool.connect(cluster.url, timeout=5, transport="tcp") as pool:
            dead = biggest_node(pool, 2)
            cluster.nodes[0].kill()  # the 64 MiB one
            key, data = key_of(3, 0), payload(3, 0)
            first = pool.reserve(key, BLOCK)
            assert first is not None and first.node_ids == [dead]
            with pytest.raises((ConnectionError, TimeoutError)):
                first.write(0, data)
            first.abort()
            assert pool.exists([key]) == [False]
            assert pool.stats()["client"]["avoided_nodes"] == [dead]
            again = pool.reserve(key, BLOCK)
            assert again is not None and dead not in again.node_ids
            with again:
                again.write(0, data)
            out = np.empty(BLOCK, np.uint8)
            assert pool.get_into(key, out) == BLOCK and np.array_equal(out, data)
    finally:
        cluster.stop()


def test_a_reader_tries_a_dead_nodes_replica_once() -> None:
    """Blocks with a copy on each of two nodes; the one the master lists first
    dies. A reader's first read fails there and falls back to the other copy;
    from then on it reads the live copy first (a dead host's connect can take the
    whole timeout), and every read is exact."""
    cluster = start_cluster(["64MiB", "32MiB"], "--node-ttl", "30")
    try:
        with kvpool.connect(cluster.url, timeout=5, transport="tcp") as pool:
            dead = biggest_node(pool, 2)
            keys = [key_of(4, i) for i in range(8)]
            datas = [payload(4, i) for i in range(8)]
            assert pool.put_batch(keys, datas, replicas=2) == [True] * 8
            assert all(p[0] == dead for p in pool.locate(keys))  # placed there first
        cluster.nodes[0].kill()
        with kvpool.connect(cluster.url, timeout=5, transport="tcp") as reader:
            out = np.empty(BLOCK, np.uint8)
            for key, data in zip(keys, datas, strict=True):
                assert reader.get_into(key, out) == BLOCK and np.array_equal(out, data)
            client = reader.stats()["client"]
            assert client["avoided_nodes"] == [dead] and client["read_node_failures"] == 1
    finally:
        cluster.stop()


def test_puts_a_dead_node_still_owed_are_lost_with_it_and_the_writer_goes_on() -> None:
    """Same-host single puts their node commits (sealed in shared memory on grants
    claimed ahead): the node is stopped, so it commits none of the next ten, then
    killed, and the master drops it. The writer's next read-side call asks whether
    that node still runs instead of waiting 2 s for its answers, and raises
    nothing (it used to raise ``PutCommitError`` for those puts, which an engine
    takes for the whole store failing): their only copy died with the node, as a
    visible block's does, and is counted. The other puts read back; puts go on.
    (A put that found no claimed grant goes the general way: its writer commits
    it, so it is visible at once and lost with the node as a visible block, not
    counted -- the count is the puts the dead node owed, each of them missing.)"""
    cluster = start_cluster(["64MiB", "64MiB"])
    try:
        with kvpool.connect(cluster.url, timeout=5) as pool:
            assert wait_until(lambda: len(pool.stats()["nodes"]) == 2, 15)
            # (a node's id is host-pid-nonce: kvpool.cluster.node)
            dead = next(n for n in pool.stats()["nodes"] if f"-{cluster.nodes[0].popen.pid}-" in n)
            for i in range(8):
                assert pool.put(key_of(5, i), payload(5, i))
            pool.flush()
            assert wait_until(lambda: pool._putter.grants.claimed_in_stock() >= 12, 10)
            cluster.nodes[0].signal_group(signal.SIGSTOP)
            # Stopped before the puts: a node thread that ran on for a moment committed a
            # put at the master but never wrote the answer in its seal record, so the
            # put looked owed while the master had made it visible (lost with the node
            # as a visible block, not counted: 4 counted of 5 "owed", CI of 6b4a90f).
            assert wait_until(lambda: all_threads_stopped(cluster.nodes[0].popen.pid), 5)
            keys = [key_of(5, i) for i in range(8, 18)]
            for i, key in enumerate(keys, start=8):
                assert pool.put(key, payload(5, i))
            watched = pool._putter.commits.by_node.watched
            owed = {item.key for item, _ in watched if item.node_id == dead}
            cluster.nodes[0].kill()
            with kvpool.connect(cluster.url, timeout=5) as other:  # the writer does not flush
                assert wait_until(lambda: len(other.stats()["nodes"]) == 1, 10)
            began = time.monotonic()
            present = pool.exists(keys)  # a read-side call: settles the puts owed
            assert time.monotonic() - began < 1.5
            missing = {key for key, there in zip(keys, present, strict=True) if not there}
            assert owed and owed <= missing
            assert pool.stats()["client"]["put_lost_with_node"] == len(owed)
            out = np.empty(BLOCK, np.uint8)
            for i, (key, there) in enumerate(zip(keys, present, strict=True), start=8):
                assert not there or (
                    pool.get_into(key, out) == BLOCK and np.array_equal(out, payload(5, i))
                )
            assert pool.put(key_of(5, 99), payload(5, 99))
    finally:
        cluster.stop()


def all_threads_stopped(pid: int) -> bool:
    """Whether every thread of ``pid`` is in the stopped state (a SIGSTOP landed)."""
    states = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(FileNotFoundError):  # a thread that just ended
            states.append((task / "stat").read_text().rsplit(")", 1)[1].split()[0])
    return all(state == "T" for state in states)


def test_reads_of_blocks_a_stopped_node_holds_miss_at_once_after_one_timeout() -> None:
    """Blocks with one copy each on two nodes; one node stops (SIGSTOP: its port
    still takes connections, nothing answers -- what a dead host looks like to a
    reader until the master drops it). The first read there waits out the
    transport timeout and misses; the reads after it skip that node and miss at
    once (one read a second tries it again), single and batched, while the other
    node's blocks read exactly. Once the node runs again, the next try succeeds and
    every block reads back."""
    cluster = start_cluster(["64MiB", "64MiB"], "--node-ttl", "60")
    try:
        with kvpool.connect(cluster.url, timeout=1, transport="tcp") as pool:
            assert wait_until(lambda: len(pool.stats()["nodes"]) == 2, 15)
            keys = [key_of(6, i) for i in range(24)]
            datas = [payload(6, i) for i in range(24)]
            assert pool.put_batch(keys, datas) == [True] * 24
            pool.flush()
            homes = [p[0] for p in pool.locate(keys)]
            stopped = homes[0]
            out = np.empty(BLOCK, np.uint8)
            assert all(pool.get_into(k, out) == BLOCK for k in keys)  # connections made
            on_stopped = [i for i, h in enumerate(homes) if h == stopped]
            elsewhere = [i for i, h in enumerate(homes) if h != stopped]
            assert len(on_stopped) >= 4 and len(elsewhere) >= 4
            # (a node's id is host-pid-nonce: kvpool.cluster.node)
            victim = next(n for n in cluster.nodes if f"-{n.popen.pid}-" in stopped)
            victim.signal_group(signal.SIGSTOP)
            try:
                assert wait_until(lambda: all_threads_stopped(victim.popen.pid), 5)
                began = time.monotonic()
                assert pool.get_into(keys[on_stopped[0]], out) is None  # waits the timeout
                first = time.monotonic() - began
                assert 0.8 <= first < 2.0
                began = time.monotonic()
                for i in on_stopped[1:]:
                    assert pool.get_into(keys[i], out) is None
                batch = pool.get_into_batch(keys, [np.empty(BLOCK, np.uint8) for _ in keys])
                assert time.monotonic() - began < 0.5  # skipped: no timeout paid
                assert [batch[i] for i in on_stopped] == [None] * len(on_stopped)
                for i in elsewhere:
                    assert pool.get_into(keys[i], out) == BLOCK
                    assert np.array_equal(out, datas[i])
                client = pool.stats()["client"]
                assert client["read_node_failures"] == 1
                assert client["read_node_skips"] >= 2 * len(on_stopped) - 1
            finally:
                victim.signal_group(signal.SIGCONT)
            time.sleep(1.1)  # the next try of that node is due
            for i, (key, data) in enumerate(zip(keys, datas, strict=True)):
                assert pool.get_into(key, out) == BLOCK, i
                assert np.array_equal(out, data)
            assert pool.stats()["client"]["avoided_nodes"] == []
    finally:
        cluster.stop()

"""The node commits blocks whose writer sealed them and never committed them
(kvpool.cluster.unconfirmed, kvpool.cluster.node_commits): the queue of unconfirmed
blocks, the table's hand-out, the master's keyed commit of any allocation, and real
processes -- a writer killed by SIGKILL after its puts returned, before its commits
left, whose blocks become visible to another client without any master restart."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator

import numpy as np
import pytest
from clusterhelpers import Cluster, start_cluster, wait_until
from poolhelpers import make_keys
from sealhelpers import K1, K2, PAGE, real, table
from test_catalog import catalog

import kvpool
from kvpool.cluster.block_entry import COMMITTED, WRITTEN, Entry
from kvpool.cluster.unconfirmed import Unconfirmed
from kvpool.transport.fencing import FENCE_OK
from kvpool.transport.shm_seal import SealRecords


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_unconfirmed_blocks_come_due_once_in_seal_order_and_only_while_written() -> None:
    clock = Clock()
    queue = Unconfirmed(clock)
    entries = {i * PAGE: Entry(real(i + 1, i * PAGE), WRITTEN) for i in range(4)}
    for entry in entries.values():
        queue.sealed(entry, entries)
        clock.now += 0.1
    assert queue.due(1.0, entries) == []  # none sealed a second ago yet
    clock.now = 100.0 + 1.15  # the first two are due
    entries[PAGE].state = COMMITTED  # ... but a commit event confirmed the second
    assert queue.due(1.0, entries) == [entries[0]]
    assert queue.due(1.0, entries) == []  # handed out once
    entries[2 * PAGE] = Entry(real(9, 2 * PAGE), WRITTEN)  # a newer block took the third's place
    clock.now += 10
    assert queue.due(1.0, entries) == [entries[3 * PAGE]] and len(queue) == 0


def test_a_seal_drops_the_confirmed_blocks_at_the_head_of_the_queue() -> None:
    """Where nobody asks for ``due``, the queue still does not grow with every seal:
    each new seal drops the head's confirmed or replaced blocks first."""
    queue = Unconfirmed(Clock())
    entries: dict[int, Entry] = {}
    for i in range(1000):
        entry = Entry(real(i + 1, (i % 8) * PAGE), WRITTEN)
        entries[entry.stamp.offset] = entry  # replaces the block sealed 8 seals ago
        queue.sealed(entry, entries)
        if i % 3 == 0:
            entry.state = COMMITTED  # its commit event came
    assert len(queue) <= 9


def test_the_table_hands_out_sealed_blocks_no_commit_event_confirmed(tmp_path) -> None:
    t = table(SealRecords(str(tmp_path / "seals"), 4 * PAGE, create=True))
    first, second = real(1, 0, key=K1), real(2, PAGE, key=K2)
    for stamp in (first, second):
        assert t.claim(stamp, "w") == FENCE_OK
        assert t.finish(stamp, "w", ok=True, seal=True) == FENCE_OK
    assert t.claim(real(3, 2 * PAGE), "w") == FENCE_OK  # claimed, never sealed: not owed
    t.committed(K1, 0, PAGE, first.parent, alloc_id=1)  # the first one's commit event
    assert [e.stamp for e in t.unconfirmed(0.0)] == [second]
    assert t.unconfirmed(0.0) == []


def test_a_sealed_block_freed_while_read_is_never_handed_out(tmp_path) -> None:
    """The master freed a sealed block (its allocation revoked) while a read of it
    was in flight: it stays until the read ends, but no one commits it meanwhile."""
    t = table(SealRecords(str(tmp_path / "seals"), 4 * PAGE, create=True))
    stamp = real(1, 0, key=K1)
    assert t.claim(stamp, "w") == FENCE_OK
    assert t.finish(stamp, "w", ok=True, seal=True) == FENCE_OK
    held = t.begin_read(K1, 0, 0, PAGE)
    assert held is not None
    t.freed(0, 1)
    assert t.unconfirmed(0.0) == []
    t.end_read(held)
    assert t.state_of(0) is None


def test_the_master_commits_an_allocation_made_with_its_key_when_a_node_names_it() -> None:
    cat, _ = catalog({"a": 4})
    key, other = make_keys(2)
    alloc = cat.allocate(key, PAGE, None)[0]
    assert cat.commit_grant(alloc.alloc_id, other, None) is None  # not its key
    assert cat.commit_grant(alloc.alloc_id, key, None) is True and cat.exists([key]) == [True]
    assert cat.commit_grant(alloc.alloc_id, key, None) is None  # committed already
    assert cat.commit(alloc.alloc_id) is None  # so the writer's own commit finds nothing


# --- real processes ---------------------------------------------------------------------

KILLED_AFTER_PUTS = """
import sys, time, numpy as np, kvpool
import kvpool.cluster.client.commits as commits
commits.LINGER_S = 60.0  # the commit thread waits: nothing this client commits leaves
keys = [bytes.fromhex(k) for k in sys.argv[3].split(",")]
pool = kvpool.connect(sys.argv[1], transport=sys.argv[2] or None, timeout=10)
for i, key in enumerate(keys):
    data = np.random.default_rng(7700 + i).integers(0, 256, 65536, dtype=np.uint8)
    assert pool.put(key, data)
print("put", flush=True)
time.sleep(600)  # until killed: no flush, no close, no exit hook
"""


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    c = start_cluster(["64MiB"])
    yield c
    c.stop()


@pytest.mark.parametrize(("transport", "node_commits"), [("tcp", "1"), ("shm", "0"), ("shm", "1")])
def test_puts_of_a_writer_killed_before_its_commits_become_visible(
    cluster: Cluster, transport: str, node_commits: str
) -> None:
    """The writer's puts returned (acknowledged), its commit thread never sent their
    commits, and SIGKILL ends it (no exit hook runs). Its node commits the blocks
    for it once no commit event came for a heartbeat and a half: another client then
    reads every one of them, exact. With the node's orphan commits taken out, all
    three cases failed: with node commits on (shm/1) too, since a new client's first
    puts, made before its grants were claimed, are committed by the client."""
    # its own keys per case, the same in every run (str hashes change per process)
    keys = make_keys(10, seed=770 + ["tcp1", "shm0", "shm1"].index(transport + node_commits))
    env = dict(os.environ, KVPOOL_NODE_COMMITS=node_commits)
    args = [sys.executable, "-c", KILLED_AFTER_PUTS, cluster.url, transport]
    child = subprocess.Popen(
        [*args, ",".join(k.hex() for k in keys)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert child.stdout is not None
        line = child.stdout.readline()
        assert line.strip() == "put", child.stderr.read()[-2000:] if child.stderr else ""
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(10)
    with kvpool.connect(cluster.url, timeout=10) as reader:
        assert wait_until(lambda: reader.exists(keys) == [True] * len(keys), timeout=15)
        out = np.empty(65536, np.uint8)
        for i, key in enumerate(keys):
            data = np.random.default_rng(7700 + i).integers(0, 256, 65536, dtype=np.uint8)
            assert reader.get_into(key, out) == 65536 and np.array_equal(out, data)
        for key in keys:
            reader.remove(key)

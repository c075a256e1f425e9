"""Heartbeat events name the allocation they are about (regression of a late-event race).

A block is committed and removed, and the same key is put again into the same
range, before the node hears the first block's events. The node must apply
the late ``commit`` and ``free`` of the old allocation to nothing: the new
block stays in its table (checked reads hit, it is re-registered after a
master crash). Before events carried the allocation id, the late commit
marked the new WRITTEN entry COMMITTED and the late free removed it.

Deterministic, at unit level: the real catalog and the real node table, the
events passing through their wire form (kvpool.cluster.master.nodes).
"""

from __future__ import annotations

from dataclasses import replace

from poolhelpers import make_keys

from kvpool.cluster.block_table import COMMITTED, WRITTEN, BlockTable
from kvpool.cluster.master.nodes import event_wire
from kvpool.cluster.wire import EVENT_COMMIT, EVENT_FREE
from kvpool.index.catalog import BlockCatalog, BlockCommitted, NodeEvent, RangeFreed
from kvpool.transport.fencing import FENCE_OK, WriteStamp

PAGE = 4096
EPOCH = 7


def apply(table: BlockTable, events: list[NodeEvent]) -> None:
    """What kvpool.cluster.node does with a heartbeat's events, in order."""
    for event in map(event_wire, events):
        if event[0] == EVENT_COMMIT:
            _, key, offset, size, parent, alloc_id = event
            table.committed(key, offset, size, parent, alloc_id)
        elif event[0] == EVENT_FREE:
            table.freed(event[1], event[2])


def put(cat: BlockCatalog, table: BlockTable, key: bytes, writer: str) -> WriteStamp:
    """Allocate on the master, write (claim + seal) on the node, commit on the master."""
    allocs = cat.allocate(key, PAGE, None)
    assert allocs is not None
    alloc = allocs[0]
    stamp = WriteStamp(EPOCH, alloc.alloc_id, alloc.offset, alloc.size, key)
    assert table.claim(stamp, writer) == FENCE_OK
    assert table.finish(stamp, writer, ok=True, seal=True) == FENCE_OK
    assert cat.commit(alloc.alloc_id) is not None
    return stamp


def setup() -> tuple[BlockCatalog, BlockTable]:
    cat = BlockCatalog()
    cat.add_node("n", PAGE, {"node_id": "n"})  # room for one block: a re-put reuses its range
    table = BlockTable(lambda offset, size: 1)
    table.new_term(EPOCH)
    return cat, table


def test_late_events_of_a_removed_block_leave_its_re_put_alone() -> None:
    cat, table = setup()
    key = make_keys(1)[0]
    for round_ in range(5):
        old = put(cat, table, key, f"w{round_}")
        assert cat.remove(key)
        new = put(cat, table, key, f"r{round_}")  # same key, same range, new allocation
        assert (new.offset, new.key) == (old.offset, old.key) and new.alloc_id != old.alloc_id
        events = cat.drain_events("n")
        assert events == [
            BlockCommitted(key, old.offset, PAGE, None, old.alloc_id),
            RangeFreed(old.offset, old.alloc_id),
            BlockCommitted(key, new.offset, PAGE, None, new.alloc_id),
        ]
        apply(table, events[:2])  # the old block's late commit, then its free
        assert table.state_of(new.offset) == WRITTEN  # untouched: still the new block
        held = table.begin_read(key, new.offset, new.offset, PAGE)
        assert held is not None and held.stamp.alloc_id == new.alloc_id  # a checked read hits
        table.end_read(held)
        apply(table, events[2:])
        assert table.state_of(new.offset) == COMMITTED
        # the new block is re-registered if the master crashes now
        assert [row[0] for row in table.listing()] == [key]
        assert cat.remove(key)
        apply(table, cat.drain_events("n"))  # the node catches up before the next round
        assert table.state_of(new.offset) is None


def test_without_allocation_ids_the_late_free_drops_the_new_block() -> None:
    """The same interleaving with ids unknown (0, as an older master sends): the
    range-only rule drops the new block. This is the bug the ids fix."""
    cat, table = setup()
    key = make_keys(1)[0]
    old = put(cat, table, key, "a")
    assert cat.remove(key)
    new = put(cat, table, key, "b")
    events = [replace(e, alloc_id=0) for e in cat.drain_events("n")]  # type: ignore[type-var]
    apply(table, events[:2])
    assert table.state_of(new.offset) is None and old.offset == new.offset


def test_an_event_of_an_older_term_allocation_with_the_same_id_is_not_applied() -> None:
    """Ids are unique within a term only: an entry written in an older term (and
    re-registered) is named 0 by the new master, never by an id of the new term."""
    table = BlockTable(lambda offset, size: 1)
    table.new_term(3)
    key = make_keys(1)[0]
    stamp = WriteStamp(3, 42, 0, PAGE, key)
    assert table.claim(stamp, "w") == FENCE_OK
    table.finish(stamp, "w", ok=True, seal=True)
    table.suspend()
    assert [row[0] for row in table.listing()] == [key]
    table.new_term(4)
    table.freed(0, 42)  # another block of term 4 that happened to get id 42
    assert table.state_of(0) == COMMITTED
    table.freed(0, 0)  # the new master frees the restored block (it knows no id)
    assert table.state_of(0) is None


def test_a_commit_that_overtakes_a_claimed_ahead_seal_commits_the_block() -> None:
    """A grant's claim is taken ahead under a placeholder key; the put seals and
    commits in parallel, and the commit event may reach the node first. The entry
    is the allocation's (same id): it takes the block's key and is committed, the
    late seal keeps it committed, and the block's free removes it (before, it
    stayed WRITTEN forever and came back at the next re-registration)."""
    table = BlockTable(lambda offset, size: 1)
    table.new_term(EPOCH)
    key = make_keys(1)[0]
    ahead = WriteStamp(EPOCH, 5, 0, PAGE, bytes(16))
    assert table.claim(ahead, "grants") == FENCE_OK
    assert table.committed(key, 0, PAGE, None, 5) is not None
    assert table.state_of(0) == COMMITTED
    held = table.begin_read(key, 0, 0, PAGE)
    assert held is not None
    table.end_read(held)
    sealed = WriteStamp(EPOCH, 5, 0, PAGE, key)
    assert table.finish(sealed, "grants", ok=True, seal=True, any_owner=True) == FENCE_OK
    assert table.state_of(0) == COMMITTED
    table.freed(0, 5)
    assert table.state_of(0) is None and table.listing() == []

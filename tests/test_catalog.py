"""BlockCatalog: placement, two-phase commit, leases, eviction, node loss (fake clock)."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from poolhelpers import make_keys

import kvpool.index.catalog.state as state_module
from kvpool.index.catalog import (
    Allocation,
    BlockCatalog,
    BlockCommitted,
    BlockMeta,
    CatalogFullError,
    RangeFreed,
    SsdCopyDropped,
)

PAGE = 4096


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def catalog(nodes: dict[str, int], **kw: float) -> tuple[BlockCatalog, Clock]:
    clock = Clock()
    cat = BlockCatalog(clock=clock, **kw)  # type: ignore[arg-type]
    for node_id, pages in nodes.items():
        cat.add_node(node_id, pages * PAGE, {"node_id": node_id})
    return cat, clock


def put(cat: BlockCatalog, key: bytes, size: int = PAGE, replicas: int = 1) -> list[str]:
    allocs = cat.allocate(key, size, None, replicas)
    assert allocs is not None
    for alloc in allocs:
        assert cat.commit(alloc.alloc_id) is not None
    return [a.node_id for a in allocs]


def test_placement_spreads_by_free_space() -> None:
    cat, _ = catalog({"a": 4, "b": 8})
    keys = make_keys(6)
    placed = [put(cat, k)[0] for k in keys]
    assert placed == ["b", "b", "b", "b", "a", "b"]  # ties go to the first registered


def test_avoided_nodes_take_a_block_only_when_no_other_node_can() -> None:
    """A writer saw node "c" fail (the master has not dropped it yet): the most free
    node, yet no replica and no grant goes there while another node has room. Once
    a and b hold nothing evictable, one replica goes to c: better than none."""
    cat, _ = catalog({"a": 3, "b": 4, "c": 8})
    keys = make_keys(3)
    assert put(cat, keys[0], replicas=2) == ["c", "b"]  # by free space: c first
    avoided = cat.allocate(keys[1], PAGE, None, 2, avoid={"c"})
    assert avoided is not None and [a.node_id for a in avoided] == ["a", "b"]  # 3 free, 3 free
    for alloc in avoided:
        cat.commit(alloc.alloc_id)
    cat.lease(keys[:2])  # not evictable: a grant takes free pages only
    grants = cat.grant(PAGE, 5, avoid={"c"})  # a: 2 pages free, b: 2
    assert sorted(g.node_id for g in grants) == ["a", "a", "b", "b"]  # fewer, none on c
    last = cat.allocate(keys[2], PAGE, None, 2, avoid={"c"})
    assert last is not None and [a.node_id for a in last] == ["c"]


def test_a_late_second_commit_of_a_committed_allocation_is_known(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A node commits a sealed block for its writer when no commit confirmed it in
    time; the writer's own commit, arriving later, finds no such allocation. The
    catalog remembers the last COMMITTED_MEMORY commits (id -> key) so the master
    can answer it "committed" -- even after the block was evicted."""
    monkeypatch.setattr(state_module, "COMMITTED_MEMORY", 2)
    cat, _ = catalog({"a": 2})
    k1, k2, k3 = make_keys(3)
    grant = cat.grant(PAGE, 1)[0]
    assert cat.commit_grant(grant.alloc_id, k1, None) is True
    assert cat.commit_grant(grant.alloc_id, k1, None) is None  # no such grant any more
    assert cat.committed_before(grant.alloc_id, k1)
    assert not cat.committed_before(grant.alloc_id, k2)  # committed, but for another key
    alloc = cat.allocate(k2, PAGE, None)
    assert alloc is not None and cat.commit(alloc[0].alloc_id) is not None
    put(cat, k3)  # evicts k1 (two pages): the memory keeps what was committed, not what is held
    assert cat.exists([k1]) == [False] and cat.committed_before(alloc[0].alloc_id)
    assert not cat.committed_before(grant.alloc_id)  # the oldest of three, forgotten
    assert not cat.committed_before(12345)


def test_allocation_is_invisible_until_commit_and_expires() -> None:
    cat, clock = catalog({"a": 2}, alloc_ttl=5)
    key = make_keys(1)[0]
    allocs = cat.allocate(key, PAGE, None)
    assert allocs is not None and cat.exists([key]) == [False]
    assert cat.allocate(key, PAGE, None) is None  # in flight: a second put is a no-op
    clock.now = 6
    assert cat.expire() == (1, 0)
    assert cat.commit(allocs[0].alloc_id) is None  # too late
    assert cat.nodes["a"].allocator.used_bytes == 0
    assert put(cat, key) == ["a"]


def test_revoke_frees_the_space() -> None:
    cat, _ = catalog({"a": 1})
    keys = make_keys(2)
    allocs = cat.allocate(keys[0], PAGE, None)
    assert allocs is not None
    cat.revoke(allocs[0].alloc_id)
    assert cat.exists(keys[:1]) == [False]
    put(cat, keys[1])


def test_eviction_is_lru_per_node_and_skips_leased_blocks() -> None:
    cat, _ = catalog({"a": 3})
    keys = make_keys(5)
    for key in keys[:3]:
        put(cat, key)
    lease_id, found = cat.lease([keys[0]])
    assert found[0] is not None
    put(cat, keys[3])  # 0 is leased -> evicts 1
    assert cat.exists(keys) == [True, False, True, True, False]
    cat.release(lease_id)
    put(cat, keys[4])  # 0 was touched by the lease after 2 -> evicts 2
    assert cat.exists(keys) == [True, False, False, True, True]
    assert cat.evictions == 2


def test_full_when_everything_is_leased() -> None:
    cat, _ = catalog({"a": 1})
    keys = make_keys(2)
    put(cat, keys[0])
    cat.lease([keys[0]])
    with pytest.raises(CatalogFullError):
        cat.allocate(keys[1], PAGE, None)
    assert cat.exists(keys) == [True, False]
    with pytest.raises(CatalogFullError):  # larger than any node
        cat.allocate(keys[1], 2 * PAGE, None)


def test_remove_of_a_leased_block_frees_after_release_or_expiry() -> None:
    cat, clock = catalog({"a": 2}, lease_ttl=10)
    keys = make_keys(2)
    put(cat, keys[0])
    lease_id, _ = cat.lease(keys[:1])
    assert cat.remove(keys[0])
    assert cat.exists(keys[:1]) == [False]
    assert cat.nodes["a"].allocator.used_bytes == PAGE  # still being read
    clock.now = 11
    cat.expire()
    assert cat.nodes["a"].allocator.used_bytes == 0
    cat.release(lease_id)  # late release is harmless
    assert cat.nodes["a"].allocator.used_bytes == 0


def test_lease_prefix_and_per_key() -> None:
    cat, _ = catalog({"a": 8})
    keys = make_keys(4)
    for key in (keys[0], keys[1], keys[3]):
        put(cat, key)
    _, found = cat.lease(keys)
    assert [b.key if b else None for b in found] == keys[:2]
    _, found = cat.lease(keys, prefix=False)
    assert [b is not None for b in found] == [True, True, False, True]
    assert cat.prefix_match(keys) == 2


def test_replicas_on_distinct_nodes_and_node_loss() -> None:
    cat, _ = catalog({"a": 4, "b": 4, "c": 4})
    keys = make_keys(2)
    assert sorted(put(cat, keys[0], replicas=2)) == ["a", "b"]
    put(cat, keys[1])  # lands on c (most free)
    assert cat.remove_node("a") == []
    assert cat.exists(keys) == [True, True]
    assert [r.node_id for r in cat.blocks[keys[0]].replicas] == ["b"]
    assert cat.remove_node("c") == [keys[1]]
    assert cat.exists(keys) == [True, False]


def test_node_events_and_restore_after_master_restart() -> None:
    cat, _ = catalog({"a": 4})
    keys = make_keys(3)
    for key in keys:
        put(cat, key)
    cat.remove(keys[1])
    events = cat.drain_events("a")
    assert [type(e) for e in events] == [BlockCommitted] * 3 + [RangeFreed]
    assert cat.drain_events("a") == [] and cat.drain_events("nobody") == []  # handed out once
    held = {e.offset: e for e in events if isinstance(e, BlockCommitted)}
    assert len({e.alloc_id for e in held.values()}) == 3 and all(e.alloc_id for e in held.values())
    for event in events:
        if isinstance(event, RangeFreed):
            assert event.alloc_id == held[event.offset].alloc_id  # names the block it frees
            del held[event.offset]
    # A fresh master learns the node's blocks back from the node.
    fresh, _ = catalog({"a": 4})
    restored = [(e.key, e.offset, e.size, 123, e.parent, True) for e in held.values()]
    overlapping = next(iter(held))
    restored.append((make_keys(9, seed=5)[0], overlapping, PAGE, None, None, True))
    restored.append((keys[0], 3 * PAGE, PAGE, None, None, False))  # a second block of one key
    assert fresh.restore_blocks("a", restored) == [overlapping, 3 * PAGE]
    fresh.nodes["a"].allocator.check()
    assert fresh.nodes["a"].allocator.used_bytes == 2 * PAGE and len(fresh.nodes["a"].policy) == 2
    assert fresh.exists(keys) == [True, False, True]
    assert fresh.blocks[keys[0]].checksum == 123
    assert fresh.drain_events("a") == []
    # Restored replicas name no allocation of this term: their events say 0 (unknown).
    first = fresh.blocks[keys[0]].replicas[0]
    assert first.alloc_id == 0
    assert fresh.remove(keys[0])
    assert fresh.drain_events("a") == [RangeFreed(first.offset, 0)]


def test_ids_of_a_restarted_master_never_collide_with_the_old_ones() -> None:
    old, _ = catalog({"a": 4})
    new, _ = catalog({"a": 4})
    key = make_keys(1)[0]
    stale = old.allocate(key, PAGE, None)
    fresh = new.allocate(key, PAGE, None)
    assert stale is not None and fresh is not None
    assert stale[0].alloc_id != fresh[0].alloc_id and fresh[0].alloc_id > 0
    assert new.commit(stale[0].alloc_id) is None  # an old client's commit finds nothing
    assert new.exists([key]) == [False] and len(new.pending) == 1


def test_a_grant_holds_space_invisibly_until_bound_to_a_key() -> None:
    cat, _ = catalog({"a": 4, "b": 8})
    grants = cat.grant(PAGE, 3)
    assert [g.node_id for g in grants] == ["b", "b", "b"]  # spread by free space
    assert all(g.key is None for g in grants) and cat.granted_bytes == 3 * PAGE
    assert cat.nodes["b"].allocator.used_bytes == 3 * PAGE and not cat.blocks
    key, parent = make_keys(2)
    assert cat.commit(grants[0].alloc_id) is None  # a grant needs its key
    assert cat.commit_grant(grants[0].alloc_id, key, parent) is True
    assert cat.exists([key]) == [True] and cat.blocks[key].parent == parent
    assert cat.blocks[key].replicas[0].offset == grants[0].offset
    assert cat.granted_bytes == 2 * PAGE
    assert cat.drain_events("b")[-1] == BlockCommitted(
        key, grants[0].offset, PAGE, parent, grants[0].alloc_id
    )
    assert cat.commit_grant(grants[0].alloc_id, key, None) is None  # used up


def test_binding_a_stored_key_frees_the_grant() -> None:
    cat, _ = catalog({"a": 4})
    key = make_keys(1)[0]
    put(cat, key)
    grant = cat.grant(PAGE, 1)[0]
    assert cat.commit_grant(grant.alloc_id, key, None) is False
    assert cat.nodes["a"].allocator.used_bytes == PAGE and cat.granted_bytes == 0
    allocs = cat.allocate(make_keys(2)[1], PAGE, None)
    assert allocs is not None
    assert cat.commit_grant(allocs[0].alloc_id, key, None) is None  # not a grant of key


def test_a_grant_committed_first_supersedes_the_puts_of_its_key_in_flight() -> None:
    """First commit wins: a grant's put (its writer already told it succeeded) is not
    dropped for a put of the same key still in flight, which may yet fail. The
    superseded allocations keep their ranges until their commit (which frees them and
    answers None) or expiry, and no longer hold the key in flight."""
    cat, clock = catalog({"a": 8}, alloc_ttl=30, grant_ttl=5)
    key, other = make_keys(2)
    first = cat.allocate(key, PAGE, None)
    second = cat.allocate(key, PAGE, None)
    assert second is None  # the key is in flight: a put by allocation defers to it
    other_put = cat.allocate(other, PAGE, None)
    assert first is not None and other_put is not None
    grant = cat.grant(PAGE, 1)[0]
    assert cat.commit_grant(grant.alloc_id, key, None) is True
    assert cat.blocks[key].replicas[0].offset == grant.offset
    assert key not in cat.keys_in_flight and cat.nodes["a"].allocator.used_bytes == 3 * PAGE
    cat.drain_events("a")
    assert cat.commit(first[0].alloc_id) is None  # superseded: freed, never a replica
    assert cat.drain_events("a") == [RangeFreed(first[0].offset, first[0].alloc_id)]
    assert [r.offset for r in cat.blocks[key].replicas] == [grant.offset]
    assert cat.nodes["a"].allocator.used_bytes == 2 * PAGE
    # a superseded allocation that is never committed expires like any other
    late = cat.grant(PAGE, 1)[0]
    assert cat.commit_grant(late.alloc_id, other, None) is True
    clock.now = 31
    assert cat.expire() == (1, 0)
    assert cat.nodes["a"].allocator.used_bytes == 2 * PAGE and not cat.keys_in_flight
    cat.nodes["a"].allocator.check()


def test_grants_expire_sooner_than_allocations_and_leave_with_their_node() -> None:
    cat, clock = catalog({"a": 4, "b": 4}, alloc_ttl=30, grant_ttl=5)
    grants = cat.grant(PAGE, 2)
    key = make_keys(1)[0]
    assert cat.allocate(key, PAGE, None) is not None
    clock.now = 6
    assert cat.expire() == (2, 0)  # the grants, not the allocation
    assert cat.commit_grant(grants[0].alloc_id, key, None) is None
    assert cat.granted_bytes == 0 and len(cat.pending) == 1
    more = cat.grant(PAGE, 2)
    assert {g.node_id for g in more} == {"a", "b"}
    cat.remove_node("a")
    assert cat.granted_bytes == PAGE


def test_grants_evict_like_puts_and_stop_when_nothing_is_evictable() -> None:
    cat, _ = catalog({"a": 2})
    keys = make_keys(2)
    for key in keys:
        put(cat, key)
    lease_id, _ = cat.lease(keys[1:])
    assert len(cat.grant(PAGE, 3)) == 1  # evicts keys[0]; keys[1] is leased
    assert cat.exists(keys) == [False, True] and cat.evictions == 1
    cat.release(lease_id)


def removed_but_leased(cat: BlockCatalog) -> list[BlockMeta]:
    """Removed blocks some lease still holds, each once however many leases hold it:
    their extents stay allocated until the last of those leases ends."""
    held = {id(b): b for rec in cat.leases.values() for b in rec.blocks if b.removed}
    return list(held.values())


def test_a_removed_block_leased_twice_is_freed_once_by_its_last_lease() -> None:
    """Regression (hypothesis once found it): put, lease twice, remove. The bytes stay
    allocated once (not once per lease) until the last lease ends, then are freed once."""
    cat, _ = catalog({"a": 4})
    key = make_keys(1)[0]
    put(cat, key)
    first, _ = cat.lease([key])
    second, _ = cat.lease([key])
    assert cat.remove(key) and cat.exists([key]) == [False]
    assert removed_but_leased(cat) and cat.nodes["a"].allocator.used_bytes == PAGE
    cat.release(first)
    assert cat.nodes["a"].allocator.used_bytes == PAGE  # the second reader still copies
    cat.release(second)
    assert cat.nodes["a"].allocator.used_bytes == 0 and not removed_but_leased(cat)
    cat.nodes["a"].allocator.check()
    assert [type(e) for e in cat.drain_events("a")] == [BlockCommitted, RangeFreed]


def test_a_node_restart_takes_its_hidden_leased_ranges_with_it() -> None:
    """A node re-registering under the same id starts empty: a lease on a removed block
    that ends later must not free a range of the new, empty node."""
    cat, _ = catalog({"a": 4})
    key = make_keys(1)[0]
    put(cat, key)
    lease_id, _ = cat.lease([key])
    cat.remove(key)
    cat.add_node("a", 4 * PAGE, {"node_id": "a"})  # restarted
    put(cat, make_keys(2)[1])  # reuses offset 0
    cat.release(lease_id)
    assert cat.nodes["a"].allocator.used_bytes == PAGE
    cat.nodes["a"].allocator.check()


class CatalogMachine(RuleBasedStateMachine):
    """Random puts, leases, releases, removes and node loss keep space accounting exact."""

    def __init__(self) -> None:
        super().__init__()
        self.cat, self.clock = catalog({"a": 6, "b": 4})
        self.keys = make_keys(12)
        self.leases: list[int] = []
        self.grants: list[int] = []
        self.in_flight: list[int] = []
        self.put_of: dict[int, int] = {}  # allocation id -> the put (or grant) it serves

    @rule(pages=st.integers(1, 2), count=st.integers(1, 3))
    def grant(self, pages: int, count: int) -> None:
        for g in self.cat.grant(pages * PAGE, count):
            self.grants.append(g.alloc_id)
            self.put_of[g.alloc_id] = len(self.put_of)

    @precondition(lambda self: self.grants)
    @rule(i=st.integers(0, 11))
    def bind_grant(self, i: int) -> None:
        self.cat.commit_grant(self.grants.pop(0), self.keys[i], None)

    def _allocate(self, i: int, pages: int, replicas: int) -> list[Allocation]:
        """A put's allocations, recorded as one put (none: stored, in flight, or full)."""
        try:
            allocs = self.cat.allocate(self.keys[i], pages * PAGE, None, replicas) or []
        except CatalogFullError:
            return []
        put = -len(self.put_of) - 1  # one id for the put's replicas
        self.put_of.update((a.alloc_id, put) for a in allocs)
        return allocs

    @rule(i=st.integers(0, 11), pages=st.integers(1, 3), replicas=st.integers(1, 2))
    def put(self, i: int, pages: int, replicas: int) -> None:
        for alloc in self._allocate(i, pages, replicas):
            self.cat.commit(alloc.alloc_id)

    @rule(i=st.integers(0, 11), pages=st.integers(1, 3), replicas=st.integers(1, 2))
    def begin_put(self, i: int, pages: int, replicas: int) -> None:
        """A put whose commit comes later (a grant may bind its key meanwhile)."""
        self.in_flight += [a.alloc_id for a in self._allocate(i, pages, replicas)]

    @precondition(lambda self: self.grants and self.in_flight)
    @rule()
    def bind_grant_to_a_key_in_flight(self) -> None:
        """Another writer's put of a key being put: the race ``supersede`` settles."""
        pending = self.cat.pending.get(self.in_flight[0])  # the next one finish_put commits
        if pending is not None and pending.key is not None:
            self.cat.commit_grant(self.grants.pop(0), pending.key, None)

    @precondition(lambda self: self.in_flight)
    @rule()
    def finish_put(self) -> None:
        self.cat.commit(self.in_flight.pop(0))

    @rule(i=st.integers(0, 11))
    def lease(self, i: int) -> None:
        lease_id, _ = self.cat.lease(self.keys[i : i + 2])
        if lease_id:
            self.leases.append(lease_id)

    @precondition(lambda self: self.leases)
    @rule()
    def release(self) -> None:
        self.cat.release(self.leases.pop(0))

    @rule(i=st.integers(0, 11), reads=st.integers(1, 12))
    def hot_reads(self, i: int, reads: int) -> None:
        found: list = []
        for _ in range(reads):
            lease_id, found = self.cat.lease(self.keys[i : i + 1])
            self.cat.release(lease_id)
        for alloc in self.cat.replication.hot_replicas(found):
            self.cat.commit(alloc.alloc_id)

    @rule()
    def cool(self) -> None:
        self.clock.now += 100
        self.cat.replication.cool_down()

    @rule(i=st.integers(0, 11))
    def remove(self, i: int) -> None:
        self.cat.remove(self.keys[i])

    @rule(node=st.sampled_from(["a", "b"]))
    def node_restarts(self, node: str) -> None:
        self.cat.add_node(node, {"a": 6, "b": 4}[node] * PAGE, {"node_id": node})

    @rule()
    def time_passes(self) -> None:
        self.clock.now += 40
        self.cat.expire()

    @invariant()
    def accounting(self) -> None:
        for node in self.cat.nodes.values():
            node.allocator.check()
            live = sum(
                r.size if r.size % PAGE == 0 else -(-r.size // PAGE) * PAGE
                for b in self.cat.blocks.values()
                for r in b.replicas
                if r.node_id == node.node_id
            )
            hidden = sum(
                -(-r.size // PAGE) * PAGE
                for b in removed_but_leased(self.cat)
                for r in b.replicas
                if r.node_id == node.node_id
            )
            pending = sum(
                -(-a.size // PAGE) * PAGE
                for a in self.cat.pending.values()
                if a.node_id == node.node_id
            )
            assert node.allocator.used_bytes == live + hidden + pending
            mine = [
                r for b in self.cat.blocks.values() for r in b.replicas if r.node_id == node.node_id
            ]
            assert len(node.policy) == sum(r.primary for r in mine)
            assert len(node.extras) == sum(not r.primary for r in mine)
        for block in self.cat.blocks.values():
            assert len({r.node_id for r in block.replicas}) == len(block.replicas)
            puts = {self.put_of[r.alloc_id] for r in block.replicas if r.alloc_id in self.put_of}
            assert len(puts) <= 1  # every replica holds the bytes of the one put committed
        keyed = Counter(
            a.key for a in self.cat.pending.values() if a.key is not None and not a.superseded
        )
        assert self.cat.keys_in_flight == dict(keyed)
        grants = [a for a in self.cat.pending.values() if a.key is None]
        assert self.cat.granted_bytes == sum(a.size for a in grants)


TestCatalogMachine = CatalogMachine.TestCase
TestCatalogMachine.settings = settings(max_examples=40, stateful_step_count=30, deadline=None)


def hot(cat: BlockCatalog, key: bytes, reads: int) -> list:
    orders = []
    for _ in range(reads):
        lease_id, found = cat.lease([key])
        orders += cat.replication.hot_replicas(found)
        cat.release(lease_id)
    return orders


def test_a_hot_block_gains_replicas_then_cools_down() -> None:
    cat, clock = catalog({"a": 8, "b": 8, "c": 8})
    key = make_keys(1)[0]
    put(cat, key)
    assert hot(cat, key, 7) == []  # heat 7 < 8
    orders = hot(cat, key, 1)
    assert len(orders) == 1 and orders[0].extra
    assert hot(cat, key, 3) == []  # one replica in flight at a time
    cat.commit(orders[0].alloc_id)
    assert len(cat.blocks[key].replicas) == 2
    for alloc in hot(cat, key, 1):
        cat.commit(alloc.alloc_id)
    assert len(cat.blocks[key].replicas) == 3
    assert hot(cat, key, 5) == []  # capped by max_replicas (3)
    clock.now += 60  # heat halves every 10 s: ~16 reads -> < 1
    assert cat.replication.cool_down() == 2
    assert [r.primary for r in cat.blocks[key].replicas] == [True]
    assert sum(n.allocator.used_bytes for n in cat.nodes.values()) == PAGE


def test_extras_are_evicted_before_primaries() -> None:
    cat, _ = catalog({"a": 2, "b": 2})
    keys = make_keys(4)
    put(cat, keys[0])  # a
    put(cat, keys[1])  # b
    extra = cat.replication.allocate_replica(keys[0], "b")
    assert extra is not None and cat.commit(extra.alloc_id)
    put(cat, keys[2])  # a (a: 1 free, b: full)
    put(cat, keys[3])  # both full: b has an extra to drop, so b makes room
    assert cat.exists(keys) == [True, True, True, True]
    assert [r.node_id for r in cat.blocks[keys[0]].replicas] == ["a"]


def test_the_extra_replica_survives_its_primarys_node() -> None:
    cat, _ = catalog({"a": 2, "b": 2})
    key = make_keys(1)[0]
    assert put(cat, key) == ["a"]
    alloc = cat.replication.allocate_replica(key, "b")
    assert alloc is not None and alloc.node_id == "b"
    cat.commit(alloc.alloc_id)
    assert cat.remove_node("a") == []
    (replica,) = cat.blocks[key].replicas
    assert replica.node_id == "b" and replica.primary
    assert len(cat.nodes["b"].policy) == 1 and len(cat.nodes["b"].extras) == 0


def test_explicit_replica_lands_on_the_chosen_node() -> None:
    cat, _ = catalog({"a": 4, "b": 4, "c": 4})
    key = make_keys(1)[0]
    put(cat, key)  # a
    assert cat.replication.allocate_replica(key, "a") is None  # already there
    alloc = cat.replication.allocate_replica(key, "c")
    assert alloc is not None and alloc.node_id == "c"
    cat.commit(alloc.alloc_id)
    assert sorted(r.node_id for r in cat.blocks[key].replicas) == ["a", "c"]


def test_reads_go_to_the_least_loaded_replica() -> None:
    cat, _ = catalog({"a": 4, "b": 4})
    key = make_keys(1)[0]
    put(cat, key)
    alloc = cat.replication.allocate_replica(key, "b")
    assert alloc is not None
    cat.commit(alloc.alloc_id)
    first = []
    for _ in range(6):
        lease_id, found = cat.lease([key])
        first.append(found[0].replicas[0].node_id)  # type: ignore[union-attr]
        cat.release(lease_id)
    assert first.count("a") == 3 and first.count("b") == 3


def test_ssd_copies_turn_evictions_into_demotions() -> None:
    clock = Clock()
    cat = BlockCatalog(clock=clock)
    cat.add_node("a", 2 * PAGE, {}, has_ssd=True)
    keys = make_keys(4)
    put(cat, keys[0])
    put(cat, keys[1])
    picked = cat.ssd_tier.pick_for_ssd("a", PAGE)  # the oldest DRAM-only block
    assert [b.key for b in picked] == [keys[0]]
    assert cat.ssd_tier.dram_offset(picked[0], "a") == 0
    cat.ssd_tier.ssd_stored("a", picked, [keys[0]], [])
    put(cat, keys[2])  # evicts 0: it has an SSD copy, so it stays as an SSD-only replica
    assert cat.exists(keys) == [True, True, True, False]
    block = cat.blocks[keys[0]]
    assert cat.ssd_tier.ssd_only(block)
    put(cat, keys[3])  # evicts 1: no SSD copy, dropped
    assert cat.exists(keys) == [True, False, True, True]
    assert cat.locate(keys[:1]) == [["a"]]
    # A read promotes it back into DRAM first.
    lease_id, found = cat.lease(keys[:1])
    assert found[0] is block
    alloc = cat.ssd_tier.reserve_promotion(block)
    assert alloc is not None  # evicted 2 to make room
    cat.ssd_tier.finish_promotion(block, alloc, ok=True)
    assert not cat.ssd_tier.ssd_only(block) and cat.ssd_tier.dram_offset(block, "a") == alloc.offset
    assert cat.drain_events("a")[-1] == BlockCommitted(
        keys[0], alloc.offset, PAGE, None, alloc.alloc_id
    )
    cat.release(lease_id)
    cat.nodes["a"].allocator.check()


@pytest.mark.parametrize("meanwhile", ["removed", "promoted by another read"])
def test_a_load_the_catalog_no_longer_wants_is_freed_on_the_node(meanwhile: str) -> None:
    """The node loaded the block, but while it did the block was removed or another
    read promoted it first: the range goes back to the allocator and the node hears
    a free naming that load's allocation (else its table kept the loaded block)."""
    cat = BlockCatalog(clock=Clock())
    cat.add_node("a", 2 * PAGE, {}, has_ssd=True)
    key, *others = make_keys(3)
    put(cat, key)
    cat.ssd_tier.ssd_stored("a", cat.ssd_tier.pick_for_ssd("a", PAGE), [key], [])
    for other in others:  # the second evicts ``key``: SSD-only now
        put(cat, other)
    assert all(cat.remove(other) for other in others)  # DRAM empty: room for two loads
    block = cat.blocks[key]
    assert cat.ssd_tier.ssd_only(block)
    cat.drain_events("a")
    lease_id, _ = cat.lease([key])
    first = cat.ssd_tier.reserve_promotion(block)
    second = cat.ssd_tier.reserve_promotion(block)
    assert first is not None and second is not None
    if meanwhile == "removed":
        assert cat.remove(key)
        cat.ssd_tier.finish_promotion(block, first, ok=True)
        assert cat.drain_events("a")[-1] == RangeFreed(first.offset, first.alloc_id)
    else:
        cat.ssd_tier.finish_promotion(block, first, ok=True)
        assert cat.drain_events("a")[-1] == BlockCommitted(
            key, first.offset, PAGE, None, first.alloc_id
        )
    cat.ssd_tier.finish_promotion(block, second, ok=True)
    assert cat.drain_events("a")[-1] == RangeFreed(second.offset, second.alloc_id)
    cat.release(lease_id)
    cat.nodes["a"].allocator.check()
    assert cat.nodes["a"].allocator.used_bytes == (0 if meanwhile == "removed" else PAGE)


def test_ssd_loss_and_remove() -> None:
    cat = BlockCatalog(clock=Clock())
    cat.add_node("a", PAGE, {}, has_ssd=True)
    keys = make_keys(3)
    put(cat, keys[0])
    cat.ssd_tier.ssd_stored("a", cat.ssd_tier.pick_for_ssd("a", PAGE), [keys[0]], [])
    put(cat, keys[1])  # 0 -> SSD-only
    lease_id, found = cat.lease(keys[:1])
    alloc = cat.ssd_tier.reserve_promotion(found[0])  # type: ignore[arg-type]
    assert alloc is not None
    cat.ssd_tier.finish_promotion(found[0], alloc, ok=False)  # type: ignore[arg-type]  # bad checksum
    cat.release(lease_id)
    # Making room for the promotion dropped 1 (no SSD copy), and 0 failed its load.
    assert cat.exists(keys[:2]) == [False, False]
    assert cat.nodes["a"].allocator.used_bytes == 0
    put(cat, keys[1])
    cat.ssd_tier.ssd_stored("a", cat.ssd_tier.pick_for_ssd("a", PAGE), [keys[1]], [])
    put(cat, keys[2])  # 1 -> SSD-only
    cat.ssd_tier.ssd_stored("a", [], [], [keys[1]])  # the node's SSD evicted it
    assert cat.exists(keys) == [False, False, True]
    cat.ssd_tier.ssd_stored("a", cat.ssd_tier.pick_for_ssd("a", PAGE), [keys[2]], [])
    filled_by = cat.blocks[keys[2]].replicas[0].alloc_id
    assert filled_by > 0
    assert cat.remove(keys[2])
    assert cat.drain_events("a")[-2:] == [SsdCopyDropped(keys[2]), RangeFreed(0, filled_by)]


def test_restored_blocks_keep_one_put_per_key_whatever_order_nodes_register_in() -> None:
    """A put that lost the race for its key left a whole, never confirmed block on
    its node (``supersede``); the winner's is confirmed. After a master restart the
    new master keeps the winner's whichever node registers first, refuses a second
    block of a key on one node, keeps confirmed replicas of one block on two nodes,
    and an unconfirmed block alone (an acknowledged put whose commit never arrived)."""
    winner, replicated, alone = make_keys(3)
    for first in ("a", "b"):
        cat, _ = catalog({"a": 8, "b": 8})
        reports = {
            "a": [(winner, 0, PAGE, 1, None, True), (replicated, PAGE, PAGE, 3, None, True)],
            "b": [
                (winner, 0, PAGE, 2, None, False),  # the loser's bytes under the winner's key
                (replicated, PAGE, PAGE, 3, None, True),
                (alone, 2 * PAGE, PAGE, 4, None, False),
                (alone, 3 * PAGE, PAGE, 5, None, False),  # a second block of one key
            ],
        }
        second = "b" if first == "a" else "a"
        refused = {n: cat.restore_blocks(n, reports[n]) for n in (first, second)}
        assert refused["a"] == []
        assert refused["b"] == ([0, 3 * PAGE] if first == "a" else [3 * PAGE])
        assert [(r.node_id, r.offset) for r in cat.blocks[winner].replicas] == [("a", 0)]
        assert cat.blocks[winner].checksum == 1
        assert {r.node_id for r in cat.blocks[replicated].replicas} == {"a", "b"}
        assert [(r.node_id, r.offset) for r in cat.blocks[alone].replicas] == [("b", 2 * PAGE)]
        # the loser's range on b is free again, and b is told so when it was restored
        assert cat.nodes["b"].allocator.used_bytes == 2 * PAGE
        freed = [e for e in cat.drain_events("b") if isinstance(e, RangeFreed)]
        assert freed == ([RangeFreed(0, 0)] if first == "b" else [])
        for node in cat.nodes.values():
            node.allocator.check()
            assert len(node.policy) == sum(
                r.node_id == node.node_id for b in cat.blocks.values() for r in b.replicas
            )


def test_restore_ssd_blocks_after_a_master_restart() -> None:
    cat = BlockCatalog(clock=Clock())
    cat.add_node("a", 2 * PAGE, {}, has_ssd=True)
    keys = make_keys(3)
    assert cat.restore_blocks("a", [(keys[0], 0, PAGE, 1, None, True)]) == []
    assert cat.ssd_tier.restore("a", [(keys[0], PAGE, None), (keys[1], PAGE, keys[0])]) == 2
    assert cat.exists(keys) == [True, True, False]
    assert not cat.ssd_tier.ssd_only(cat.blocks[keys[0]]) and cat.ssd_tier.ssd_only(
        cat.blocks[keys[1]]
    )
    assert cat.ssd_tier.pick_for_ssd("a", 10 * PAGE) == []  # 0 already has its SSD copy

"""The client's lease cache: hold time, pins, byte bound, and what it means live."""

from __future__ import annotations

import time

import numpy as np
from clusterhelpers import start_cluster, wait_until
from poolhelpers import BLOCK, make_keys, payload

import kvpool
from kvpool.cluster.client.lease_cache import LeaseCache


def test_hold_time_pins_and_byte_bound() -> None:
    cache = LeaseCache(hold_s=0.05, max_bytes=300)
    a, b, c = make_keys(3)
    first = cache.add(1, [(a, "pa", 100), (b, "pb", 100)], ttl=30, pins=0)
    pinned = cache.add(2, [(c, "pc", 100)], ttl=30, pins=1)
    assert cache.lookup(a) == ("pa", 100, first)
    assert cache.due() == []  # nothing expired, 300 bytes is within the bound
    cache.add(3, [(a, "pa2", 100)], ttl=30, pins=0)  # 400 bytes: over
    assert [d.lease_id for d in cache.due()] == [1]  # oldest unpinned first
    assert cache.lookup(a)[0] == "pa2"  # type: ignore[index]  # the newer lease serves it
    assert cache.lookup(b) is None
    time.sleep(0.06)
    assert cache.lookup(a) is None  # past its hold time
    assert cache.lookup(c) is not None  # pinned: held until unpinned
    assert [d.lease_id for d in cache.due()] == [3]
    cache.unpin(pinned)
    (done,) = cache.due()
    assert done.lease_id == 2 and done.reads[c] == 1


def test_pin_many_then_unpin_all_leaves_every_lease_as_it_was() -> None:
    """A batch pins each distinct key's lease once (a lease holding two of its keys
    twice) and ``unpin_all`` of what it returned unpins exactly as often."""
    cache = LeaseCache(hold_s=10)
    a, b, c = make_keys(3)
    two = cache.add(1, [(a, "pa", 10), (b, "pb", 10)], ttl=30, pins=0)
    one = cache.add(2, [(c, "pc", 10)], ttl=30, pins=1)
    found = cache.pin_many([a, b, a, c])
    assert list(found) == [a, b, c] and (two.pins, one.pins) == (2, 2)
    cache.unpin_all([lease for _, _, lease in found.values()])
    assert (two.pins, one.pins) == (0, 1)
    assert [d.lease_id for d in cache.due(unpinned=True)] == [1]


def test_pin_all_pins_each_position_or_nothing_and_unpin_read_counts_each() -> None:
    """``pin_all``: every key cached -> their entries in order, each position's lease
    pinned (a key twice: twice), no read counted yet; ``unpin_read`` undoes exactly
    that and counts one read per position. A key not cached, or a lease past its
    hold: None, and no lease left pinned."""
    cache = LeaseCache(hold_s=0.05)
    a, b, c = make_keys(3)
    two = cache.add(1, [(a, "pa", 10), (b, "pb", 10)], ttl=30, pins=0)
    hits = cache.pin_all([a, b, a])
    assert hits is not None and [h[0] for h in hits] == ["pa", "pb", "pa"]
    assert two.pins == 3 and two.reads == {}
    cache.unpin_read([a, b, a], hits)
    assert two.pins == 0 and two.reads == {a: 2, b: 1}
    assert cache.pin_all([a, c, b]) is None and two.pins == 0  # c is not cached
    held = cache.add(2, [(c, "pc", 10)], ttl=30, pins=1)
    time.sleep(0.06)  # lease 1 is past its hold (unpinned); lease 2 is pinned: still held
    assert cache.pin_all([c, a]) is None and held.pins == 1
    hits = cache.pin_all([c])
    assert hits is not None and held.pins == 2
    cache.unpin_all([lease for _, _, lease in hits])  # a batch that read nothing
    assert held.pins == 1 and held.reads == {}


def test_forget_and_release_all_unpinned() -> None:
    cache = LeaseCache(hold_s=10)
    a, b = make_keys(2)
    cache.add(1, [(a, "pa", 10)], ttl=30, pins=0)
    cache.add(2, [(b, "pb", 10)], ttl=30, pins=1)
    (forgotten,) = cache.forget(a)  # its lease: hand it back now
    assert forgotten.lease_id == 1
    assert cache.lookup(a) is None
    assert cache.forget(b) == []  # pinned: stays until unpinned
    assert cache.due(unpinned=True) == []
    assert [d.lease_id for d in cache.due(everything=True)] == [2]


def test_forget_drops_every_unpinned_lease_that_holds_the_key() -> None:
    """A renewal puts many hot blocks in one lease: removing one of them must not
    leave its range pinned until that lease ends."""
    cache = LeaseCache(hold_s=10)
    a, b, c = make_keys(3)
    cache.add(1, [(a, "pa", 10), (b, "pb", 10)], ttl=30, pins=0)
    cache.add(2, [(b, "pb", 10), (c, "pc", 10)], ttl=30, pins=0)  # serves b now; 1 still a
    cache.add(3, [(c, "pc", 10)], ttl=30, pins=1)  # pinned: a reader holds it
    dropped = cache.forget(b)
    assert sorted(d.lease_id for d in dropped) == [1, 2]  # both hold b: whole, now
    assert cache.lookup(a) is None and cache.lookup(b) is None  # a: leased again when read
    assert cache.lookup(c) is not None  # lease 3 (pinned) serves c
    assert cache.forget(b) == []


def test_a_newer_lease_supersedes_an_idle_older_one() -> None:
    cache = LeaseCache(hold_s=10)
    a, b = make_keys(2)
    cache.add(1, [(a, "pa", 10)], ttl=30, pins=0)
    cache.add(2, [(a, "pa", 10), (b, "pb", 10)], ttl=30, pins=0)
    assert [d.lease_id for d in cache.superseded] == [1]
    cache.add(3, [(b, "pb", 10)], ttl=30, pins=0)
    assert cache.superseded == []  # lease 2 still serves a


def test_pin_many_pins_each_distinct_cached_key_once() -> None:
    cache = LeaseCache(hold_s=10)
    a, b, c = make_keys(3)
    lease = cache.add(1, [(a, "pa", 10), (b, "pb", 10)], ttl=30, pins=0)
    found = cache.pin_many([a, b, a, c, b])
    assert list(found) == [a, b]  # c is not cached; a and b once each
    assert lease.pins == 2 and lease.reads == {a: 1, b: 1}
    for _ in found:
        cache.unpin(lease)
    assert lease.pins == 0


def test_a_batch_naming_a_key_twice_leaves_no_lease_pinned() -> None:
    """Each entry of a batch's lookup is unpinned once: a key named twice used to pin
    its lease twice (from the cache, or from a LEASE naming it twice), so that lease
    stayed pinned and was never handed back (the master held it for its whole TTL,
    30 s)."""
    cluster = start_cluster(["4MiB"])
    try:
        with kvpool.connect(cluster.url, lease_cache_s=0.2) as pool:
            assert wait_until(lambda: len(pool.stats()["nodes"]) == 1, timeout=15)
            keys = make_keys(2)
            pool.put_batch(keys, [payload(0), payload(1)])
            outs = [np.empty(BLOCK, np.uint8) for _ in range(3)]
            for _ in range(2):  # a LEASE round trip first, then from the cache
                got = pool.get_into_batch([keys[0], keys[1], keys[0]], outs)
                assert got == [BLOCK] * 3
                assert np.array_equal(outs[0], payload(0)) and np.array_equal(outs[2], payload(0))
            assert pool.stats()["client"]["lease_round_trips"] == 1
            # Unpinned, past their hold and unread: every lease goes back to the master.
            assert wait_until(lambda: pool.stats()["leases"] == 0, timeout=10)
    finally:
        cluster.stop()


def test_repeated_reads_skip_the_master_and_removes_show_within_the_hold_time() -> None:
    cluster = start_cluster(["4MiB"])
    try:
        with (
            kvpool.connect(cluster.url, lease_cache_s=2.0) as reader,
            kvpool.connect(cluster.url) as writer,
        ):
            assert wait_until(lambda: len(writer.stats()["nodes"]) == 1, timeout=15)
            keys = make_keys(8)
            writer.put_batch(keys, [payload(i) for i in range(8)])
            writer.flush()  # another client reads next: the visibility rule's bound
            out = np.empty(BLOCK, np.uint8)
            for _ in range(5):
                for i, key in enumerate(keys):
                    assert reader.get_into(key, out) == BLOCK and np.array_equal(out, payload(i))
            # One round trip per key on the first pass; the other four passes hit the cache.
            assert reader.stats()["client"]["lease_round_trips"] == len(keys)
            assert writer.remove(keys[0])
            assert wait_until(lambda: reader.get_into(keys[0], out) is None, timeout=4)
    finally:
        cluster.stop()


def test_cache_off_every_read_asks_the_master_and_still_reads_right() -> None:
    cluster = start_cluster(["4MiB"])
    try:
        with kvpool.connect(cluster.url, lease_cache_s=0) as pool:
            assert wait_until(lambda: len(pool.stats()["nodes"]) == 1, timeout=15)
            keys = make_keys(4)
            pool.put_batch(keys, [payload(i) for i in range(4)])
            out = np.empty(BLOCK, np.uint8)
            for _ in range(3):
                for i, key in enumerate(keys):
                    assert pool.get_into(key, out) == BLOCK and np.array_equal(out, payload(i))
            assert pool.stats()["client"]["lease_round_trips"] == 12
            assert pool.get_into_batch(keys, [np.empty(BLOCK, np.uint8)] * 4) == [BLOCK] * 4
    finally:
        cluster.stop()


def test_renewable_names_the_read_keys_of_leases_that_end_soon() -> None:
    cache = LeaseCache(hold_s=0.2)
    a, b, c, d = make_keys(4)
    first = cache.add(1, [(a, "pa", 10), (b, "pb", 10)], ttl=30, pins=0)
    assert cache.renewable(within=0.1) == []  # ends in 0.2 s: not yet
    assert cache.renewable(within=1.0) == []  # nothing read yet: cold
    cache.lookup(a)
    cache.lookup(b, count=False)  # a probe, not a read
    assert cache.renewable(within=1.0) == [a]
    cache.add(2, [(a, "pa", 10), (c, "pc", 10)], ttl=30, pins=0)  # a newer lease serves a
    cache.lookup(c)
    assert first.reads[a] == 1 and cache.renewable(within=1.0) == [c]
    cache.add(3, [(d, "pd", 10)], ttl=30, pins=0)
    assert cache.renewable(within=1.0) == [c]
    e = make_keys(5)[4]
    cache.add(4, [(e, "pe", 10)], ttl=30, pins=0, for_read=True)  # a read took it
    assert cache.renewable(within=1.0) == [c, e]  # read once (by that read): renewed
    time.sleep(0.25)
    cache.lookup(d)  # past its hold: not a read of a held lease
    assert cache.renewable(within=1.0) == []  # every lease is due: the next read leases again


def test_hot_blocks_are_renewed_off_the_read_path() -> None:
    """A block read at least once per janitor tick (hold_s / 2) never makes a read
    wait for the master: the janitor renews it, every hot key in one round trip;
    a block nobody reads lapses; a remove still shows within the hold time."""
    cluster = start_cluster(["4MiB"])
    try:
        with (
            kvpool.connect(cluster.url, lease_cache_s=1.0) as reader,
            kvpool.connect(cluster.url) as writer,
        ):
            assert wait_until(lambda: len(writer.stats()["nodes"]) == 1, timeout=15)
            keys = make_keys(6)
            writer.put_batch(keys, [payload(i) for i in range(6)])
            writer.flush()  # another client reads next: the visibility rule's bound
            out = np.empty(BLOCK, np.uint8)
            assert reader.get_into(keys[5], out) == BLOCK  # read once (renewed once), then never
            end = time.monotonic() + 2.6
            while time.monotonic() < end:  # keys 0-4 stay hot for 2.6 hold times
                for i, key in enumerate(keys[:5]):
                    assert reader.get_into(key, out) == BLOCK and np.array_equal(out, payload(i))
                time.sleep(0.01)
            client = reader.stats()["client"]
            assert client["lease_round_trips"] == 6  # the first read of each key only
            assert client["lease_renewals"] >= 3  # one per tick, for all hot keys at once
            assert reader.get_into(keys[5], out) == BLOCK  # cold: its lease lapsed
            assert reader.stats()["client"]["lease_round_trips"] == 7
            assert writer.remove(keys[0])
            removed = time.monotonic()
            assert wait_until(lambda: reader.get_into(keys[0], out) is None, timeout=3)
            assert time.monotonic() - removed < 2.0  # the hold (1 s) + slack under load
            assert reader.get_into_batch(keys[1:5], [out] * 4) == [BLOCK] * 4
    finally:
        cluster.stop()

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


def test_forget_and_release_all_unpinned() -> None:
    cache = LeaseCache(hold_s=10)
    a, b = make_keys(2)
    cache.add(1, [(a, "pa", 10)], ttl=30, pins=0)
    cache.add(2, [(b, "pb", 10)], ttl=30, pins=1)
    forgotten = cache.forget(a)  # its lease serves nothing else: hand it back now
    assert forgotten is not None and forgotten.lease_id == 1
    assert cache.lookup(a) is None
    assert cache.forget(b) is None  # pinned: stays until unpinned
    assert cache.due(unpinned=True) == []
    assert [d.lease_id for d in cache.due(everything=True)] == [2]


def test_a_newer_lease_supersedes_an_idle_older_one() -> None:
    cache = LeaseCache(hold_s=10)
    a, b = make_keys(2)
    cache.add(1, [(a, "pa", 10)], ttl=30, pins=0)
    cache.add(2, [(a, "pa", 10), (b, "pb", 10)], ttl=30, pins=0)
    assert [d.lease_id for d in cache.superseded] == [1]
    cache.add(3, [(b, "pb", 10)], ttl=30, pins=0)
    assert cache.superseded == []  # lease 2 still serves a


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

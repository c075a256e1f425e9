"""The read fast paths (a whole cached block in one step, same-host batches):
the same bytes as the general path, and a stale or missing block is still a
miss, never another block's bytes. Real master and node processes."""

from __future__ import annotations

import numpy as np
import pytest
from clusterhelpers import start_cluster, wait_until
from poolhelpers import BLOCK, make_keys, payload

import kvpool


@pytest.fixture(scope="module")
def cluster():
    cluster = start_cluster(["8MiB"])
    yield cluster
    cluster.stop()


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_whole_block_reads_match_the_general_path(cluster, transport: str) -> None:
    with kvpool.connect(cluster.url, transport=transport, lease_cache_s=30.0) as pool:
        assert wait_until(lambda: len(pool.stats()["nodes"]) == 1, timeout=15)
        keys = make_keys(6, seed=11)
        assert all(pool.put_batch(keys, [payload(i) for i in range(6)]))
        general = [0]  # calls of the general path (test-only spy on the client's reads)
        reads = pool._reads
        read_range = reads.read_range

        def counted(*args, **kw):
            general[0] += 1
            return read_range(*args, **kw)

        reads.read_range = counted
        for _ in range(3):  # first pass leases; the others run from the cache
            for i, key in enumerate(keys):
                out = np.zeros(BLOCK, np.uint8)  # exactly the block: the fast path
                assert pool.get_into(key, out) == BLOCK
                assert np.array_equal(out, payload(i))
                big = np.full(BLOCK + 4096, 7, np.uint8)  # larger buffer: the general path
                assert pool.get_into(key, big) == BLOCK
                assert np.array_equal(big[:BLOCK], payload(i)) and (big[BLOCK:] == 7).all()
                part = np.zeros(1000, np.uint8)
                assert pool.get_into(key, part, offset=4096, length=1000) == 1000
                assert np.array_equal(part, payload(i)[4096:5096])
            outs = [np.zeros(BLOCK, np.uint8) for _ in keys]
            assert pool.get_into_batch(keys, outs) == [BLOCK] * len(keys)
            for i, out in enumerate(outs):
                assert np.array_equal(out, payload(i))
        client = pool.stats()["client"]
        assert client["lease_round_trips"] == len(keys) and client["misses"] == 0
        assert general == [2 * len(keys) * 3 + len(keys)]  # big + part reads, first reads
        # a buffer too small is refused with a clear error, as before
        with pytest.raises(kvpool.KVPoolError):
            pool.get_into(keys[0], np.zeros(BLOCK - 1, np.uint8))
        # other buffer kinds take the general view and get the same bytes
        for other in (bytearray(BLOCK), np.zeros((16, BLOCK // 16), np.uint8)):
            assert pool.get_into(keys[1], other) == BLOCK
            assert np.array_equal(np.frombuffer(bytes(other), np.uint8), payload(1))
        read_only = np.zeros(BLOCK, np.uint8)
        read_only.setflags(write=False)
        with pytest.raises(kvpool.KVPoolError, match="read-only"):
            pool.get_into(keys[1], read_only)
        for bad in (True, -1, 1.0):  # the range check still runs for non-default offsets
            with pytest.raises(kvpool.KVPoolError):
                pool.get_into(keys[1], np.zeros(BLOCK, np.uint8), offset=bad)
        # removed by this client: a miss at once
        assert pool.remove(keys[0])
        assert pool.get_into(keys[0], np.zeros(BLOCK, np.uint8)) is None
        assert pool.get_into_batch(keys[:2], [np.zeros(BLOCK, np.uint8)] * 2)[0] is None
        for key in keys[1:]:
            assert pool.remove(key)


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_a_stale_cached_lease_is_a_miss_never_another_blocks_bytes(cluster, transport) -> None:
    """A cached entry whose range now holds another block (as after a lease outlived
    on a restarted master): the identity check refuses it on both paths."""
    with kvpool.connect(cluster.url, transport=transport, lease_cache_s=30.0) as pool:
        assert wait_until(lambda: len(pool.stats()["nodes"]) == 1, timeout=15)
        a, b = make_keys(2, seed=12 if transport == "shm" else 13)
        assert all(pool.put_batch([a, b], [payload(1), payload(2)]))
        out = np.zeros(BLOCK, np.uint8)
        assert pool.get_into(a, out) == BLOCK and pool.get_into(b, out) == BLOCK
        # Test-only surgery: a's cache entry now names b's range (the range was reused).
        cache = pool._reads.cache._blocks
        cache[a] = (cache[b][0], BLOCK, cache[a][2])
        before = pool.stats()["client"]["misses"]
        out[:] = 0
        assert pool.get_into(a, out) is None  # fast path refused, general path refused
        assert not out.any()  # no other block's bytes, nor text: TCP's refusal fills NULs
        assert pool.get_into_batch([a, b], [np.zeros(BLOCK, np.uint8)] * 2) == [None, BLOCK]
        assert pool.stats()["client"]["misses"] == before + 2
        assert pool.get_into(b, out) == BLOCK and np.array_equal(out, payload(2))
        pool.remove(a)
        pool.remove(b)


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_a_cached_batch_reads_in_one_pass_and_checks_every_destination_first(
    cluster, transport: str
) -> None:
    """A batch whose every block is cached (``LeaseCache.pin_all``, one pass, no
    LEASE): the blocks' bytes, a key named twice read twice and counted twice, every
    lease unpinned after; a destination it does not take (read-only, too small,
    larger than the block) sends the batch to the general path: its usual error
    before any byte moved, or the same bytes."""
    with kvpool.connect(cluster.url, transport=transport, lease_cache_s=30.0) as pool:
        assert wait_until(lambda: len(pool.stats()["nodes"]) == 1, timeout=15)
        a, b = make_keys(2, seed=14 if transport == "shm" else 15)
        assert all(pool.put_batch([a, b], [payload(1), payload(2)]))
        assert pool.get_into_batch([a, b], [np.zeros(BLOCK, np.uint8)] * 2) == [BLOCK] * 2
        trips = pool.stats()["client"]["lease_round_trips"]
        cache = pool._reads.cache  # test-only: the pins and read counts it keeps
        lease = cache.lookup(a, count=False)[2]  # type: ignore[index]
        reads_before = lease.reads[a]
        outs = [np.zeros(BLOCK, np.uint8) for _ in range(3)]
        assert pool.get_into_batch([a, b, a], outs) == [BLOCK] * 3
        assert np.array_equal(outs[0], payload(1)) and np.array_equal(outs[2], payload(1))
        assert np.array_equal(outs[1], payload(2))
        assert lease.reads[a] == reads_before + 2 and lease.pins == 0
        frozen = np.zeros(BLOCK, np.uint8)
        frozen.setflags(write=False)
        for bad, match in ((frozen, "read-only"), (np.zeros(BLOCK - 1, np.uint8), "are asked")):
            first = np.zeros(BLOCK, np.uint8)
            with pytest.raises(kvpool.BufferSpecError, match=match):
                pool.get_into_batch([a, b], [first, bad])
            assert not first.any()  # nothing moved before the error
        big = np.full(BLOCK + 64, 7, np.uint8)
        assert pool.get_into_batch([a, b], [np.zeros(BLOCK, np.uint8), big]) == [BLOCK] * 2
        assert np.array_equal(big[:BLOCK], payload(2)) and (big[BLOCK:] == 7).all()
        assert lease.pins == 0
        assert pool.stats()["client"]["lease_round_trips"] == trips  # all from the cache
        pool.remove(a)
        pool.remove(b)


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_a_ranged_batch_reads_its_ranges_on_every_path(cluster, transport: str) -> None:
    """``get_into_batch`` with ``offsets``/``lengths`` (a layer-wise reader's call):
    each read its range of its block, from the cache in one pass or by the general
    path (a destination larger than its range), one key twice; a range past its
    block's end raises before any byte moved; a stale entry is a miss on the
    per-read fallback, never another block's bytes; no lease left pinned."""
    with kvpool.connect(cluster.url, transport=transport, lease_cache_s=30.0) as pool:
        assert wait_until(lambda: len(pool.stats()["nodes"]) == 1, timeout=15)
        a, b = make_keys(2, seed=16 if transport == "shm" else 17)
        assert all(pool.put_batch([a, b], [payload(1), payload(2)]))
        keys, offsets, lengths = [a, a, b], [0, 4096, 100], [4096, 1000, None]
        want = [(1, 0, 4096), (1, 4096, 5096), (2, 100, BLOCK)]
        for larger in (0, 64):  # exact destinations (cache, one pass), then larger ones
            for _ in range(2):  # the first batch leases, the second runs from the cache
                outs = [np.full(hi - lo + larger, 7, np.uint8) for _, lo, hi in want]
                got = pool.get_into_batch(keys, outs, offsets=offsets, lengths=lengths)
                assert got == [hi - lo for _, lo, hi in want]
                for out, (i, lo, hi) in zip(outs, want, strict=True):
                    assert np.array_equal(out[: hi - lo], payload(i)[lo:hi])
                    assert (out[hi - lo :] == 7).all()
        lease = pool._reads.cache.lookup(a, count=False)[2]  # type: ignore[index]
        assert lease.pins == 0
        first = np.zeros(100, np.uint8)
        with pytest.raises(kvpool.BufferSpecError, match="outside the block"):
            pool.get_into_batch(
                [a, b], [first, np.zeros(100, np.uint8)], offsets=[0, BLOCK - 50], lengths=[100] * 2
            )
        assert not first.any() and lease.pins == 0  # checked before any byte moved
        # Test-only surgery (as above): a's entry names b's range; the node (TCP) or the
        # identity record (shm) refuses a's read, the per-read fallback takes b's range.
        cache = pool._reads.cache._blocks
        cache[a] = (cache[b][0], BLOCK, cache[a][2])
        outs = [np.zeros(1000, np.uint8), np.zeros(1000, np.uint8)]
        assert pool.get_into_batch([a, b], outs, offsets=[10, 20], lengths=[1000, 1000]) == [
            None,
            1000,
        ]
        assert not outs[0].any() and np.array_equal(outs[1], payload(2)[20:1020])
        pool.remove(a)
        pool.remove(b)

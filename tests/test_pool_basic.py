"""Embedded pool specifics: tier accounting, len(), defaults.

The public API's cases (every store, embedded and cluster) are in
tests/test_store_contract.py; this module checks what only an embedded pool
exposes: per-tier bytes and counters in ``stats()``.
"""

from __future__ import annotations

from poolhelpers import BLOCK, make_keys, payload

from kvpool import Pool


def test_stats_count_hits_misses_and_tier_bytes(pool: Pool, keys: list[bytes]) -> None:
    assert pool.get(keys[1]) is None
    assert pool.get_into(keys[1], bytearray(8)) is None
    pool.put(keys[0], payload(0))
    pool.get(keys[0])
    stats = pool.stats()
    assert stats["blocks"] == 1 and stats["hits"] == 1 and stats["puts"] == 1
    assert stats["misses"] == 2
    dram = stats["tiers"]["dram"]
    assert dram["capacity_bytes"] == 16 * BLOCK
    assert dram["used_bytes"] == BLOCK
    assert dram["blocks"] == 1
    assert stats["policy"] == "lru"
    assert len(pool) == 1


def test_remove_and_abort_give_the_tier_bytes_back(pool: Pool, keys: list[bytes]) -> None:
    pool.put(keys[0], payload(0))
    assert pool.remove(keys[0])
    assert pool.stats()["tiers"]["dram"]["used_bytes"] == 0
    writer = pool.reserve(keys[1], BLOCK)
    assert writer is not None
    assert pool.stats()["tiers"]["dram"]["used_bytes"] == BLOCK  # reserved
    writer.abort()
    assert pool.stats()["tiers"]["dram"]["used_bytes"] == 0
    assert len(pool) == 0


def test_default_embedded_pool_works() -> None:
    with Pool.embedded() as p:
        key = make_keys(1)[0]
        p.put(key, b"hello")
        assert p.get(key) == b"hello"
        assert p.stats()["tiers"]["dram"]["capacity_bytes"] == 256 << 20

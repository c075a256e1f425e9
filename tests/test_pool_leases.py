"""Embedded leases against eviction and the SSD tier.

The contract's lease cases (prefix semantics, release twice, remove under a
lease), reserve/BlockWriter and range reads run on every store in
tests/test_store_contract.py.
"""

from __future__ import annotations

import numpy as np
import pytest
from poolhelpers import BLOCK, make_keys, payload

from kvpool import Pool, PoolFullError


def test_lease_pins_the_stored_prefix_until_release() -> None:
    keys = make_keys(5)
    with Pool.embedded(dram_bytes=3 * BLOCK) as pool:
        for i in (0, 1, 3):
            pool.put(keys[i], payload(i))
        with pool.lease(keys) as lease:
            assert len(lease) == 2 and lease.keys == keys[:2]
            pool.put(keys[4], payload(4))  # evicts 3, the only unleased block
            assert pool.exists(keys) == [True, True, False, False, True]
            assert pool.put(keys[2], payload(2))  # evicts 4
            assert pool.exists(keys) == [True, True, True, False, False]
            with pytest.raises(PoolFullError):  # only one block is evictable
                pool.put(keys[3], payload(3, 2 * BLOCK))
            assert pool.remove(keys[0])  # hidden now, freed on release
            out = np.empty(BLOCK, np.uint8)
            assert pool.get_into(keys[1], out, offset=7, length=100) == 100
            assert np.array_equal(out[:100], payload(1)[7:107])
        assert pool.stats()["tiers"]["dram"]["used_bytes"] == BLOCK  # only 1 is left
        assert pool.exists(keys) == [False, True, False, False, False]


def test_lease_promotes_ssd_blocks_and_stops_at_corrupt_ones(tmp_path: object) -> None:
    keys = make_keys(4)
    with Pool.embedded(dram_bytes=4 * BLOCK, ssd_path=str(tmp_path), ssd_bytes=8 * BLOCK) as pool:
        for i, key in enumerate(keys):
            pool.put(key, payload(i))
        for i in range(4):  # push everything to SSD
            pool.put(make_keys(8, seed=3)[i], payload(10 + i))
        assert pool.stats()["tiers"]["ssd"]["blocks"] == 4
        with pool.lease(keys[:2]) as lease:
            assert len(lease) == 2
            assert pool.stats()["promotions"] == 2  # (which pushed two others down)
        with open(f"{tmp_path}/data.bin", "r+b") as f:  # corrupt every SSD extent
            for offset in range(0, 8 * BLOCK, BLOCK):
                f.seek(offset)
                f.write(b"\xff" * 8)
        lease = pool.lease(keys)
        assert len(lease) == 2  # 0 and 1 are in DRAM now; 2 is corrupt on SSD
        lease.release()
        lease.release()
        assert pool.exists(keys) == [True, True, False, True]

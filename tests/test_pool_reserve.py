"""Piecewise writes (reserve -> write ranges -> commit) and byte-range reads."""

from __future__ import annotations

import numpy as np
import pytest
from poolhelpers import BLOCK, make_keys, payload

from kvpool import BufferSpecError, KVPoolError, Pool, PoolClosedError, PoolFullError


def test_reserved_block_is_invisible_until_commit(pool: Pool) -> None:
    key = make_keys(1)[0]
    data = payload(5)
    writer = pool.reserve(key, BLOCK)
    assert writer is not None
    for part in range(4)[::-1]:  # any order
        writer.write(part * BLOCK // 4, data[part * BLOCK // 4 : (part + 1) * BLOCK // 4])
        assert pool.exists([key]) == [False]
    assert pool.reserve(key, BLOCK) is None  # already being written
    writer.commit()
    assert pool.get(key) == data.tobytes()
    assert pool.reserve(key, BLOCK) is None  # already stored
    with pytest.raises(KVPoolError):
        writer.commit()


def test_abort_and_exceptions_free_the_reservation(pool: Pool) -> None:
    key = make_keys(1)[0]
    writer = pool.reserve(key, BLOCK)
    assert writer is not None
    writer.write(0, payload(0)[:100])
    writer.abort()
    assert pool.exists([key]) == [False]
    assert pool.stats()["tiers"]["dram"]["used_bytes"] == 0
    with pytest.raises(RuntimeError), pool.reserve(key, BLOCK) as w:  # type: ignore[union-attr]
        w.write(0, payload(0))
        raise RuntimeError("producer failed")
    assert pool.exists([key]) == [False]
    assert pool.stats()["tiers"]["dram"]["used_bytes"] == 0


def test_out_of_range_writes_are_refused(pool: Pool) -> None:
    key = make_keys(1)[0]
    with pool.reserve(key, 1000) as writer:  # type: ignore[union-attr]
        with pytest.raises(BufferSpecError):
            writer.write(900, np.zeros(101, np.uint8))
        with pytest.raises(BufferSpecError):
            writer.write(-1, b"x")
        writer.write(0, np.full(1000, 7, np.uint8))
    assert pool.get(key) == bytes([7]) * 1000
    with pytest.raises(BufferSpecError):
        pool.reserve(make_keys(2)[1], 0)


def test_close_with_an_open_reservation() -> None:
    key = make_keys(1)[0]
    pool = Pool.embedded(dram_bytes=4 * BLOCK)
    writer = pool.reserve(key, BLOCK)
    assert writer is not None
    pool.close()
    with pytest.raises(PoolClosedError):
        writer.write(0, payload(0))
    with pytest.raises(PoolClosedError):
        writer.commit()


@pytest.mark.parametrize("tiered", [False, True], ids=["dram", "ssd"])
def test_range_reads_return_exact_bytes(tiered: bool, tmp_path: object) -> None:
    keys = make_keys(3)
    ssd = {"ssd_path": str(tmp_path), "ssd_bytes": 8 * BLOCK} if tiered else {}
    with Pool.embedded(dram_bytes=BLOCK if tiered else 4 * BLOCK, **ssd) as pool:  # type: ignore[arg-type]
        for i, key in enumerate(keys):
            pool.put(key, payload(i))
        out = np.zeros(BLOCK, np.uint8)
        assert pool.get_into(keys[0], out, offset=1000, length=5000) == 5000
        assert np.array_equal(out[:5000], payload(0)[1000:6000])
        assert not out[5000:].any()
        assert pool.get_into(keys[1], out, offset=BLOCK - 10) == 10
        assert np.array_equal(out[:10], payload(1)[-10:])
        for offset, length in ((BLOCK, None), (0, BLOCK + 1), (-1, 10), (10, 0)):
            with pytest.raises(BufferSpecError):
                pool.get_into(keys[2], out, offset=offset, length=length)
        assert pool.get(keys[2]) == payload(2).tobytes()


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

"""Piecewise writes (reserve -> write ranges -> commit) and byte-range reads."""

from __future__ import annotations

import numpy as np
import pytest
from poolhelpers import BLOCK, make_keys, payload

from kvpool import BufferSpecError, KVPoolError, Pool, PoolClosedError


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

"""Eviction order, DRAM -> SSD demotion, promotion on hit, reopen, corruption."""

from __future__ import annotations

import os

import numpy as np
import pytest
from poolhelpers import BLOCK, has_cuda, make_keys, payload

from kvpool import Pool


def read(pool: Pool, key: bytes, size: int = BLOCK) -> np.ndarray | None:
    out = np.empty(size, np.uint8)
    got = pool.get_into(key, out)
    return None if got is None else out[:got]


def test_lru_evicts_in_exact_order_without_ssd() -> None:
    keys = make_keys(6)
    with Pool.embedded(dram_bytes=4 * BLOCK) as pool:
        for i in range(4):
            pool.put(keys[i], payload(i))
        read(pool, keys[0])  # 0 becomes most recent: order 1, 2, 3, 0
        pool.put(keys[4], payload(4))  # evicts 1
        assert pool.exists(keys[:5]) == [True, False, True, True, True]
        pool.put(keys[5], payload(5))  # evicts 2
        assert pool.exists(keys) == [True, False, False, True, True, True]
        stats = pool.stats()
        assert stats["tiers"]["dram"]["evictions"] == 2
        assert stats["tiers"]["dram"]["demotions"] == 0


def test_demoted_blocks_come_back_exact_and_are_promoted(ssd_pool: Pool) -> None:
    keys = make_keys(12)
    for i, key in enumerate(keys):
        ssd_pool.put(key, payload(i), parent=keys[i - 1] if i else None)
    stats = ssd_pool.stats()
    assert stats["tiers"]["dram"]["blocks"] == 4
    assert stats["tiers"]["ssd"]["blocks"] == 8
    wait = stats["tiers"]["ssd"]["write_wait"]  # how the 8 demotions were waited for
    if wait["aio"] and wait["spin_us"]:  # O_DIRECT, native AIO and a ring we can watch
        # each waited for awake (it spun once), or synchronous after a spin ran out
        assert wait["spin_ready"] + wait["spin_timeouts"] == wait["awake_writes"] >= 1
        assert wait["awake_writes"] + wait["sync_writes"] == 8
    else:  # tmpfs (no O_DIRECT), no native AIO, or spinning turned off
        assert wait["spin_ready"] + wait["spin_timeouts"] == 0
    assert ssd_pool.prefix_match(keys) == 12
    for i, key in enumerate(keys):
        got = read(ssd_pool, key)
        assert got is not None and np.array_equal(got, payload(i)), i
    stats = ssd_pool.stats()
    # Promoting 0..7 pushed 8..11 down to SSD (DRAM holds 4), so all 12 came from SSD.
    assert stats["promotions"] == 12
    assert stats["tiers"]["ssd"]["hits"] == 12
    assert stats["blocks"] == 12  # promotion demotes others; nothing is lost


def test_ssd_eviction_drops_the_coldest_when_both_tiers_fill(tmp_path: object) -> None:
    keys = make_keys(10)
    with Pool.embedded(dram_bytes=2 * BLOCK, ssd_path=str(tmp_path), ssd_bytes=4 * BLOCK) as pool:
        for i, key in enumerate(keys):
            pool.put(key, payload(i))
        # 0..3 were dropped from SSD in order; 4..7 on SSD, 8..9 in DRAM.
        assert pool.exists(keys) == [False] * 4 + [True] * 6
        assert pool.stats()["tiers"]["ssd"]["evictions"] == 4


def test_reopen_keeps_ssd_blocks_and_their_bytes(tmp_path: object) -> None:
    keys = make_keys(8)
    kwargs = {"dram_bytes": 2 * BLOCK, "ssd_path": str(tmp_path), "ssd_bytes": 16 * BLOCK}
    with Pool.embedded(**kwargs) as pool:  # type: ignore[arg-type]
        for i, key in enumerate(keys):
            pool.put(key, payload(i))
    with Pool.embedded(**kwargs) as pool:  # type: ignore[arg-type]
        # DRAM is volatile: the last 2 blocks were only there.
        assert pool.exists(keys) == [True] * 6 + [False] * 2
        for i in range(6):
            got = read(pool, keys[i])
            assert got is not None and np.array_equal(got, payload(i))


def test_corrupt_ssd_block_reads_as_miss_and_is_dropped(tmp_path: object) -> None:
    keys = make_keys(3)
    with Pool.embedded(dram_bytes=1 * BLOCK, ssd_path=str(tmp_path), ssd_bytes=8 * BLOCK) as pool:
        for i, key in enumerate(keys):
            pool.put(key, payload(i))  # 0 and 1 demoted to SSD
        with open(os.path.join(str(tmp_path), "data.bin"), "r+b") as f:
            for offset in range(0, 8 * BLOCK, BLOCK):  # flip a byte in every extent
                f.seek(offset + 100)
                byte = f.read(1)
                f.seek(offset + 100)
                f.write(bytes([byte[0] ^ 0xFF]))
        assert read(pool, keys[0]) is None
        assert pool.exists(keys) == [False, True, True]
        assert pool.stats()["corrupt_dropped"] == 1
        assert pool.get(keys[1]) is None
        got = read(pool, keys[2])
        assert got is not None and np.array_equal(got, payload(2))
    with Pool.embedded(dram_bytes=BLOCK, ssd_path=str(tmp_path), ssd_bytes=8 * BLOCK) as pool:
        assert pool.exists(keys[:2]) == [False, False]  # the drop was persisted


def test_remove_on_ssd_is_persisted(tmp_path: object) -> None:
    keys = make_keys(3)
    kwargs = {"dram_bytes": BLOCK, "ssd_path": str(tmp_path), "ssd_bytes": 8 * BLOCK}
    with Pool.embedded(**kwargs) as pool:  # type: ignore[arg-type]
        for i, key in enumerate(keys):
            pool.put(key, payload(i))
        assert pool.remove(keys[0])
        assert pool.stats()["tiers"]["ssd"]["used_bytes"] == BLOCK
    with Pool.embedded(**kwargs) as pool:  # type: ignore[arg-type]
        assert pool.exists(keys) == [False, True, False]


def test_blocks_too_big_for_ssd_are_dropped_not_demoted(tmp_path: object) -> None:
    keys = make_keys(2)
    with Pool.embedded(dram_bytes=2 * BLOCK, ssd_path=str(tmp_path), ssd_bytes=BLOCK // 2) as pool:
        pool.put(keys[0], payload(0, 2 * BLOCK))
        pool.put(keys[1], payload(1, 2 * BLOCK))
        assert pool.exists(keys) == [False, True]


@pytest.mark.skipif(not has_cuda(), reason="needs CUDA (torch.cuda.is_available() is False here)")
def test_gpu_tier_round_trip_and_demotion() -> None:  # pragma: no cover - needs a GPU
    import torch

    keys = make_keys(4)
    with Pool.embedded(dram_bytes=8 * BLOCK, gpu_bytes=2 * BLOCK) as pool:
        for i, key in enumerate(keys):
            pool.put(key, torch.from_numpy(payload(i)).cuda())
        stats = pool.stats()["tiers"]
        assert stats["gpu"]["blocks"] == 2 and stats["dram"]["blocks"] == 2
        for i, key in enumerate(keys):
            out = torch.empty(BLOCK, dtype=torch.uint8, device="cuda")
            assert pool.get_into(key, out) == BLOCK
            assert np.array_equal(out.cpu().numpy(), payload(i))

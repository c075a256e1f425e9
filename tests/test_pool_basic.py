"""Embedded pool: exact bytes back for every buffer type, prefix match, remove, stats."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from poolhelpers import BLOCK, make_keys, payload

from kvpool import Pool


def test_put_get_exact_bytes(pool: Pool, keys: list[bytes]) -> None:
    data = payload(1)
    assert pool.put(keys[0], data) is True
    assert pool.get(keys[0]) == data.tobytes()
    out = np.empty(BLOCK, np.uint8)
    assert pool.get_into(keys[0], out) == BLOCK
    assert np.array_equal(out, data)


@pytest.mark.parametrize(
    "make",
    [
        lambda a: a.tobytes(),
        lambda a: bytearray(a.tobytes()),
        lambda a: memoryview(a.tobytes()),
        lambda a: a.view(np.float32).reshape(64, -1),
        lambda a: torch.from_numpy(a.copy()).view(torch.bfloat16).reshape(8, -1),
        lambda a: torch.from_numpy(a.copy()).view(torch.int64),
    ],
    ids=["bytes", "bytearray", "memoryview", "numpy-2d-f32", "torch-bf16", "torch-i64"],
)
def test_every_buffer_type_round_trips(pool: Pool, keys: list[bytes], make: object) -> None:
    data = payload(7)
    assert pool.put(keys[0], make(data))  # type: ignore[operator]
    for out in (
        np.zeros(BLOCK, np.uint8),
        torch.zeros(BLOCK // 2, dtype=torch.float16),
        bytearray(BLOCK),
    ):
        assert pool.get_into(keys[0], out) == BLOCK
        assert (
            bytes(
                memoryview(np.asarray(out) if not torch.is_tensor(out) else out.numpy()).cast("B")
            )
            == data.tobytes()
        )


def test_out_may_be_larger_than_the_block(pool: Pool, keys: list[bytes]) -> None:
    pool.put(keys[0], b"abc")
    out = bytearray(10)
    assert pool.get_into(keys[0], out) == 3
    assert out == b"abc" + bytes(7)


def test_miss_returns_none(pool: Pool, keys: list[bytes]) -> None:
    assert pool.get(keys[0]) is None
    assert pool.get_into(keys[0], np.empty(8, np.uint8)) is None
    assert pool.stats()["misses"] == 2


def test_put_of_an_existing_key_is_a_noop(pool: Pool, keys: list[bytes]) -> None:
    assert pool.put(keys[0], b"first")
    assert pool.put(keys[0], b"second") is False
    assert pool.get(keys[0]) == b"first"
    assert len(pool) == 1


def test_prefix_match_counts_leading_present_keys(pool: Pool) -> None:
    keys = make_keys(10)
    assert pool.prefix_match(keys) == 0
    for key in keys[:4]:
        pool.put(key, b"x" * 100)
    pool.put(keys[6], b"x")
    assert pool.prefix_match(keys) == 4
    assert pool.prefix_match(keys[:3]) == 3
    assert pool.prefix_match([]) == 0
    assert pool.exists(keys[:7]) == [True] * 4 + [False, False, True]


def test_remove(pool: Pool, keys: list[bytes]) -> None:
    pool.put(keys[0], payload(0))
    assert pool.remove(keys[0]) is True
    assert pool.remove(keys[0]) is False
    assert pool.get(keys[0]) is None
    assert pool.stats()["tiers"]["dram"]["used_bytes"] == 0
    assert pool.put(keys[0], b"again")
    assert pool.get(keys[0]) == b"again"


def test_batch_forms(pool: Pool) -> None:
    keys = make_keys(5)
    datas = [payload(i, 4096 + i) for i in range(5)]
    assert pool.put_batch(keys, datas, parents=[None, *keys[:4]]) == [True] * 5
    assert pool.put_batch(keys[:2], datas[:2]) == [False, False]
    outs = [np.empty(8192, np.uint8) for _ in range(6)]
    sizes = pool.get_into_batch([*keys, make_keys(1, seed=9)[0]], outs)
    assert sizes == [4096, 4097, 4098, 4099, 4100, None]
    for out, data in zip(outs, datas, strict=False):
        assert np.array_equal(out[: data.size], data)


def test_stats_shape(pool: Pool, keys: list[bytes]) -> None:
    pool.put(keys[0], payload(0))
    pool.get(keys[0])
    stats = pool.stats()
    assert stats["blocks"] == 1 and stats["hits"] == 1 and stats["puts"] == 1
    dram = stats["tiers"]["dram"]
    assert dram["capacity_bytes"] == 16 * BLOCK
    assert dram["used_bytes"] == BLOCK
    assert dram["blocks"] == 1
    assert stats["policy"] == "lru"


def test_default_embedded_pool_works() -> None:
    with Pool.embedded() as p:
        key = make_keys(1)[0]
        p.put(key, b"hello")
        assert p.get(key) == b"hello"
        assert p.stats()["tiers"]["dram"]["capacity_bytes"] == 256 << 20

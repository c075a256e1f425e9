"""Bad input raises a clear error and leaves the pool exactly as it was."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from poolhelpers import BLOCK, has_cuda, make_keys, payload

from kvpool import (
    BlockTooLargeError,
    BufferSpecError,
    InvalidKeyError,
    KVPoolError,
    Pool,
    PoolClosedError,
    StorageError,
    TierUnavailableError,
)


@pytest.fixture
def loaded(pool: Pool) -> Iterator[tuple[Pool, list[bytes]]]:
    keys = make_keys(3)
    for i, key in enumerate(keys):
        pool.put(key, payload(i))
    yield pool, keys


def assert_intact(pool: Pool, keys: list[bytes], used: int = 3 * BLOCK) -> None:
    assert len(pool) == len(keys)
    assert pool.stats()["tiers"]["dram"]["used_bytes"] == used
    for i, key in enumerate(keys):
        assert pool.get(key) == payload(i).tobytes()


@pytest.mark.parametrize("key", ["abc", bytearray(16), 12, b"short", b"x" * 17, None])
def test_bad_keys(loaded: tuple[Pool, list[bytes]], key: object) -> None:
    pool, keys = loaded
    for call in (
        lambda: pool.put(key, b"data"),  # type: ignore[arg-type]
        lambda: pool.get(key),  # type: ignore[arg-type]
        lambda: pool.get_into(key, bytearray(8)),  # type: ignore[arg-type]
        lambda: pool.exists([keys[0], key]),  # type: ignore[list-item]
        lambda: pool.prefix_match([keys[0], key]),  # type: ignore[list-item]
        lambda: pool.remove(key),  # type: ignore[arg-type]
    ):
        with pytest.raises(InvalidKeyError):
            call()
    if key is not None:  # None is a valid parent: "first block"
        with pytest.raises(InvalidKeyError):
            pool.put(make_keys(4)[3], b"x", parent=key)  # type: ignore[arg-type]
    assert_intact(pool, keys)


@pytest.mark.parametrize(
    "data",
    [
        np.zeros(2 * BLOCK, np.uint8)[::2],
        torch.zeros(256, 256, dtype=torch.uint8).t(),
        b"",
        np.zeros(0, np.uint8),
        "a string",
        12345,
    ],
    ids=["numpy-strided", "torch-transposed", "empty-bytes", "empty-array", "str", "int"],
)
def test_bad_data_buffers(loaded: tuple[Pool, list[bytes]], data: object) -> None:
    pool, keys = loaded
    new_key = make_keys(4)[3]
    with pytest.raises(BufferSpecError):
        pool.put(new_key, data)
    assert not pool.exists([new_key])[0]
    assert_intact(pool, keys)


@pytest.mark.parametrize(
    "out",
    [
        np.zeros(BLOCK - 1, np.uint8),
        np.zeros(2 * BLOCK, np.uint8)[::2],
        b"\0" * BLOCK,
        np.zeros(BLOCK, np.uint8).copy().setflags(write=False) or None,
    ],
    ids=["too-small", "strided", "bytes-readonly", "none"],
)
def test_bad_out_buffers(loaded: tuple[Pool, list[bytes]], out: object) -> None:
    pool, keys = loaded
    with pytest.raises(BufferSpecError):
        pool.get_into(keys[0], out)
    assert_intact(pool, keys)


def test_readonly_numpy_out(loaded: tuple[Pool, list[bytes]]) -> None:
    pool, keys = loaded
    out = np.zeros(BLOCK, np.uint8)
    out.setflags(write=False)
    with pytest.raises(BufferSpecError, match="read-only"):
        pool.get_into(keys[0], out)
    assert not out.any()


def test_value_larger_than_the_tier(loaded: tuple[Pool, list[bytes]]) -> None:
    pool, keys = loaded
    with pytest.raises(BlockTooLargeError):
        pool.put(make_keys(4)[3], np.zeros(17 * BLOCK, np.uint8))
    assert_intact(pool, keys)


def test_bad_batch_stores_nothing(pool: Pool) -> None:
    keys = make_keys(3)
    with pytest.raises(BufferSpecError):
        pool.put_batch(keys, [payload(0), payload(1), np.zeros(10, np.uint8)[::2]])
    with pytest.raises(InvalidKeyError):
        pool.put_batch([keys[0], b"bad"], [payload(0), payload(1)])
    with pytest.raises(ValueError):
        pool.put_batch(keys, [payload(0)])
    assert len(pool) == 0


def test_use_after_close() -> None:
    keys = make_keys(1)
    pool = Pool.embedded(dram_bytes=4 * BLOCK)
    pool.put(keys[0], b"x")
    pool.close()
    pool.close()  # idempotent
    for call in (
        lambda: pool.put(keys[0], b"x"),
        lambda: pool.get(keys[0]),
        lambda: pool.get_into(keys[0], bytearray(1)),
        lambda: pool.exists(keys),
        lambda: pool.prefix_match(keys),
        lambda: pool.remove(keys[0]),
    ):
        with pytest.raises(PoolClosedError):
            call()


def test_bad_configuration() -> None:
    with pytest.raises(ValueError, match="unknown eviction policy"):
        Pool.embedded(dram_bytes=BLOCK, policy="fifo-ish")
    with pytest.raises(ValueError):
        Pool.embedded(dram_bytes=BLOCK, ssd_path="/tmp/x")  # no ssd_bytes
    with pytest.raises(ValueError):
        Pool.embedded(dram_bytes=0)


@pytest.mark.skipif(has_cuda(), reason="CUDA is available here: the GPU tier opens")
def test_gpu_tier_without_cuda_is_refused() -> None:
    with pytest.raises(TierUnavailableError, match="CUDA"):
        Pool.embedded(dram_bytes=BLOCK, gpu_bytes=BLOCK)


def test_ssd_path_that_is_a_file(tmp_path: object) -> None:
    path = os.path.join(str(tmp_path), "file")
    open(path, "w").close()
    with pytest.raises(StorageError, match="not a writable directory"):
        Pool.embedded(dram_bytes=BLOCK, ssd_path=os.path.join(path, "sub"), ssd_bytes=BLOCK)


def test_ssd_path_in_use_by_another_pool(tmp_path: object) -> None:
    with (
        Pool.embedded(dram_bytes=BLOCK, ssd_path=str(tmp_path), ssd_bytes=BLOCK),
        pytest.raises(StorageError, match="in use"),
    ):
        Pool.embedded(dram_bytes=BLOCK, ssd_path=str(tmp_path), ssd_bytes=BLOCK)


@pytest.fixture
def small_tmpfs(tmp_path: object) -> Iterator[str]:
    """A 1 MiB tmpfs (needs root and mount rights; skipped otherwise)."""
    mount_point = os.path.join(str(tmp_path), "tiny")
    os.makedirs(mount_point)
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", mount_point], capture_output=True
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", mount_point], check=False)


def test_disk_full_is_refused_up_front(small_tmpfs: str) -> None:
    with pytest.raises(StorageError, match="not enough free disk"):
        Pool.embedded(dram_bytes=BLOCK, ssd_path=small_tmpfs, ssd_bytes=8 << 20)
    # Nothing half-made stays behind: the same directory works with a size that fits.
    with Pool.embedded(dram_bytes=BLOCK, ssd_path=small_tmpfs, ssd_bytes=256 << 10) as pool:
        keys = make_keys(3)
        for i, key in enumerate(keys):
            pool.put(key, payload(i))
        assert pool.get(keys[0]) == payload(0).tobytes()  # came back from the tmpfs tier


def test_read_only_ssd_path(small_tmpfs: str) -> None:
    subprocess.run(["mount", "-o", "remount,ro", small_tmpfs], check=True)
    with pytest.raises(StorageError):
        Pool.embedded(dram_bytes=BLOCK, ssd_path=small_tmpfs, ssd_bytes=64 << 10)


def test_every_error_is_a_kvpool_error() -> None:
    for cls in (
        BlockTooLargeError,
        BufferSpecError,
        InvalidKeyError,
        PoolClosedError,
        StorageError,
        TierUnavailableError,
    ):
        assert issubclass(cls, KVPoolError)

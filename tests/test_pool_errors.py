"""Embedded pool specifics of failing: bad configuration, tiers that cannot open.

Bad arguments to the store API (keys, buffers, ranges, batches, use after
close) are checked on every store in tests/test_store_contract.py.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator

import pytest
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

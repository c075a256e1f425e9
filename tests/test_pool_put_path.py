"""The embedded pool's whole-block put path (no writer handle) under concurrency.

A put's copy runs outside the lock with its key marked as being written:
a reserve or put of that key meanwhile is refused, ``close`` waits for the
copy, and a put whose pool closed under it raises and commits nothing. A
small host put whose copy is numpy's copies inside its one lock section
instead (``LOCKED_COPY_MAX``): the same bytes, the same counters.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import pytest
from poolhelpers import BLOCK, make_keys, payload

import kvpool.embedded.reservations as reservations_module
from kvpool import Pool
from kvpool.bindings import stream_copy
from kvpool.errors import BufferSpecError, PoolClosedError


class _Gate:
    """Holds every put copy until released (the copy seam is ``copy_region``)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.entered, self.release = threading.Event(), threading.Event()
        real = reservations_module.copy_region

        def copy(dst: Any, src: Any) -> None:
            self.entered.set()
            assert self.release.wait(10)
            real(dst, src)

        monkeypatch.setattr(reservations_module, "copy_region", copy)
        monkeypatch.setattr(reservations_module, "LOCKED_COPY_MAX", 0)  # small puts through it too


def test_a_key_being_put_cannot_be_reserved_or_put(monkeypatch: pytest.MonkeyPatch) -> None:
    key = make_keys(1)[0]
    gate = _Gate(monkeypatch)
    with Pool.embedded(dram_bytes=4 * BLOCK) as pool:
        errors: list[BaseException] = []

        def put() -> None:
            try:
                assert pool.put(key, payload(1))
            except BaseException as exc:  # pragma: no cover - reported below
                errors.append(exc)

        writer = threading.Thread(target=put)
        writer.start()
        assert gate.entered.wait(5)
        assert pool.reserve(key, BLOCK) is None
        assert pool.put(key, payload(2)) is False
        gate.release.set()
        writer.join(5)
        assert not errors
        assert pool.get(key) == payload(1).tobytes()
        assert pool.stats()["tiers"]["dram"]["used_bytes"] == BLOCK


def test_close_waits_for_a_put_which_then_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    key = make_keys(1)[0]
    gate = _Gate(monkeypatch)
    pool = Pool.embedded(dram_bytes=4 * BLOCK)
    raised: list[BaseException] = []

    def put() -> None:
        try:
            pool.put(key, payload(1))
        except BaseException as exc:
            raised.append(exc)

    writer = threading.Thread(target=put)
    writer.start()
    assert gate.entered.wait(5)
    closer = threading.Thread(target=pool.close)
    closer.start()
    time.sleep(0.1)
    assert closer.is_alive()  # waiting for the put's copy
    gate.release.set()
    writer.join(5)
    closer.join(5)
    assert not closer.is_alive()
    assert len(raised) == 1 and isinstance(raised[0], PoolClosedError)


def test_plain_and_adapted_buffers_store_the_same_bytes() -> None:
    keys = make_keys(4)
    data = payload(3)
    with Pool.embedded(dram_bytes=8 * BLOCK) as pool:
        assert pool.put(keys[0], data)  # flat uint8 ndarray: the fast path
        assert pool.put(keys[1], data.view(np.uint32))  # another dtype: through the adapter
        assert pool.put(keys[2], bytearray(data.tobytes()))
        for key in keys[:3]:
            out = np.empty(BLOCK, np.uint8)
            assert pool.get_into(key, out) == BLOCK
            assert np.array_equal(out, data)
        out = np.zeros(2 * BLOCK, np.uint8)
        assert pool.get_into(keys[0], out, offset=8, length=16) == 16
        assert np.array_equal(out[:16], data[8:24]) and not out[16:].any()


@pytest.mark.parametrize("plain", [True, False])
def test_puts_either_side_of_the_locked_copy_bound_store_exact_bytes(
    monkeypatch: pytest.MonkeyPatch, plain: bool
) -> None:
    """A host put whose copy is numpy's (``copies_plainly``: below 64 KiB always, above
    where this machine's copies of the size class settled on it; ``plain`` says which)
    copies by memoryview inside its one lock section up to ``LOCKED_COPY_MAX`` bytes;
    any other goes through ``copy_region`` between two sections. Both store every
    byte where it belongs, side by side, and the counters agree."""
    monkeypatch.setattr(
        reservations_module, "copies_plainly", lambda n: plain or n < stream_copy.STREAM_MIN
    )
    seen: list[int] = []
    real = reservations_module.copy_region

    def spy(dst: Any, src: Any) -> None:
        seen.append(src.nbytes)
        real(dst, src)

    monkeypatch.setattr(reservations_module, "copy_region", spy)
    bound = reservations_module.LOCKED_COPY_MAX
    small = stream_copy.STREAM_MIN
    sizes = [1, 4095, small - 1, small, small + 3, bound, bound + 1, bound + 4096]
    keys = make_keys(len(sizes))
    rng = np.random.default_rng(11)
    datas = [rng.integers(0, 256, n, dtype=np.uint8) for n in sizes]
    with Pool.embedded(dram_bytes=8 * bound) as pool:
        for key, data in zip(keys, datas, strict=True):
            assert pool.put(key, data)
        for key, data in zip(keys, datas, strict=True):
            assert pool.get(key) == data.tobytes()
        stats = pool.stats()
    assert seen == [n for n in sizes if n > bound or (n >= small and not plain)]
    assert stats["puts"] == len(sizes) and stats["bytes_written"] == sum(sizes)
    assert stats["tiers"]["dram"]["used_bytes"] == sum(-(-n // 4096) * 4096 for n in sizes)


def test_a_locked_copy_that_fails_frees_its_space_and_commits_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """White-box: a memoryview copy cannot fail on the arrays the fast path admits,
    but if one raised (here the tier's view does), the key stays absent and its
    extent goes back to the allocator."""
    key = make_keys(1)[0]
    monkeypatch.setattr(reservations_module, "copies_plainly", lambda n: True)

    class Broken:
        def __setitem__(self, where: slice, src: Any) -> None:
            raise OSError("bus error")

    with Pool.embedded(dram_bytes=4 * BLOCK) as pool:
        dram = pool._tiers.dram
        view = dram.host_bytes
        monkeypatch.setattr(dram, "host_bytes", Broken())
        with pytest.raises(OSError, match="bus error"):
            pool.put(key, payload(1))
        monkeypatch.setattr(dram, "host_bytes", view)
        assert pool.exists([key]) == [False]
        assert pool.stats()["tiers"]["dram"]["used_bytes"] == 0
        assert pool.put(key, payload(1)) and pool.get(key) == payload(1).tobytes()


def test_uint8_arrays_off_the_fast_path_still_store_and_read_exact() -> None:
    """The fast paths recognise numpy's uint8 descriptor by identity; a uint8
    array with another descriptor object (here: one carrying metadata), a
    read-only output and a non-contiguous one take the adapter, with the same
    bytes or the same clear error."""
    keys = make_keys(2)
    data = payload(5)
    odd_u8 = np.dtype(np.uint8, metadata={"from": "test"})
    assert odd_u8 == np.uint8 and odd_u8 is not np.dtype(np.uint8)
    with Pool.embedded(dram_bytes=8 * BLOCK) as pool:
        assert pool.put(keys[0], data.view(odd_u8))
        out = np.zeros(BLOCK, odd_u8)
        assert pool.get_into(keys[0], out) == BLOCK
        assert np.array_equal(out, data)
        read_only = np.zeros(BLOCK, np.uint8)
        read_only.flags.writeable = False
        with pytest.raises(BufferSpecError):
            pool.get_into(keys[0], read_only)
        strided = np.zeros(2 * BLOCK, np.uint8)[::2]
        with pytest.raises(BufferSpecError):
            pool.get_into(keys[0], strided)
        assert pool.stats()["hits"] == 1  # refused outputs changed nothing


def test_the_fast_put_keeps_admission_eviction_and_counters() -> None:
    """The host put runs _place / make_room / insert inline: the admission filter
    still refuses (and counts) a first sight, a full tier still evicts the least
    recently used block, and the counters match what was stored."""
    keys = make_keys(4)
    with Pool.embedded(dram_bytes=2 * BLOCK, policy="lru+admit2") as pool:
        assert pool.put(keys[0], payload(0)) is False  # first sight: not admitted
        assert pool.stats()["not_admitted"] == 1 and len(pool) == 0
        for i in range(3):  # the third needs room: keys[0], the oldest, is evicted
            assert pool.put(keys[i], payload(i)) or pool.put(keys[i], payload(i))
        assert pool.exists(keys[:3]) == [False, True, True]
        stats = pool.stats()
        assert stats["puts"] == 3 and stats["bytes_written"] == 3 * BLOCK
        assert stats["tiers"]["dram"]["puts"] == 3 and stats["tiers"]["dram"]["evictions"] == 1
        assert stats["tiers"]["dram"]["used_bytes"] == 2 * BLOCK
        out = np.empty(BLOCK, np.uint8)
        assert pool.get_into(keys[2], out) == BLOCK and np.array_equal(out, payload(2))

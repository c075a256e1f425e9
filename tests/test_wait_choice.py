"""How small SSD writes choose between waiting awake and a synchronous write
(kvpool.storage.wait_choice): the exact order around a spin that ran out, and a
real tier's blocks read back exact whichever way each one went."""

from __future__ import annotations

import mmap
from typing import Any

import numpy as np
import pytest

import kvpool.storage.direct_aio as aio_module
from kvpool.eviction import make_policy
from kvpool.storage.ssd_tier import SsdTier
from kvpool.storage.wait_choice import BACKOFF_WRITES, WaitChoice


def test_awake_until_a_spin_runs_out_then_synchronous_for_a_while() -> None:
    choice = WaitChoice()
    assert [choice.awake() for _ in range(3)] == [True] * 3
    choice.ran_out()
    assert [choice.awake() for _ in range(BACKOFF_WRITES)] == [False] * BACKOFF_WRITES
    assert choice.awake() and choice.awake()  # tried again
    choice.ran_out()
    assert not choice.awake()
    choice.ran_out()  # another timeout restarts the count, it does not add to it
    taken = [choice.awake() for _ in range(BACKOFF_WRITES + 1)]
    assert taken == [False] * BACKOFF_WRITES + [True]
    assert (choice.awake_writes, choice.sync_writes) == (6, 2 * BACKOFF_WRITES + 1)


def _aligned(nbytes: int, seed: int) -> np.ndarray:
    array = np.frombuffer(mmap.mmap(-1, nbytes), dtype=np.uint8)
    array[:] = np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)
    return array


def test_a_tier_whose_spins_run_out_writes_synchronously_and_reads_back_exact(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 1 us spin budget: a small store's spin soon runs out (a 64 KiB device
    write outlasts it, unless the hypervisor finished it inside ``io_submit``), and
    every small store after that goes synchronously; every block reads back
    exact, also after a reopen."""
    monkeypatch.setattr(aio_module, "SPIN_US", 1)
    path = str(tmp_path / "tier")
    tier = SsdTier(path, 8 << 20, make_policy("lru"))
    slots = [_aligned(64 << 10, i) for i in range(32)]
    try:
        for i, slot in enumerate(slots):
            assert tier.store(i.to_bytes(16, "big"), slot, slot.nbytes, None) is not None
        wait = tier.write_wait()
        if not wait["spin_us"]:
            pytest.skip("small writes are not waited for awake here (no AIO ring)")
        if wait["spin_timeouts"] == 0:
            pytest.skip("the device finished every 64 KiB write within 1 us")
        # awake up to the first timeout, synchronous after it (fewer than BACKOFF_WRITES)
        assert wait["spin_timeouts"] == 1
        assert wait["awake_writes"] == wait["spin_ready"] + 1
        assert wait["sync_writes"] == len(slots) - wait["awake_writes"]
    finally:
        tier.close()
    tier = SsdTier(path, 8 << 20, make_policy("lru"))
    try:
        records = dict(tier.load_records())
        for i, slot in enumerate(slots):
            out = _aligned(64 << 10, 1000)
            assert tier.read_into(records[i.to_bytes(16, "big")], out)
            assert np.array_equal(out, slot)
    finally:
        tier.close()

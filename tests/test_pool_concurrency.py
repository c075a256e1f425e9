"""Two-phase writes, reader pins, thread safety, and crash safety of the SSD tier."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
from poolhelpers import BLOCK, make_keys, payload

import kvpool.embedded.blocks as blocks_module
import kvpool.embedded.pool as pool_module
import kvpool.embedded.reservations as reservations_module
from kvpool import Pool, PoolFullError


@pytest.fixture
def gated_copy(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[Any], threading.Event]]:
    """Make copies whose source or destination is a chosen buffer wait on an event."""
    gates: list[tuple[int, threading.Event, threading.Event]] = []
    real_copy = reservations_module.copy_region

    def copy(dst: Any, src: Any) -> None:
        for address, entered, release in gates:
            if address in (dst.ctypes.data, src.ctypes.data):
                entered.set()
                assert release.wait(10)
        real_copy(dst, src)

    def gate(buffer: np.ndarray) -> threading.Event:
        entered, release = threading.Event(), threading.Event()
        gates.append((buffer.ctypes.data, entered, release))
        gate.entered = entered  # type: ignore[attr-defined]
        return release

    monkeypatch.setattr(pool_module, "copy_region_out", copy)  # reads
    for module in (reservations_module, blocks_module):  # writes, moves
        monkeypatch.setattr(module, "copy_region", copy)
    # small puts copy by slice assignment, not through the seam: send them through it
    monkeypatch.setattr(reservations_module, "LOCKED_COPY_MAX", 0)
    yield gate


def test_a_block_is_invisible_until_its_copy_commits(
    pool: Pool, gated_copy: Callable[[Any], threading.Event]
) -> None:
    key = make_keys(1)[0]
    data = payload(3)
    release = gated_copy(data)
    writer = threading.Thread(target=pool.put, args=(key, data))
    writer.start()
    assert gated_copy.entered.wait(5)  # type: ignore[attr-defined]
    assert pool.exists([key]) == [False]
    assert pool.prefix_match([key]) == 0
    assert pool.get(key) is None
    assert pool.put(key, b"other") is False  # a concurrent put of the same key is a no-op
    release.set()
    writer.join(5)
    assert pool.get(key) == data.tobytes()


def test_failed_copy_frees_its_allocation(pool: Pool, monkeypatch: pytest.MonkeyPatch) -> None:
    key = make_keys(1)[0]

    def broken(dst: Any, src: Any) -> None:
        raise RuntimeError("device lost")

    monkeypatch.setattr(reservations_module, "copy_region", broken)  # the put path
    monkeypatch.setattr(reservations_module, "LOCKED_COPY_MAX", 0)  # small puts through it too
    with pytest.raises(RuntimeError, match="device lost"):
        pool.put(key, payload(0))
    monkeypatch.undo()
    assert pool.exists([key]) == [False]
    assert pool.stats()["tiers"]["dram"]["used_bytes"] == 0
    assert pool.put(key, payload(0))


def test_a_pinned_block_survives_eviction_and_removal(
    gated_copy: Callable[[Any], threading.Event],
) -> None:
    keys = make_keys(6)
    with Pool.embedded(dram_bytes=2 * BLOCK) as pool:
        pool.put(keys[0], payload(0))
        pool.put(keys[1], payload(1))
        out = np.empty(BLOCK, np.uint8)
        release = gated_copy(out)
        reader = threading.Thread(target=pool.get_into, args=(keys[0], out))
        reader.start()
        assert gated_copy.entered.wait(5)  # type: ignore[attr-defined]
        pool.put(keys[2], payload(2))  # must evict 1, not the pinned 0
        assert pool.exists(keys[:3]) == [True, False, True]
        with pytest.raises(PoolFullError):  # 0 pinned, 2 evicted, still no room for 2 blocks
            pool.put(keys[3], payload(3, 2 * BLOCK))
        assert pool.remove(keys[0])  # hidden at once, freed after the read
        assert pool.exists([keys[0]]) == [False]
        assert pool.stats()["tiers"]["dram"]["used_bytes"] == BLOCK
        release.set()
        reader.join(5)
        assert np.array_equal(out, payload(0))
        assert pool.stats()["tiers"]["dram"]["used_bytes"] == 0


def test_close_waits_for_in_flight_reads(gated_copy: Callable[[Any], threading.Event]) -> None:
    key = make_keys(1)[0]
    pool = Pool.embedded(dram_bytes=2 * BLOCK)
    pool.put(key, payload(0))
    out = np.empty(BLOCK, np.uint8)
    release = gated_copy(out)
    reader = threading.Thread(target=pool.get_into, args=(key, out))
    reader.start()
    assert gated_copy.entered.wait(5)  # type: ignore[attr-defined]
    closer = threading.Thread(target=pool.close)
    closer.start()
    time.sleep(0.1)
    assert closer.is_alive()  # blocked on the reader
    release.set()
    reader.join(5)
    closer.join(5)
    assert not closer.is_alive()
    assert np.array_equal(out, payload(0))


def test_threads_hammering_one_pool_get_exact_bytes(tmp_path: object) -> None:
    keys = make_keys(40)
    errors: list[BaseException] = []
    with Pool.embedded(dram_bytes=8 * BLOCK, ssd_path=str(tmp_path), ssd_bytes=64 * BLOCK) as pool:

        def worker(seed: int) -> None:
            rng = np.random.default_rng(seed)
            out = np.empty(BLOCK, np.uint8)
            try:
                for _ in range(150):
                    i = int(rng.integers(len(keys)))
                    if rng.random() < 0.5:
                        pool.put(keys[i], payload(i))
                    elif pool.get_into(keys[i], out) is not None:
                        assert np.array_equal(out, payload(i)), f"wrong bytes for block {i}"
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors, errors
        stats = pool.stats()
        used = sum(t["used_bytes"] for t in stats["tiers"].values())
        assert used == stats["blocks"] * BLOCK


WRITER = textwrap.dedent(
    """
    import sys, numpy as np
    sys.path.insert(0, {tests!r})
    from poolhelpers import BLOCK, make_keys, payload
    from kvpool import Pool
    keys = make_keys(400)
    pool = Pool.embedded(dram_bytes=2 * BLOCK, ssd_path={path!r}, ssd_bytes=300 * BLOCK)
    print("ready", flush=True)
    while True:
        for i, key in enumerate(keys):
            pool.put(key, payload(i))
            pool.remove(keys[(i + 150) % len(keys)])
    """
)


def test_kill_9_during_writes_leaves_only_complete_blocks(tmp_path: object) -> None:
    path = str(tmp_path)
    tests_dir = os.path.dirname(__file__)
    proc = subprocess.Popen(
        [sys.executable, "-c", WRITER.format(tests=tests_dir, path=path)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        time.sleep(1.5)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    keys = make_keys(400)
    with Pool.embedded(dram_bytes=2 * BLOCK, ssd_path=path, ssd_bytes=300 * BLOCK) as pool:
        present = [i for i, ok in enumerate(pool.exists(keys)) if ok]
        assert present, "the writer should have demoted blocks before it was killed"
        out = np.empty(BLOCK, np.uint8)
        for i in present:
            assert pool.get_into(keys[i], out) == BLOCK
            assert np.array_equal(out, payload(i)), f"block {i} is not what was written"
        assert pool.stats()["corrupt_dropped"] == 0
    # The dead writer's arena was swept from /dev/shm when this pool started.
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"kvpool-{proc.pid}-")]

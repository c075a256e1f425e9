"""The seal file's doorbell as a futex (kvpool.transport.shm_doorbell), on real mappings.

The node's commit thread sleeps on the doorbell; a same-host writer's ring wakes
it, from another process. The proofs: a ring pending before the wait returns at
once; a wait is woken by a writer process's ring, and by the node's own hurry; no
ring is lost when rings race the thread's clear-then-wait, thousands of times; a
writer that cannot ring a futex makes the node poll (``rings_wake`` False).
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from typing import Any

import pytest

from kvpool.transport import shm_doorbell
from kvpool.transport.shm_doorbell import HURRY, SLEEPING_WORD, WRITER
from kvpool.transport.shm_seal import SealRecords

pytestmark = pytest.mark.skipif(
    not shm_doorbell.AVAILABLE, reason="kvpool.transport._shm_copy not built: the node polls"
)
PAGE = 4096


@pytest.fixture
def seals(tmp_path: Any) -> Any:
    """(the node's seal file, a writer's mapping of it)."""
    path = str(tmp_path / "arena.seal")
    node = SealRecords(path, 16 * PAGE, create=True, node_commits=True)
    writer = SealRecords(path, 16 * PAGE, create=False)
    yield node, writer
    writer.close()
    node.close()


def _timed_wait(node: SealRecords, timeout_s: float) -> float:
    began = time.monotonic()
    node.wait_ring(timeout_s)
    return time.monotonic() - began


def test_a_wait_with_no_ring_lasts_its_timeout_and_a_pending_ring_ends_it_at_once(
    seals,
) -> None:
    node, writer = seals
    assert node.rings_wake
    assert 0.09 <= _timed_wait(node, 0.1) < 2.0
    assert node.rung() == 0
    shm_doorbell.ring(writer.mapping)
    assert _timed_wait(node, 30.0) < 1.0  # rung before the wait
    assert node.rung() == WRITER and node.rung() == 0


def _ring_from_another_process(path: str, after_s: float) -> subprocess.Popen[bytes]:
    code = (
        "import sys, time\n"
        "from kvpool.transport import shm_doorbell\n"
        "from kvpool.transport.shm_seal import SealRecords\n"
        "w = SealRecords(sys.argv[1], int(sys.argv[2]), create=False)\n"
        "time.sleep(float(sys.argv[3]))\n"
        "shm_doorbell.ring(w.mapping)\n"
    )
    args = [sys.executable, "-c", code, path, str(16 * PAGE), str(after_s)]
    return subprocess.Popen(args)


def test_a_wait_is_woken_by_a_writer_process(seals) -> None:
    node, writer = seals
    ringer = _ring_from_another_process(writer.path, 0.3)
    took = _timed_wait(node, 60.0)
    assert ringer.wait(30) == 0
    assert took < 10.0  # the ring woke it: the wait was a minute
    assert node.rung() == WRITER
    with memoryview(writer.mapping).cast("Q") as words:
        assert words[SLEEPING_WORD] == 0  # it said it is awake again


def test_a_wait_is_woken_by_the_nodes_own_hurry(seals) -> None:
    node, _ = seals
    threading.Timer(0.05, node.hurry).start()
    assert _timed_wait(node, 60.0) < 10.0
    assert node.rung() == HURRY


def test_no_ring_is_lost_between_the_clear_and_the_wait(seals) -> None:
    """The node's loop -- clear, look, sleep -- against a writer thread ringing
    at random moments: every ring ends a wait long before its (long) timeout."""
    node, writer = seals
    rings, seen = 2000, 0
    taken, done = threading.Event(), threading.Event()
    taken.set()

    def ring() -> None:
        for i in range(rings):
            assert taken.wait(30)  # one ring at a time: each must be seen
            taken.clear()
            if i % 7 == 0:
                time.sleep(0.0001)
            shm_doorbell.ring(writer.mapping)
        done.set()

    threading.Thread(target=ring, daemon=True).start()
    began = time.monotonic()
    while seen < rings:
        if node.rung():
            seen += 1
            taken.set()
            continue
        assert _timed_wait(node, 5.0) < 4.0, f"ring {seen + 1} was lost"
        assert time.monotonic() - began < 120
    assert done.wait(10) and seen == rings


def test_a_writer_that_cannot_ring_a_futex_makes_the_node_poll(tmp_path, monkeypatch) -> None:
    path = str(tmp_path / "arena.seal")
    node = SealRecords(path, 16 * PAGE, create=True, node_commits=True)
    assert node.rings_wake
    monkeypatch.setattr(shm_doorbell, "AVAILABLE", False)  # a writer's install without it
    writer = SealRecords(path, 16 * PAGE, create=False)
    monkeypatch.setattr(shm_doorbell, "AVAILABLE", True)
    assert not node.rings_wake
    writer.close()
    node.close()


def test_a_buffer_that_is_no_seal_file_is_refused() -> None:
    """Ringing or waiting takes only a writable mapping at least a seal header long:
    a short buffer is a ``ValueError``, a read-only one a ``BufferError``; nothing is
    written to either."""
    short, read_only = bytearray(64), b"\0" * 4096
    with pytest.raises(ValueError, match="not a seal file"):
        shm_doorbell.ring(short)
    with pytest.raises(ValueError, match="not a seal file"):
        shm_doorbell.wait(short, 0.0)
    for call in (lambda: shm_doorbell.ring(read_only), lambda: shm_doorbell.wait(read_only, 0.0)):
        with pytest.raises((BufferError, TypeError)):
            call()
    assert short == bytearray(64) and read_only == b"\0" * 4096

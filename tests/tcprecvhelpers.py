"""The compiled ``kvpool.transport._tcp_recv`` for tests that call it directly, and a
peer that sends in pieces."""

from __future__ import annotations

import contextlib
import importlib
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

try:
    native = importlib.import_module("kvpool.transport._tcp_recv")
except ImportError as exc:
    native, WHY = None, f"kvpool.transport._tcp_recv not built: {exc}"
else:
    WHY = ""
#: Skip a test of the compiled module where it was not built (and say why).
needs_native = pytest.mark.skipif(native is None, reason=WHY)


def send_in_pieces(sock: socket.socket, data: bytes, pieces: int, pause: float) -> None:
    """Send ``data`` in ``pieces`` sends, ``pause`` seconds after each."""
    step = -(-len(data) // pieces)
    for at in range(0, len(data), step):
        sock.sendall(data[at : at + step])
        time.sleep(pause)


@contextlib.contextmanager
def pause_rule(long_yield_us: int, first_pause_ms: float, max_pause_ms: float) -> Iterator[None]:
    """The native spin's pause rule set for a block, the defaults (and no pause in
    force) after it."""
    from kvpool.transport import tcp_recv

    tcp_recv.set_pause(long_yield_us, first_pause_ms, max_pause_ms)
    try:
        yield
    finally:
        tcp_recv.set_pause(tcp_recv.LONG_YIELD_US, tcp_recv.FIRST_PAUSE_MS, tcp_recv.MAX_PAUSE_MS)


@contextlib.contextmanager
def busy_co_runner(cpu: int) -> Iterator[None]:
    """A process that keeps ``cpu`` busy (a tight loop pinned there) for a block."""
    hog = subprocess.Popen(
        [sys.executable, "-c", f"import os\nos.sched_setaffinity(0, {{{cpu}}})\nwhile True: pass"]
    )
    try:
        time.sleep(0.2)  # started and pinned
        yield
    finally:
        hog.kill()
        hog.wait()

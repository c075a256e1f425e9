"""The compiled ``kvpool.transport._tcp_recv`` for tests that call it directly, and a
peer that sends in pieces."""

from __future__ import annotations

import importlib
import socket
import time

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

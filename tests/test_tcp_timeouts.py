"""TCP data path inactivity timeouts: a stuck node costs a caller at most ``timeout``.

The client keeps its sockets blocking and lets the kernel time calls out
(SO_RCVTIMEO / SO_SNDTIMEO, see ``kvpool.transport.tcp_conn``); these tests
prove a silent peer still surfaces as ``CallTimeoutError`` within the bound,
at the handshake and in the middle of a read or a write.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest

from kvpool.errors import CallTimeoutError
from kvpool.transport import tcp_wire as w
from kvpool.transport.base import RegionInfo
from kvpool.transport.tcp import TcpTransport

TIMEOUT = 0.5


def _stuck_node(answer_hello: bool) -> Iterator[RegionInfo]:
    """A listener that accepts, optionally completes the handshake, then never answers."""
    listener = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []

    def serve() -> None:
        while True:
            try:
                sock, _ = listener.accept()
            except OSError:
                return
            held.append(sock)
            if answer_hello:
                head = sock.recv(w.HELLO.size)
                assert head[:4] == w.MAGIC
                sock.sendall(w.HELLO_REPLY.pack(w.MAGIC, w.ST_OK, 0))

    threading.Thread(target=serve, daemon=True).start()
    port = listener.getsockname()[1]
    yield RegionInfo("stuck", 64 << 20, "h", "127.0.0.1", port, "")
    listener.close()
    for sock in held:
        sock.close()


@pytest.fixture
def silent() -> Iterator[RegionInfo]:
    yield from _stuck_node(answer_hello=False)


@pytest.fixture
def stalls() -> Iterator[RegionInfo]:
    yield from _stuck_node(answer_hello=True)


def _times_out(fn: object, *args: object) -> float:
    t0 = time.monotonic()
    with pytest.raises(CallTimeoutError):
        fn(*args)  # type: ignore[operator]
    return time.monotonic() - t0


def test_handshake_with_a_silent_peer_times_out(silent: RegionInfo) -> None:
    t = TcpTransport(silent, timeout=TIMEOUT)
    assert TIMEOUT * 0.8 < _times_out(t.read_into, 0, bytearray(16)) < TIMEOUT + 2


def test_a_read_the_node_never_answers_times_out(stalls: RegionInfo) -> None:
    with TcpTransport(stalls, timeout=TIMEOUT) as t:
        assert TIMEOUT * 0.8 < _times_out(t.read_into, 0, np.empty(1 << 20, np.uint8)) < TIMEOUT + 2


def test_a_write_the_node_never_drains_times_out(stalls: RegionInfo) -> None:
    data = np.ones(48 << 20, np.uint8)  # more than both kernel buffers hold
    with TcpTransport(stalls, timeout=TIMEOUT) as t:
        assert _times_out(t.write, 0, data) < TIMEOUT * 4 + 2


def test_data_sockets_stay_blocking(stalls: RegionInfo) -> None:
    """The fast read path depends on it (no poll before every recv)."""
    from kvpool.transport.tcp_conn import DataConn

    conn = DataConn("127.0.0.1", stalls.tcp_port, None, TIMEOUT)
    try:
        assert conn.sock.gettimeout() is None
        assert conn.sock.getblocking()
    finally:
        conn.close()

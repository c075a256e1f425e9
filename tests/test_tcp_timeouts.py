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

from kvpool.cluster.block_table import BlockTable
from kvpool.errors import CallTimeoutError
from kvpool.transport import tcp_wire as w
from kvpool.transport.base import RegionInfo
from kvpool.transport.fencing import FENCE_OK, IDENT, WriteStamp
from kvpool.transport.tcp import TcpTransport
from kvpool.transport.tcp_conn import DataConn
from kvpool.transport.tcp_server import TcpDataServer

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


def test_a_checked_read_the_node_never_answers_times_out(stalls: RegionInfo) -> None:
    """The single checked read (its own inline borrow of a connection) maps the
    kernel timeout like every other op, and drops the connection it used."""
    with TcpTransport(stalls, timeout=TIMEOUT) as t:
        out = np.empty(64 << 10, np.uint8)
        assert TIMEOUT * 0.8 < _times_out(t.read_block, 0, 0, out, bytes(16)) < TIMEOUT + 2
        assert not t._idle and t._open == 0  # closed, not lent out again


def test_a_write_the_node_never_drains_times_out(stalls: RegionInfo) -> None:
    data = np.ones(48 << 20, np.uint8)  # more than both kernel buffers hold
    with TcpTransport(stalls, timeout=TIMEOUT) as t:
        assert _times_out(t.write, 0, data) < TIMEOUT * 4 + 2


def test_data_sockets_stay_blocking(stalls: RegionInfo) -> None:
    """The fast read path depends on it (no poll before every recv)."""
    conn = DataConn("127.0.0.1", stalls.tcp_port, None, TIMEOUT)
    try:
        assert conn.sock.gettimeout() is None
        assert conn.sock.getblocking()
    finally:
        conn.close()


# -- the node's end: its data server drops a stalled peer, keeps an idle one -------------

NODE_TIMEOUT = 0.3
EPOCH = 2


@pytest.fixture
def node_with_a_block() -> Iterator[tuple[BlockTable, TcpDataServer, np.ndarray, WriteStamp]]:
    """A data server (write_timeout 0.3 s) whose table holds one sealed 48 MiB block:
    more than the kernel's send and receive buffers together, so a reader that stops
    reading leaves the server's send stuck mid-block."""
    region = np.arange(64 << 20, dtype=np.uint64).view(np.uint8)[: 64 << 20].copy()
    fence = BlockTable(lambda offset, size: 1, claim_wait=5.0)
    fence.new_term(EPOCH)
    block = WriteStamp(EPOCH, 1, 0, 48 << 20, b"\x01" * 16)
    writer = object()
    assert fence.claim(block, writer) == FENCE_OK
    assert fence.finish(block, writer, ok=True, seal=True) == FENCE_OK
    server = TcpDataServer(region, fence=fence, write_timeout=NODE_TIMEOUT)
    server.start()
    yield fence, server, region, block
    server.close()


def test_a_reader_that_stops_reading_loses_its_hold_on_the_block(node_with_a_block) -> None:
    """A client stopped mid-read (SIGSTOP, a hung process) must not keep the block
    held for ever: the node gives up after write_timeout without progress, and a newer
    allocation of the range can then claim it."""
    fence, server, _, block = node_with_a_block
    conn = DataConn("127.0.0.1", server.address[1], None, 5.0, server.instance)
    try:
        request = w.REQ.pack(w.OP_READ_BLOCK, 0, 1, 0, block.size)
        conn.sock.sendall(request + IDENT.pack(block.key, 0))  # ... and never read the reply
        time.sleep(0.05)  # the server is sending now
        t0 = time.monotonic()
        newer = WriteStamp(EPOCH, 2, 0, block.size, b"\x02" * 16)
        assert fence.claim(newer, object()) == FENCE_OK  # waits for the dropped read only
        assert time.monotonic() - t0 < NODE_TIMEOUT + 3
    finally:
        conn.close()


def test_an_idle_client_keeps_its_connection_past_write_timeout(node_with_a_block) -> None:
    _, server, region, block = node_with_a_block
    conn = DataConn("127.0.0.1", server.address[1], None, 5.0, server.instance)
    try:
        out = np.empty(1 << 20, np.uint8)
        assert conn.read_block(0, out, IDENT.pack(block.key, 0))
        time.sleep(NODE_TIMEOUT * 3)  # idle: several of the server's timeouts pass
        out[:] = 0
        assert conn.read_block(0, out, IDENT.pack(block.key, 0))  # the same socket
        assert np.array_equal(out, region[: 1 << 20])
    finally:
        conn.close()

"""TCP data protocol v3: every ok READ payload starts at a 64-byte-aligned stream offset.

A raw socket speaks the wire format to a real data server (loopback) and
checks the bytes exactly as they arrive: the pad after each READ header,
the header's copy of it, and the payload's position in the stream, across
odd sizes, an error reply and WRITE replies in between.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator

import numpy as np
import pytest

from kvpool.transport import tcp_wire as w
from kvpool.transport.base import RegionInfo
from kvpool.transport.tcp import TcpTransport
from kvpool.transport.tcp_server import TcpDataServer

REGION = 1 << 20


@pytest.fixture
def server() -> Iterator[TcpDataServer]:
    region = np.resize(np.arange(251, dtype=np.uint8), REGION)
    with TcpDataServer(region) as srv:
        srv.start()
        yield srv


class _Stream:
    """A raw client that keeps every byte it received, to check stream offsets."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=5)
        self.data = bytearray()
        self.sock.sendall(w.hello(None))
        magic, status, n = w.HELLO_REPLY.unpack(self.take(w.HELLO_REPLY.size))
        assert (magic, status) == (w.MAGIC, w.ST_OK)
        self.take(n)

    def take(self, n: int) -> bytes:
        out = bytearray()
        while len(out) < n:
            chunk = self.sock.recv(n - len(out))
            assert chunk, "server closed"
            out += chunk
        self.data += out
        return bytes(out)

    def read(self, rid: int, offset: int, length: int) -> tuple[int, bytes]:
        """(stream offset of the payload, payload) of an ok READ."""
        self.sock.sendall(w.REQ.pack(w.OP_READ, rid, offset, length))
        status, pad, got_rid, n = w.READ_RESP.unpack(self.take(w.RESP.size))
        assert (status, got_rid, n) == (w.ST_OK, rid, length)
        assert pad == w.read_pad(len(self.data) - w.RESP.size) and 0 <= pad < w.ALIGN
        assert self.take(pad) == bytes(pad)
        start = len(self.data)
        return start, self.take(length)


def _expected(offset: int, n: int) -> bytes:
    return np.resize(np.roll(np.arange(251, dtype=np.uint8), -(offset % 251)), n).tobytes()


def test_read_pad_arithmetic() -> None:
    for sent in range(0, 300):
        pad = w.read_pad(sent)
        assert 0 <= pad < w.ALIGN and (sent + w.RESP.size + pad) % w.ALIGN == 0


def test_every_payload_is_aligned_in_the_stream(server: TcpDataServer) -> None:
    s = _Stream(server.address[1])
    try:
        for rid, (offset, n) in enumerate([(0, 3), (5, 1000), (7, 65_537), (0, 1), (11, 4096)]):
            start, payload = s.read(rid, offset, n)
            assert start % w.ALIGN == 0
            assert payload == _expected(offset, n)
        # A WRITE reply (header only) and a READ error (header + message, no pad)
        # shift the stream; the next READ is still aligned.
        s.sock.sendall(w.REQ.pack(w.OP_WRITE, 90, 0, 5) + b"abcde")
        assert w.RESP.unpack(s.take(w.RESP.size)) == (w.ST_OK, 90, 0)
        s.sock.sendall(w.REQ.pack(w.OP_READ, 91, REGION, 9))
        status, rid, n = w.RESP.unpack(s.take(w.RESP.size))
        assert (status, rid) == (w.ST_RANGE, 91) and b"outside" in s.take(n)
        start, payload = s.read(92, 0, 10)
        assert start % w.ALIGN == 0 and payload == b"abcde" + _expected(5, 5)
    finally:
        s.sock.close()


def test_the_client_reads_odd_sizes_pipelined_and_after_errors(server: TcpDataServer) -> None:
    host, port = server.address
    info = RegionInfo("n", REGION, "h", host, port, "", tcp_instance=server.instance)
    sizes = [1, 17, 63, 64, 65, 4095, 65_537]
    with TcpTransport(info, timeout=5) as t:
        outs = [np.empty(n, np.uint8) for n in sizes]
        t.read_many([(i * 3, out) for i, out in enumerate(outs)])
        for i, out in enumerate(outs):
            assert out.tobytes() == _expected(i * 3, out.nbytes)
        for n in sizes:  # one connection, many single reads: the pad follows the stream
            out = np.empty(n, np.uint8)
            t.read_into(n, out)
            assert out.tobytes() == _expected(n, n)

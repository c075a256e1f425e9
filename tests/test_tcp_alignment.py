"""TCP data protocol v4: every READ and WRITE payload starts at a 64-byte-aligned
offset of its stream.

A raw socket speaks the wire format to a real data server (loopback) and
checks the bytes exactly as they arrive: the pad after each READ header,
the header's copy of it, and the payload's position in the stream, across
odd sizes, an error reply and WRITE replies in between. In the other
direction the raw client pads its WRITEs itself; the server refuses a wrong
pad, so the real client's writes (plain, pipelined, stamped, refused stale)
succeeding against it proves they are aligned.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator

import numpy as np
import pytest

from kvpool.cluster.block_table import BlockTable
from kvpool.transport import tcp_wire as w
from kvpool.transport.base import RegionInfo
from kvpool.transport.fencing import WriteStamp
from kvpool.transport.tcp import TcpTransport
from kvpool.transport.tcp_conn import DataConn
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
        self.sent = 0
        self.send(w.hello(None))
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

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)
        self.sent += len(data)

    def write(self, op: int, rid: int, offset: int, payload: bytes, stamp: bytes = b"") -> int:
        """Send a payload-carrying request padded as the protocol says; the
        payload's offset in the stream the client sent."""
        pad = w.write_pad(self.sent + w.REQ.size + len(stamp))
        self.send(w.REQ.pack(op, pad, rid, offset, len(payload)) + stamp + bytes(pad))
        start = self.sent
        self.send(payload)
        return start

    def read(self, rid: int, offset: int, length: int) -> tuple[int, bytes]:
        """(stream offset of the payload, payload) of an ok READ."""
        self.send(w.REQ.pack(w.OP_READ, 0, rid, offset, length))
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
        assert s.write(w.OP_WRITE, 90, 0, b"abcde") % w.ALIGN == 0
        assert w.RESP.unpack(s.take(w.RESP.size)) == (w.ST_OK, 90, 0)
        s.send(w.REQ.pack(w.OP_READ, 0, 91, REGION, 9))
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


def test_pipelined_request_ids_wrap_at_32_bits(server: TcpDataServer) -> None:
    """Request ids are 32-bit on the wire: a pipeline that crosses 2**32 - 1 numbers
    its requests 2**32 - 2, 2**32 - 1, 0, 1, ... and matches each reply to its own."""
    host, port = server.address
    conn = DataConn(host, port, None, 5.0, server.instance)
    try:
        conn._rid = 0xFFFFFFFF - 2  # white-box: start three ids short of the wrap
        outs = [np.empty(n, np.uint8) for n in (64, 65, 4095, 1, 17)]
        conn.read_many([(i * 7, out) for i, out in enumerate(outs)])
        for i, out in enumerate(outs):
            assert out.tobytes() == _expected(i * 7, out.nbytes)
        assert conn._rid == 2
        one = np.empty(100, np.uint8)
        conn.read_one(5, one)  # the next single read follows on from the wrapped ids
        assert one.tobytes() == _expected(5, 100)
    finally:
        conn.close()


def test_write_pad_arithmetic() -> None:
    for sent in range(0, 300):
        pad = w.write_pad(sent)
        assert 0 <= pad < w.ALIGN and (sent + pad) % w.ALIGN == 0


def test_padded_writes_of_odd_sizes_land_exactly(server: TcpDataServer) -> None:
    s = _Stream(server.address[1])
    try:
        rng = np.random.default_rng(1)
        for rid, (offset, n) in enumerate([(3, 1), (100, 63), (7, 65), (4096, 65_537), (0, 24)]):
            payload = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
            assert s.write(w.OP_WRITE, rid, offset, payload) % w.ALIGN == 0
            assert w.RESP.unpack(s.take(w.RESP.size)) == (w.ST_OK, rid, 0)
            assert s.read(100 + rid, offset, n)[1] == payload
            assert bytes(server.region[offset : offset + n]) == payload
    finally:
        s.sock.close()


def test_a_write_with_the_wrong_pad_is_refused_and_the_stream_closed(
    server: TcpDataServer,
) -> None:
    s = _Stream(server.address[1])
    try:
        s.read(1, 0, 3)  # shifts the client's stream by a 24-byte request
        s.read(2, 0, 1)
        pad = (w.write_pad(s.sent + w.REQ.size) + 8) % w.ALIGN
        s.send(w.REQ.pack(w.OP_WRITE, pad, 3, 0, 5) + bytes(pad) + b"vwxyz")
        status, rid, n = w.RESP.unpack(s.take(w.RESP.size))
        assert (status, rid) == (w.ST_BAD_OP, 3) and b"out of sync" in s.take(n)
        assert s.sock.recv(1) == b""  # closed: nothing after the refusal is trusted
        assert bytes(server.region[:5]) != b"vwxyz"
    finally:
        s.sock.close()


def test_the_client_writes_odd_sizes_single_and_pipelined(server: TcpDataServer) -> None:
    host, port = server.address
    info = RegionInfo("n", REGION, "h", host, port, "", tcp_instance=server.instance)
    rng = np.random.default_rng(2)
    sizes = [1, 17, 63, 64, 65, 4095, 65_537]
    with TcpTransport(info, timeout=5, max_connections=1) as t:
        for n in sizes:  # one connection: every pad follows what was sent before
            data = rng.integers(0, 256, n, dtype=np.uint8)
            t.write(n * 3, data)
            out = np.empty(n, np.uint8)
            t.read_into(n * 3, out)
            assert np.array_equal(out, data)
        datas = [rng.integers(0, 256, n, dtype=np.uint8) for n in sizes]
        t.write_many([(i * 70_000, d) for i, d in enumerate(datas)])
        for i, d in enumerate(datas):
            assert np.array_equal(server.region[i * 70_000 : i * 70_000 + d.nbytes], d)


def test_a_refused_stale_write_consumes_exactly_its_bytes() -> None:
    """The fence refuses a stale stamped write: the server drains its pad and
    payload, no more and no less, so the next padded request on the same stream
    is read in sync (a wrong count would garble its header or pad check)."""
    region = np.zeros(1 << 16, np.uint8)
    fence = BlockTable(lambda offset, size: offset + size + 1, claim_wait=0.2)
    fence.new_term(3)
    key_new, key_old = b"\x02" * 16, b"\x01" * 16
    with TcpDataServer(region, fence=fence) as srv:
        srv.start()
        s = _Stream(srv.address[1])
        try:
            new = WriteStamp(3, 20, 0, 4099, key_new).pack()
            assert s.write(w.OP_WRITE_FINAL, 1, 0, b"n" * 4099, new) % w.ALIGN == 0
            assert w.RESP.unpack(s.take(w.RESP.size)) == (w.ST_OK, 1, 0)
            stale = WriteStamp(3, 10, 0, 4099, key_old).pack()  # an older allocation
            s.write(w.OP_WRITE_FINAL, 2, 0, b"s" * 4099, stale)
            status, rid, n = w.RESP.unpack(s.take(w.RESP.size))
            assert (status, rid) == (w.ST_STALE, 2)
            s.take(n)
            part = WriteStamp(3, 30, 8192, 77, key_old).pack()
            s.write(w.OP_WRITE_FINAL, 3, 8192, b"p" * 77, part)
            assert w.RESP.unpack(s.take(w.RESP.size)) == (w.ST_OK, 3, 0)
            assert bytes(region[:4099]) == b"n" * 4099
            assert bytes(region[8192 : 8192 + 77]) == b"p" * 77
        finally:
            s.sock.close()

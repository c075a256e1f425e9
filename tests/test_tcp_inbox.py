"""The data server's buffered requests (kvpool.transport.tcp_inbox) and the
batches of checked reads it answers with one gather send (tcp_server)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import pytest

from kvpool.cluster.block_table import BlockTable
from kvpool.errors import ConnectionLostError
from kvpool.transport import tcp_checked_reads
from kvpool.transport import tcp_wire as w
from kvpool.transport.base import RegionInfo
from kvpool.transport.fencing import FENCE_OK, IDENT, WriteStamp
from kvpool.transport.tcp import TcpTransport
from kvpool.transport.tcp_checked_reads import GATHER_MAX
from kvpool.transport.tcp_conn import DataConn
from kvpool.transport.tcp_inbox import Inbox
from kvpool.transport.tcp_server import TcpDataServer

EPOCH = 3


def test_take_spans_recvs_and_hands_out_bytes_once_in_order() -> None:
    a, b = socket.socketpair()
    with a, b:
        inbox = Inbox(b, size=100)
        a.sendall(bytes(range(10)))
        assert inbox.recv_more() == 10
        assert bytes(inbox.buf[inbox.take(4) :][:4]) == bytes(range(4))
        sender = threading.Thread(
            target=lambda: (time.sleep(0.05), a.sendall(bytes(range(10, 200))))
        )
        sender.start()
        at = inbox.take(100)  # 6 buffered, the rest from later recvs (room made behind)
        assert bytes(inbox.buf[at : at + 100]) == bytes(range(4, 104))
        sender.join()
        pad, payload = bytearray(3), bytearray(90)  # buffered part first, then the socket
        inbox.read_into(memoryview(pad), memoryview(payload))
        assert bytes(pad) == bytes(range(104, 107)) and bytes(payload) == bytes(range(107, 197))
        inbox.discard(3)
        assert inbox.buffered == 0
        a.sendall(b"\x01\x02\x03\x04\x05")
        inbox.discard(2)  # from the socket when nothing is buffered
        assert inbox.recv_more() == 3 and bytes(inbox.buf[inbox.take(3) :][:3]) == b"\x03\x04\x05"
        a.sendall(b"xy")
        a.shutdown(socket.SHUT_WR)
        with pytest.raises(ConnectionLostError):
            inbox.take(5)  # the peer hung up mid-request
        assert inbox.recv_more() == 0  # and at a request boundary: 0


@pytest.fixture
def served():
    region = np.zeros(1 << 20, np.uint8)
    fence = BlockTable(lambda offset, size: 1, claim_wait=0.2)
    fence.new_term(EPOCH)
    server = TcpDataServer(region, fence=fence)
    server.start()
    info = RegionInfo("n", region.nbytes, tcp_host="127.0.0.1", tcp_port=server.address[1])
    info.tcp_instance = server.instance
    yield server, fence, info
    server.close()


def key(i: int) -> bytes:
    return i.to_bytes(16, "big")


@pytest.mark.usefixtures("checked_read_path")
@pytest.mark.parametrize("gather_bytes", [None, 8192], ids=["default", "byte-capped"])
def test_pipelined_writes_and_reads_of_every_size_stay_in_sync(
    served, monkeypatch, gather_bytes: int | None
) -> None:
    """Writes whose header and payload share a recv (payload copied out of the
    buffer), writes that span recvs, then checked-read batches larger than one
    gather (GATHER_MAX requests; byte-capped: GATHER_BYTES, so gathers of one to a
    few reads), a stale read in the middle: every byte where it belongs, and every
    block the batches held is free again after them (a newer claim is granted)."""
    if gather_bytes is not None:
        monkeypatch.setattr(tcp_checked_reads, "GATHER_BYTES", gather_bytes)
    server, fence, info = served
    sizes = [100, 4096, 5000, 64, 70000, 1, 3000] * 3
    offsets, blocks, at = [], [], 0
    rng = np.random.default_rng(7)
    for n in sizes:
        offsets.append(at)
        blocks.append(rng.integers(0, 256, n, dtype=np.uint8))
        at += -(-n // 64) * 64
    conn = DataConn("127.0.0.1", info.tcp_port, None, 5.0, info.tcp_instance)
    try:
        plan = [
            (w.OP_WRITE_FINAL, WriteStamp(EPOCH, i + 1, off, len(b), key(i)).pack(), off, b)
            for i, (off, b) in enumerate(zip(offsets, blocks, strict=True))
        ]
        assert conn.stamped_many(plan) == [w.ST_OK] * len(plan)  # all sent before any reply
        for rounds in range(3):  # every pad the stream offset can take along the way
            outs = [np.zeros(len(b), np.uint8) for b in blocks]
            items = [
                (off, out, key(i), off)
                for i, (off, out) in enumerate(zip(offsets, outs, strict=True))
            ]
            items[5] = (offsets[5], outs[5], key(99), offsets[5])  # not there
            many = (items * (GATHER_MAX // len(items) + 2))[: GATHER_MAX + 7]
            got = conn.read_blocks(many, info.size)
            assert got is not None
            assert got[0] == [j % len(items) != 5 for j in range(len(many))], rounds
            assert got[1] == sum(
                len(blocks[j % len(items)]) for j in range(len(many)) if j % len(items) != 5
            )
            for i, (out, b) in enumerate(zip(outs, blocks, strict=True)):
                if i != 5:
                    assert np.array_equal(out, b), (rounds, i)
            conn.read_one(offsets[4], out := np.zeros(100, np.uint8))  # a plain read after
            assert np.array_equal(out, blocks[4][:100])
    finally:
        conn.close()
    assert server.bytes_read > 0
    for i, (off, b) in enumerate(zip(offsets, blocks, strict=True)):  # no read still held
        newer = WriteStamp(EPOCH, 100 + i, off, len(b), key(200 + i))
        assert fence.claim(newer, "newer") == FENCE_OK, i


def test_a_request_that_arrives_in_pieces_is_served(served) -> None:
    """A checked read whose bytes come in several TCP segments, paused between
    them (the inbox waits for the whole request), then two in one segment."""
    server, fence, info = served
    data = np.arange(4096, dtype=np.uint16).astype(np.uint8)
    s = WriteStamp(EPOCH, 1, 0, data.nbytes, key(1))
    assert fence.claim(s, "w") == FENCE_OK
    server.region[: data.nbytes] = data
    assert fence.finish(s, "w", ok=True, seal=True) == FENCE_OK
    sock = socket.create_connection(("127.0.0.1", info.tcp_port))
    with sock:
        sock.sendall(w.hello(None, info.tcp_instance))
        head = bytearray(w.HELLO_REPLY.size)
        w.recv_into_exact(sock, memoryview(head))
        sent = w.HELLO_REPLY.size  # what the server sent so far: fixes each pad
        request = w.REQ.pack(w.OP_READ_BLOCK, 0, 7, 0, data.nbytes) + IDENT.pack(key(1), 0)
        for piece in (request[:3], request[3:30], request[30:]):
            sock.sendall(piece)
            time.sleep(0.02)
        for rid in (7, 8, 9):
            if rid == 8:  # the next two together
                two = [
                    w.REQ.pack(w.OP_READ_BLOCK, 0, r, 0, data.nbytes) + IDENT.pack(key(1), 0)
                    for r in (8, 9)
                ]
                sock.sendall(b"".join(two))
            pad = w.read_pad(sent)
            reply = bytearray(w.RESP.size + pad + data.nbytes)
            w.recv_into_exact(sock, memoryview(reply))
            status, got_pad, got_rid, length = w.READ_RESP.unpack_from(reply)
            assert (status, got_pad, got_rid, length) == (w.ST_OK, pad, rid, data.nbytes)
            assert bytes(reply[w.RESP.size + pad :]) == data.tobytes()
            sent += len(reply)


@pytest.mark.usefixtures("checked_read_path")
def test_transport_batches_read_while_other_connections_write(served) -> None:
    """Checked-read batches on one connection while another writes and a third
    reads single blocks: each sees only whole blocks it named."""
    _, _, info = served
    tcp = TcpTransport(info, timeout=5)
    try:
        blocks = [np.full(8192, i + 1, np.uint8) for i in range(16)]
        for i, b in enumerate(blocks):
            st = WriteStamp(EPOCH, i + 1, i * 8192, 8192, key(i))
            assert tcp.stamped([(w.OP_WRITE_FINAL, st.pack(), i * 8192, b)]) == [w.ST_OK]
        errors: list[BaseException] = []

        def reader(single: bool) -> None:
            try:
                for _ in range(30):
                    outs = [np.zeros(8192, np.uint8) for _ in blocks]
                    if single:
                        ok = [tcp.read_block(i * 8192, 0, o, key(i)) for i, o in enumerate(outs)]
                    else:
                        ok = tcp.read_blocks(
                            [(i * 8192, o, key(i), i * 8192) for i, o in enumerate(outs)]
                        )
                    assert all(ok)
                    for i, o in enumerate(outs):
                        assert (o == i + 1).all()
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=reader, args=(s,)) for s in (False, True, False)]
        for t in threads:
            t.start()
        for j in range(16, 48):  # writes of other ranges meanwhile
            st = WriteStamp(EPOCH, j + 1, j * 8192, 8192, key(j))
            assert tcp.stamped([(w.OP_WRITE_FINAL, st.pack(), j * 8192, blocks[0])]) == [w.ST_OK]
        for t in threads:
            t.join(30)
        assert not errors, errors
    finally:
        tcp.close()


def test_recv_scatter_fills_views_in_order_across_short_receives(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One receive nearly always; the loop after a short one (here: receives capped
    by a tiny MAX_CHUNK) fills the rest in order; EOF midway raises."""
    data = bytes(range(256)) * 4
    a, b = socket.socketpair()
    with a, b:
        views = [memoryview(bytearray(n)) for n in (16, 0, 100, 908)]
        a.sendall(data)
        w.recv_scatter(b, list(views), len(data))
        assert b"".join(bytes(v) for v in views) == data
        monkeypatch.setattr(w, "MAX_CHUNK", 7)
        views = [memoryview(bytearray(n)) for n in (16, 0, 100, 908)]
        a.sendall(data)
        w.recv_scatter(b, list(views), len(data))
        assert b"".join(bytes(v) for v in views) == data
        monkeypatch.undo()
        a.sendall(data[:500])
        a.shutdown(socket.SHUT_WR)
        with pytest.raises(ConnectionLostError):
            w.recv_scatter(b, [memoryview(bytearray(1024))], 1024)


@pytest.mark.usefixtures("checked_read_path")
def test_a_refused_checked_read_answers_as_many_bytes_as_an_ok_one(served) -> None:
    """Even for blocks shorter than the refusal's message: a pipeline of tiny
    checked reads, refused and served, stays in sync (one scatter receive)."""
    info = served[2]
    with _holding_one_block(info, np.full(3, 9, np.uint8)) as conn:
        for rounds in range(70):  # every pad on the way
            outs = [np.zeros(3, np.uint8) for _ in range(3)]
            items = [(0, outs[0], key(2), 0), (0, outs[1], key(1), 0), (0, outs[2], key(1), 0)]
            assert conn.read_blocks(items, info.size) == ([False, True, True], 6), rounds
            assert (outs[1] == 9).all() and (outs[2] == 9).all()
            assert conn.read_block(0, outs[0], IDENT.pack(key(3), 0)) is False
            assert conn.read_block(0, outs[0], IDENT.pack(key(1), 0)) is True


@contextmanager
def _holding_one_block(info: RegionInfo, data: np.ndarray) -> Iterator[DataConn]:
    """A data connection to the served node, ``data`` written there first as block
    ``key(1)`` at offset 0 (one stamped final write)."""
    conn = DataConn("127.0.0.1", info.tcp_port, None, 5.0, info.tcp_instance)
    try:
        st = WriteStamp(EPOCH, 1, 0, data.nbytes, key(1)).pack()
        assert conn.stamped_many([(w.OP_WRITE_FINAL, st, 0, data)]) == [w.ST_OK]
        yield conn
    finally:
        conn.close()


def test_send_all_keeps_the_stream_in_order_past_max_chunk(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(w, "MAX_CHUNK", 5)
    parts: list[bytes | memoryview] = [b"abc", memoryview(bytes(range(40))), b"", b"xyz" * 9]
    a, b = socket.socketpair()
    with a, b:
        w.send_all(a, list(parts))
        want = b"".join(bytes(p) for p in parts)
        got = bytearray(len(want))
        w.recv_into_exact(b, memoryview(got))
        assert bytes(got) == want


@pytest.mark.parametrize("done", [0, 2, 3, 10, 43, 70])
def test_send_all_sends_the_rest_after_a_short_send(done: int) -> None:
    """``done`` bytes already gone (a short ``sendmsg`` in the server's single-read
    path): the rest follows in order, whichever part the cut falls in."""
    parts: list[bytes | memoryview] = [b"abc", b"", memoryview(bytes(range(40))), b"xyz" * 9]
    want = b"".join(bytes(p) for p in parts)
    a, b = socket.socketpair()
    with a, b:
        w.send_all(a, list(parts), done)
        got = bytearray(len(want) - done)
        w.recv_into_exact(b, memoryview(got))
        assert bytes(got) == want[done:]
        a.close()
        assert b.recv(1) == b""  # nothing more than the rest was sent


@pytest.mark.usefixtures("checked_read_path")
def test_reads_the_data_path_does_not_take_send_nothing(served) -> None:
    """``DataConn.read_blocks`` answers None, nothing sent, for a batch holding a read
    it does not take (a read-only or strided destination, a range past the region, a
    key not 16 bytes, a negative offset), on both paths; the stream stays in sync."""
    info = served[2]
    with _holding_one_block(info, np.full(64, 4, np.uint8)) as conn:
        frozen = np.zeros(64, np.uint8)
        frozen.setflags(write=False)
        good = (0, np.zeros(64, np.uint8), key(1), 0)
        for bad in (
            (0, frozen, key(1), 0),
            (0, np.zeros(128, np.uint8)[::2], key(1), 0),
            (info.size - 32, np.zeros(64, np.uint8), key(1), 0),
            (0, np.zeros(64, np.uint8), b"short", 0),
            (-64, np.zeros(64, np.uint8), key(1), 0),
        ):
            assert conn.read_blocks([good, bad], info.size) is None, bad
            assert not good[1].any()  # nothing moved
        out = np.zeros(64, np.uint8)
        assert conn.read_blocks([good, (0, out, key(1), 0)], info.size) == ([True, True], 128)
        assert (out == 4).all() and (good[1] == 4).all()

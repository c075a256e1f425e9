"""A pipelined batch of checked reads in one native call (``_tcp_recv.read_blocks``,
issue 17) and ``DataConn.read_blocks`` on both of its paths (native and Python).

The native call against a scripted peer on a socket pair: the requests it sends,
byte for byte; every reply placed where it belongs (header and pad into the heads
buffer, payload into its buffer) from a stream that arrives in pieces, nothing read
past the last reply; the first reply that is neither ok nor refused as stale named
by its index; request ids that wrap; EOF, the socket's timeout and bad arguments.
``DataConn`` against a scripted data server: a refusal other than a stale one
raises ``RemoteError`` with its message and a reply out of line
``ConnectionLostError``, on both paths (the ``checked_read_path`` fixture; the real
node serves both in ``test_tcp_inbox.py`` and ``test_fencing.py``).
"""

from __future__ import annotations

import socket
import threading
import time

import numpy as np
import pytest
from tcprecvhelpers import native, needs_native, send_in_pieces

from kvpool.errors import ConnectionLostError, RemoteError
from kvpool.rpc.frame import set_io_timeout
from kvpool.transport import tcp_wire as w
from kvpool.transport.fencing import IDENT
from kvpool.transport.tcp_conn import DataConn

STEP = w.RESP.size + w.ALIGN  # the heads buffer's room per reply
REQUEST = w.READ_BLOCK_REQ.size


REGION = 1 << 40  # the region size the native call checks every range against


def _key(i: int) -> bytes:
    return bytes([i + 1]) * 16


def _read(i: int, offset: int, out: object) -> tuple[int, object, bytes, int]:
    """Checked read ``i`` (offset, host buffer, key, block offset) as the transports
    hand them over; its block at ``i * 4096``."""
    return (offset, out, _key(i), i * 4096)


def _replies(
    received: int, rids: list[int], sizes: list[int], statuses: list[int], fill: int = 7
) -> tuple[bytes, list[int]]:
    """What a node sends for checked reads of ``sizes`` (ok ones carry ``fill``
    bytes; a refusal is padded to the ok length with NULs), and each reply's pad."""
    out, pads = bytearray(), []
    for rid, n, status in zip(rids, sizes, statuses, strict=True):
        pad = w.read_pad(received + len(out))
        pads.append(pad)
        if status == w.ST_OK:
            out += w.READ_RESP.pack(status, pad, rid, n) + bytes(pad) + bytes([fill]) * n
        else:
            out += w.RESP.pack(status, rid, pad + n) + b"stale"[:pad].ljust(pad + n, b"\0")
    return bytes(out), pads


def _call(fd: int, plan: list, first_rid: int, received: int) -> tuple[list[bool], int, int, int]:
    assert native is not None
    heads = bytearray(STEP * len(plan))
    got = native.read_blocks(fd, plan, first_rid, received, heads, w.WAITALL_MAX, 100_000, REGION)
    assert got is not None
    return got


@needs_native
@pytest.mark.parametrize("received", [0, 5, 63])
def test_requests_go_out_exactly_and_every_reply_lands_in_place(pair, received: int) -> None:
    """Sizes on both sides of ``WAITALL_MAX`` in one batch, a refusal in the middle,
    the replies arriving in pieces; the bytes after the last reply stay unread."""
    a, b = pair
    sizes = [100, 0, 5000, 200_000, 1]
    statuses = [w.ST_OK, w.ST_OK, w.ST_STALE, w.ST_OK, w.ST_OK]
    outs = [np.zeros(n, np.uint8) for n in sizes]
    plan = [_read(i, np.int64(i * 4096), out) for i, out in enumerate(outs)]  # any index
    rids = list(range(41, 46))
    stream, _ = _replies(received, rids, sizes, statuses)

    def peer() -> None:
        requests = bytearray(REQUEST * len(plan))
        w.recv_into_exact(b, memoryview(requests))
        expected = b"".join(
            w.REQ.pack(w.OP_READ_BLOCK, 0, rid, off, out.nbytes) + IDENT.pack(key, block)
            for rid, (off, out, key, block) in zip(rids, plan, strict=True)
        )
        assert bytes(requests) == expected
        send_in_pieces(b, stream + b"next", 11, 0.002)

    thread = threading.Thread(target=peer)
    thread.start()
    found, at, now, served = _call(a.fileno(), plan, 41, received)
    thread.join()
    assert (found, at, now) == ([True, True, False, True, True], 5, received + len(stream))
    assert served == 100 + 200_000 + 1  # the ok replies' payloads
    for out, status in zip(outs, statuses, strict=True):
        assert (out == (7 if status == w.ST_OK else 0)).all()
    assert a.recv(16) == b"next"


@needs_native
def test_request_ids_wrap_at_two_to_the_32(pair) -> None:
    a, b = pair
    outs = [np.zeros(10, np.uint8) for _ in range(3)]
    plan = [_read(i, 0, out) for i, out in enumerate(outs)]
    rids = [0xFFFFFFFF, 0, 1]
    b.sendall(_replies(0, rids, [10] * 3, [w.ST_OK] * 3)[0])
    assert _call(a.fileno(), plan, 0xFFFFFFFF, 0)[:2] == ([True] * 3, 3)
    requests = b.recv(REQUEST * 3)
    assert [w.REQ.unpack_from(requests, i * REQUEST)[2] for i in range(3)] == rids


@needs_native
@pytest.mark.parametrize("bad", ["rid", "status", "short refusal", "ok pad", "ok length"])
def test_the_first_reply_out_of_line_is_named_by_its_index(pair, bad: str) -> None:
    """Reply 1 of 3 is wrong: ``found`` covers reply 0, ``at`` is 1, and every reply
    was still received (each is as long as an ok one), so the stream is where the
    header says; the caller raises from the header in ``heads``."""
    a, b = pair
    sizes = [64, 64, 64]
    outs = [np.zeros(n, np.uint8) for n in sizes]
    plan = [_read(i, 0, out) for i, out in enumerate(outs)]
    stream, pads = _replies(0, [1, 2, 3], sizes, [w.ST_OK] * 3)
    second = len(_replies(0, [1], sizes[:1], [w.ST_OK])[0])  # where reply 1 starts
    head = bytearray(stream[second : second + w.RESP.size])
    if bad == "rid":
        head[4:8] = (9).to_bytes(4, "big")
    elif bad == "status":  # another refusal, padded like a stale one
        head[0], head[1] = w.ST_RANGE, 0
        head[8:16] = (pads[1] + 64).to_bytes(8, "big")
    elif bad == "short refusal":  # a stale reply not padded to the ok length
        head[0], head[1] = w.ST_STALE, 0
        head[8:16] = (pads[1] + 63).to_bytes(8, "big")
    elif bad == "ok pad":
        head[1] = (pads[1] + 1) % w.ALIGN
    else:
        head[8:16] = (63).to_bytes(8, "big")
    b.sendall(stream[:second] + bytes(head) + stream[second + w.RESP.size :] + b"z")
    found, at, now, served = _call(a.fileno(), plan, 1, 0)
    assert (found, at, now, served) == ([True], 1, len(stream), 64)
    assert a.recv(4) == b"z"


@needs_native
def test_eof_before_the_last_reply_raises_connection_reset(pair) -> None:
    a, b = pair
    plan = [_read(0, 0, np.zeros(1000, np.uint8))]
    b.sendall(_replies(0, [1], [1000], [w.ST_OK])[0][:500])
    b.shutdown(socket.SHUT_WR)
    with pytest.raises(ConnectionResetError, match=r"\(500 of 1064 B received\)"):
        _call(a.fileno(), plan, 1, 0)


@needs_native
def test_a_silent_peer_raises_blocking_io_at_the_sockets_timeout(pair) -> None:
    a = pair[0]
    set_io_timeout(a, 0.2)  # SO_RCVTIMEO: the data path's inactivity timeout
    started = time.monotonic()
    with pytest.raises(BlockingIOError):
        _call(a.fileno(), [_read(0, 0, np.zeros(10, np.uint8))], 1, 0)
    assert 0.15 <= time.monotonic() - started < 5.0


@needs_native
def test_bad_arguments_are_refused_before_anything_is_sent(pair) -> None:
    """A malformed plan raises; a read this call does not take -- a buffer that is not
    writable contiguous memory, a key not 16 bytes, a negative offset, a range past
    the region -- makes it answer None (the caller's general path says why); either
    way no request went out."""
    a, b = pair
    fd, out = a.fileno(), np.zeros(8, np.uint8)
    heads = bytearray(STEP)
    call = native.read_blocks  # type: ignore[union-attr]

    def run(plan: object, region: int = REGION, into: bytearray = heads) -> object:
        return call(fd, plan, 1, 0, into, w.WAITALL_MAX, 0, region)

    with pytest.raises(TypeError):
        run((_read(0, 0, out),))  # a tuple, not a list
    with pytest.raises(TypeError, match=r"plan\[0\] is not"):
        run([(0, out, _key(0))])
    with pytest.raises(TypeError, match=r"plan\[0\] is not"):
        run([(0, out)])
    with pytest.raises(TypeError):
        run([(0.5, out, _key(0), 0)])
    with pytest.raises(ValueError, match="heads of 80 B for 2"):
        run([_read(0, 0, out)] * 2)
    with pytest.raises(ValueError):
        call(-1, [_read(0, 0, out)], 1, 0, heads, w.WAITALL_MAX, 0, REGION)
    not_taken = [
        [_read(0, 0, b"read-only")],
        [_read(0, 0, np.zeros((4, 4), np.uint8)[:, 0])],  # strided
        [(0, out, b"short", 0)],
        [(-1, out, _key(0), 0)],
        [(0, out, _key(0), -4096)],
    ]
    for plan in not_taken:
        assert run(plan) is None, plan
    assert run([_read(0, 0, out)], region=7) is None  # [0, 8) past a region of 7 B
    assert run([_read(0, 0, out), _read(1, 8, b"x")], into=bytearray(2 * STEP)) is None
    assert call(fd, [], 1, 5, bytearray(), w.WAITALL_MAX, 0, REGION) == ([], 0, 5, 0)
    b.setblocking(False)
    with pytest.raises(BlockingIOError):
        b.recv(1)  # no request went out


# --- DataConn, both paths, against a scripted data server --------------------------


@pytest.mark.parametrize("bad", ["status", "rid"])
@pytest.mark.usefixtures("checked_read_path")
def test_data_conn_raises_for_a_reply_neither_ok_nor_stale(bad: str) -> None:
    """A padded refusal other than ST_STALE raises ``RemoteError`` with its message
    (the stream stays in sync: a plain read after it is served); a reply for another
    request raises ``ConnectionLostError``."""
    listener = socket.create_server(("127.0.0.1", 0))
    hello_reply = w.HELLO_REPLY.size
    outs = [np.zeros(64, np.uint8) for _ in range(2)]
    ok, _ = _replies(hello_reply, [1], [64], [w.ST_OK])
    pad = w.read_pad(hello_reply + len(ok))
    assert pad >= len(b"out of range")
    if bad == "status":
        msg = b"out of range"[:pad].ljust(pad + 64, b"\0")
        second = w.RESP.pack(w.ST_RANGE, 2, len(msg)) + msg
    else:
        second = _replies(hello_reply + len(ok), [7], [64], [w.ST_OK])[0]
    after = _replies(hello_reply + len(ok) + len(second), [3], [5], [w.ST_OK])[0]

    def serve() -> None:
        conn, _ = listener.accept()
        with conn:
            w.answer_hello(conn, None, "", "test")
            w.recv_into_exact(conn, memoryview(bytearray(2 * REQUEST)))
            conn.sendall(ok + second)
            if bad == "status":  # the plain read after it
                w.recv_into_exact(conn, memoryview(bytearray(w.REQ.size)))
                conn.sendall(after)
            conn.recv(1)

    server = threading.Thread(target=serve, daemon=True)
    server.start()
    conn = DataConn("127.0.0.1", listener.getsockname()[1], None, 5.0)
    try:
        plan = [_read(0, 0, outs[0]), _read(1, 64, outs[1])]
        if bad == "status":
            with pytest.raises(RemoteError, match="out of range"):
                conn.read_blocks(plan, REGION)
            out = np.zeros(5, np.uint8)
            conn.read_one(0, out)  # in sync
            assert (out == 7).all()
        else:
            with pytest.raises(ConnectionLostError, match="reply 7 for 2"):
                conn.read_blocks(plan, REGION)
        assert (outs[0] == 7).all()
    finally:
        conn.close()
        listener.close()
        server.join(5)

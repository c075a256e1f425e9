"""FrameReader (buffered frame reading) over real socket pairs: same frames and same
errors as ``read_frame``, however the bytes are cut, whatever the buffer size."""

from __future__ import annotations

import socket
import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.errors import ConnectionLostError, FrameTooLargeError, ProtocolError
from kvpool.rpc.frame import (
    HEADER,
    HEADER_SIZE,
    MAGIC,
    FrameReader,
    encode_frame,
    read_frame,
    set_io_timeout,
)


def _send_in_pieces(sock: socket.socket, data: bytes, cuts: list[int], pause: float) -> None:
    pos = 0
    for cut in [*sorted(set(cuts)), len(data)]:
        if cut > pos:
            sock.sendall(data[pos:cut])
            pos = cut
            time.sleep(pause)


bodies = st.lists(
    st.dictionaries(
        st.text(max_size=3),
        st.binary(max_size=300)
        | st.integers(-(2**63), 2**64 - 1)
        | st.lists(st.text(max_size=5), max_size=40),
        max_size=4,
    ),
    min_size=1,
    max_size=6,
)


@settings(max_examples=60, deadline=None)
@given(
    frames=bodies,
    buffer_size=st.sampled_from([HEADER_SIZE, 9, 32, 100, 16384]),
    cuts=st.lists(st.integers(0, 4000), max_size=8),
)
def test_any_cut_any_buffer_reads_the_same_frames(
    frames: list[dict[str, object]], buffer_size: int, cuts: list[int]
) -> None:
    a, b = socket.socketpair()
    try:
        data = b"".join(encode_frame(f) for f in frames)
        sender = threading.Thread(target=_send_in_pieces, args=(a, data, cuts, 0.0))
        sender.start()
        b.settimeout(5)
        reader = FrameReader(b, buffer_size=buffer_size)
        got = [reader.read(idle_ok=False) for _ in frames]
        sender.join()
        a.shutdown(socket.SHUT_WR)
        assert got == frames
        assert reader.read(idle_ok=False) is None  # clean EOF between frames
    finally:
        a.close()
        b.close()


def test_pipelined_frames_arrive_in_one_receive(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    frames = [{"id": i, "x": b"y" * i} for i in range(50)]
    a.sendall(b"".join(encode_frame(f) for f in frames))
    a.shutdown(socket.SHUT_WR)
    b.settimeout(5)
    reader = FrameReader(b, buffer_size=256)  # frames straddle the buffer end: compaction
    assert [reader.read() for _ in frames] == frames
    assert reader.read() is None


def test_large_frame_bigger_than_the_buffer(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    big = {"blob": bytes(range(256)) * 400}
    small = {"after": 1}
    threading.Thread(
        target=_send_in_pieces,
        args=(a, encode_frame(small) + encode_frame(big) + encode_frame(small), [30, 5000], 0.01),
    ).start()
    b.settimeout(5)
    reader = FrameReader(b, buffer_size=64)
    assert [reader.read(idle_ok=False) for _ in range(3)] == [small, big, small]


def test_declared_length_checked_before_the_body(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    a.sendall(HEADER.pack(MAGIC, 1, 0, 5000) + b"\x00" * 100)
    b.settimeout(5)
    with pytest.raises(FrameTooLargeError):
        FrameReader(b).read(max_frame=4096)
    a.sendall(HEADER.pack(b"XX", 1, 0, 1) + b"\x80")
    with pytest.raises(ProtocolError, match="magic"):
        FrameReader(b).read()


@pytest.mark.parametrize("cut", [3, HEADER_SIZE, HEADER_SIZE + 4, HEADER_SIZE + 9000])
@pytest.mark.parametrize("buffer_size", [64, 16384])
def test_eof_inside_a_frame_is_a_lost_connection(
    pair: tuple[socket.socket, socket.socket], cut: int, buffer_size: int
) -> None:
    a, b = pair
    a.sendall(encode_frame({"blob": b"z" * 10000})[:cut])
    a.shutdown(socket.SHUT_WR)
    b.settimeout(5)
    with pytest.raises(ConnectionLostError, match="closed mid-frame"):
        FrameReader(b, buffer_size=buffer_size).read()


@pytest.mark.parametrize("kernel", [False, True], ids=["settimeout", "set_io_timeout"])
def test_timeouts_idle_between_frames_stalled_inside(
    pair: tuple[socket.socket, socket.socket], kernel: bool
) -> None:
    """The same answers whether the timeout is Python's (TimeoutError from recv) or
    the kernel's (set_io_timeout: EAGAIN, BlockingIOError from recv, as the RPC
    client's reader has it)."""
    a, b = pair
    if kernel:
        set_io_timeout(b, 0.05)
        assert b.gettimeout() is None  # blocking: no poll before each recv
    else:
        b.settimeout(0.05)
    reader = FrameReader(b)
    with pytest.raises(TimeoutError):  # nothing at all, not idle_ok: the caller's timeout
        reader.read(idle_ok=False)
    threading.Timer(0.2, lambda: a.sendall(encode_frame({"late": True}))).start()
    assert reader.read(idle_ok=True) == {"late": True}  # idle waits are retried
    for cut in (3, HEADER_SIZE, HEADER_SIZE + 2):  # the peer stalls mid-frame
        a.sendall(encode_frame({"blob": b"q" * 100})[:cut])
        with pytest.raises(ConnectionLostError, match="stalled"):
            FrameReader(b).read(idle_ok=True)


def test_large_frame_stalled_after_its_header(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    b.settimeout(0.05)
    a.sendall(encode_frame({"blob": b"q" * 50000})[:HEADER_SIZE])
    with pytest.raises(ConnectionLostError, match="stalled"):
        FrameReader(b, buffer_size=64).read(idle_ok=True)


def test_read_frame_and_reader_agree_on_one_stream(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    a, b = pair
    frames = [{"n": i, "pad": b"p" * (i * 37)} for i in range(20)]
    data = b"".join(encode_frame(f) for f in frames)
    a.sendall(data + data)
    a.shutdown(socket.SHUT_WR)
    b.settimeout(5)
    assert [read_frame(b) for _ in frames] == frames
    reader = FrameReader(b, buffer_size=128)
    assert [reader.read() for _ in frames] == frames
    assert reader.read() is None and read_frame(b) is None

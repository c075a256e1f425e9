"""Length-prefixed msgpack frames: the control plane's unit on the wire.

Layout of one frame (network byte order)::

    magic  2 bytes  b"KV"
    ver    u8       FRAME_VERSION (framing format, not the RPC protocol version)
    flags  u8       reserved, must be 0
    length u32      bytes of msgpack body that follow
    body   length bytes: one msgpack map with str keys (bin type for bytes)

Invariants:
- a receiver never allocates more than ``max_frame`` bytes for a body: the
  declared length is checked against it before a body buffer is allocated
  (a ``FrameReader`` may have read ahead into its fixed receive buffer, which
  never grows);
- a body is decoded with msgpack only (no ext hooks, no pickle); anything that
  is not a single map is a ``ProtocolError``;
- ``read_frame`` returns ``None`` only on a clean EOF between frames; an EOF
  inside a frame is a ``ConnectionLostError`` (a truncated frame).
"""

from __future__ import annotations

import socket
import struct
from typing import Any

import msgpack

from kvpool.errors import ConnectionLostError, FrameTooLargeError, ProtocolError

MAGIC = b"KV"
FRAME_VERSION = 1
HEADER = struct.Struct("!2sBBI")
HEADER_SIZE = HEADER.size
DEFAULT_MAX_FRAME = 16 * 1024 * 1024


def encode_frame(body: dict[str, Any], *, max_frame: int = DEFAULT_MAX_FRAME) -> bytes:
    """One frame (header + msgpack body) as bytes; FrameTooLargeError past ``max_frame``."""
    payload = msgpack.packb(body, use_bin_type=True)
    if len(payload) > max_frame:
        raise FrameTooLargeError(f"frame body of {len(payload)} B exceeds max {max_frame} B")
    return HEADER.pack(MAGIC, FRAME_VERSION, 0, len(payload)) + payload


def parse_header(
    header: bytes | bytearray | memoryview, *, max_frame: int = DEFAULT_MAX_FRAME, offset: int = 0
) -> int:
    """Validate the frame header at ``header[offset:]`` and return the body length."""
    magic, version, flags, length = HEADER.unpack_from(header, offset)
    if magic != MAGIC:
        raise ProtocolError(f"bad frame magic {magic!r} (expected {MAGIC!r})")
    if version != FRAME_VERSION:
        raise ProtocolError(f"unsupported frame version {version} (expected {FRAME_VERSION})")
    if flags != 0:
        raise ProtocolError(f"unknown frame flags 0x{flags:02x}")
    if length > max_frame:
        raise FrameTooLargeError(f"frame body of {length} B exceeds max {max_frame} B")
    return int(length)


def decode_body(payload: bytes | bytearray | memoryview) -> dict[str, Any]:
    """Decode a frame body; ProtocolError unless it is exactly one str-keyed map."""
    try:
        body = msgpack.unpackb(payload, raw=False, use_list=True, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types
        raise ProtocolError(f"undecodable frame body: {type(exc).__name__}: {exc}") from None
    if not isinstance(body, dict):
        raise ProtocolError(f"frame body must be a map, got {type(body).__name__}")
    return body


def recv_exact(
    sock: socket.socket, view: memoryview, *, idle_ok: bool = False, stalled: int = 0
) -> bool:
    """Fill ``view`` from ``sock``; False on clean EOF before the first byte.

    Before the first byte, a socket timeout is retried forever with
    ``idle_ok`` (an idle connection between frames) and propagates as
    ``TimeoutError`` otherwise. After the first byte, a whole socket timeout
    without progress means the peer stalled mid-frame: ConnectionLostError,
    as is EOF mid-frame. ``stalled`` > 0: that many bytes of the frame came
    before ``view`` (a timeout is then a stall from the first byte on).
    """
    got, n = 0, len(view)
    while got < n:
        k = receive(sock, view[got:], got, n, idle_ok=idle_ok, stalled=stalled)
        if k is None:
            continue
        if k == 0:
            return False
        got += k
    return True


def receive(
    sock: socket.socket, view: memoryview, got: int, need: int, *, idle_ok: bool, stalled: int = 0
) -> int | None:
    """One ``recv_into(view)`` of a frame's bytes, ``got`` of ``need`` already in
    (after ``stalled`` earlier ones): the byte count; 0 on EOF before the first
    byte; None on an idle timeout to wait through (``idle_ok``, first byte). The
    errors as ``recv_exact`` states them (its loop and ``FrameReader``'s share this)."""
    try:
        k = sock.recv_into(view)
    except (TimeoutError, BlockingIOError) as exc:  # BlockingIOError: set_io_timeout's
        if got == 0 and not stalled:
            if idle_ok:
                return None
            if isinstance(exc, BlockingIOError):
                raise TimeoutError(f"no frame within the socket's timeout: {exc}") from exc
            raise
        raise ConnectionLostError(
            f"peer stalled mid-frame ({stalled + got} of {stalled + need} B received)"
        ) from None
    except OSError as exc:
        raise ConnectionLostError(f"connection lost while receiving: {exc}") from exc
    if k == 0 and got:
        raise ConnectionLostError(
            f"connection closed mid-frame ({stalled + got} of {stalled + need} B received)"
        )
    return k


def read_frame(
    sock: socket.socket, *, max_frame: int = DEFAULT_MAX_FRAME, idle_ok: bool = True
) -> dict[str, Any] | None:
    """Read one frame and decode it; None on clean EOF between frames."""
    header = bytearray(HEADER_SIZE)
    if not recv_exact(sock, memoryview(header), idle_ok=idle_ok):
        return None
    length = parse_header(bytes(header), max_frame=max_frame)
    payload = bytearray(length)
    try:
        complete = not length or recv_exact(sock, memoryview(payload), idle_ok=False)
    except TimeoutError:
        raise ConnectionLostError("peer stalled after a frame header") from None
    if not complete:
        raise ConnectionLostError("connection closed after a frame header (truncated frame)")
    return decode_body(payload)


class FrameReader:
    """Reads the frames of one socket through a fixed receive buffer.

    ``read_frame`` costs two receive calls per frame (header, then body); a
    control-plane frame is usually a few hundred bytes sent in one piece, so
    one ``recv_into`` of up to ``buffer_size`` bytes brings it whole (and, when
    calls are pipelined, the next frames too). A frame larger than the buffer
    gets its own body buffer (after its length was checked against
    ``max_frame``), filled from what was read ahead, then from the socket.

    Same answers as ``read_frame``: None only on a clean EOF between frames;
    EOF or a stall (a socket timeout without progress) after the first byte
    of a frame is a ``ConnectionLostError``; a timeout before it is retried
    with ``idle_ok`` and raised as ``TimeoutError`` otherwise. Not
    thread-safe: one reader thread per socket.
    """

    def __init__(self, sock: socket.socket, *, buffer_size: int = 16384) -> None:
        if buffer_size < HEADER_SIZE:
            raise ValueError(f"buffer_size must be >= {HEADER_SIZE}")
        self.sock = sock
        self._buf = bytearray(buffer_size)
        self._view = memoryview(self._buf)
        self._start = self._end = 0  # unread bytes: _buf[_start:_end]

    def read(
        self, *, max_frame: int = DEFAULT_MAX_FRAME, idle_ok: bool = True
    ) -> dict[str, Any] | None:
        """The next frame's body, decoded; None on a clean EOF between frames."""
        if self._end - self._start < HEADER_SIZE and not self._fill(HEADER_SIZE, idle_ok):
            return None
        length = parse_header(self._buf, max_frame=max_frame, offset=self._start)
        start = self._start + HEADER_SIZE
        total = HEADER_SIZE + length
        if total <= len(self._buf):
            if self._end - self._start < total:
                self._fill(total, False)
                start = self._start + HEADER_SIZE
            self._start = start + length
            with self._view[start : self._start] as body:
                return decode_body(body)
        payload = bytearray(length)  # a large frame: its own buffer, filled once
        have = self._end - start
        payload[:have] = self._view[start : self._end]
        self._start = self._end = 0
        if not recv_exact(self.sock, memoryview(payload)[have:], stalled=HEADER_SIZE + have):
            raise ConnectionLostError(
                f"connection closed mid-frame ({HEADER_SIZE + have} of {total} B received)"
            )
        return decode_body(payload)

    def _fill(self, need: int, idle_ok: bool) -> bool:
        """Read until ``need`` unread bytes are buffered (compacting first when they
        would not fit); False on EOF before any byte of the frame."""
        if self._start + need > len(self._buf):
            unread = self._end - self._start
            self._buf[:unread] = bytes(self._view[self._start : self._end])  # may overlap
            self._start, self._end = 0, unread
        elif self._start == self._end:
            self._start = self._end = 0
        while self._end - self._start < need:
            got = self._end - self._start
            k = receive(self.sock, self._view[self._end :], got, need, idle_ok=idle_ok)
            if k is None:
                continue
            if k == 0:
                return False
            self._end += k
        return True


# --- socket helpers shared by every kvpool server and client ---------------------

KEEPALIVE_IDLE_S, KEEPALIVE_INTERVAL_S, KEEPALIVE_PROBES = 5, 2, 3


def set_io_timeout(sock: socket.socket, timeout: float) -> None:
    """Blocking socket whose every send/recv call gives up after ``timeout`` seconds
    without progress (EAGAIN -> ``BlockingIOError``; ``receive`` reports it as the
    timeout it is). The data path's ends and the RPC client's reader use it instead
    of Python's ``settimeout``, which makes the socket non-blocking and puts a
    ``poll`` before every ``recv`` (see kvpool.transport.tcp_conn's docstring for
    the syscall counts)."""
    sock.settimeout(None)
    sec = int(timeout)
    tv = struct.pack("ll", sec, int((timeout - sec) * 1e6))
    if tv == struct.pack("ll", 0, 0):  # 0 would mean "no timeout" to the kernel
        tv = struct.pack("ll", 0, 1)
    for opt in (socket.SO_RCVTIMEO, socket.SO_SNDTIMEO):
        sock.setsockopt(socket.SOL_SOCKET, opt, tv)


def tune_socket(sock: socket.socket) -> None:
    """TCP_NODELAY, and keepalive probes so a vanished peer (no FIN, no RST) is
    noticed by the kernel within ~11 s even on an idle connection."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (
        ("TCP_KEEPIDLE", KEEPALIVE_IDLE_S),
        ("TCP_KEEPINTVL", KEEPALIVE_INTERVAL_S),
        ("TCP_KEEPCNT", KEEPALIVE_PROBES),
    ):
        opt = getattr(socket, name, None)
        if opt is not None:
            sock.setsockopt(socket.IPPROTO_TCP, opt, value)


def listen(host: str, port: int) -> socket.socket:
    """A listening socket on host:port (IPv6 when the host is an IPv6 literal)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host, port), family=family, backlog=128)


def linger_close(sock: socket.socket, *, limit: int = 1 << 20, seconds: float = 1.0) -> None:
    """Close after a final reply so the peer reads it: FIN first, then drain what the
    peer still sends (bounded) before closing. Closing with unread input makes the
    kernel send RST instead, which can destroy the reply before the peer reads it."""
    import time

    try:
        sock.shutdown(socket.SHUT_WR)
        deadline = time.monotonic() + seconds
        sock.settimeout(min(0.2, seconds))
        drained = 0
        while drained < limit and time.monotonic() < deadline:
            try:
                chunk = sock.recv(65536)
            except TimeoutError:
                continue
            if not chunk:
                break
            drained += len(chunk)
    except OSError:
        pass
    finally:
        sock.close()

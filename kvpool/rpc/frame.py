"""Length-prefixed msgpack frames: the control plane's unit on the wire.

Layout of one frame (network byte order)::

    magic  2 bytes  b"KV"
    ver    u8       FRAME_VERSION (framing format, not the RPC protocol version)
    flags  u8       reserved, must be 0
    length u32      bytes of msgpack body that follow
    body   length bytes: one msgpack map with str keys (bin type for bytes)

Invariants:
- a receiver never allocates more than ``max_frame`` bytes for a body: the
  declared length is checked against it before any body byte is read;
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


def parse_header(header: bytes, *, max_frame: int = DEFAULT_MAX_FRAME) -> int:
    """Validate a frame header and return the body length."""
    magic, version, flags, length = HEADER.unpack(header)
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


def recv_exact(sock: socket.socket, view: memoryview, *, idle_ok: bool = False) -> bool:
    """Fill ``view`` from ``sock``; False on clean EOF before the first byte.

    Before the first byte, a socket timeout is retried forever with
    ``idle_ok`` (an idle connection between frames) and propagates as
    ``TimeoutError`` otherwise. After the first byte, a whole socket timeout
    without progress means the peer stalled mid-frame: ConnectionLostError,
    as is EOF mid-frame.
    """
    got, n = 0, len(view)
    while got < n:
        try:
            k = sock.recv_into(view[got:], n - got)
        except TimeoutError:
            if got == 0 and idle_ok:
                continue
            if got == 0:
                raise
            raise ConnectionLostError(f"peer stalled mid-frame ({got} of {n} B received)") from None
        except OSError as exc:
            raise ConnectionLostError(f"connection lost while receiving: {exc}") from exc
        if k == 0:
            if got == 0:
                return False
            raise ConnectionLostError(f"connection closed mid-frame ({got} of {n} B received)")
        got += k
    return True


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


# --- socket helpers shared by every kvpool server and client ---------------------

KEEPALIVE_IDLE_S, KEEPALIVE_INTERVAL_S, KEEPALIVE_PROBES = 5, 2, 3


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

"""The data server's buffered sides of one connection: requests in one recv
(``Inbox``), and the replies to a pipelined run of payload-less ops in one send
(``Outbox``).

A request is small (``REQ``, then an ``IDENT`` or a ``STAMP``) and a client
often sends several at once (a pipelined batch of checked reads). Reading each
field with its own ``recv`` costs a syscall per field: two per checked read,
sixteen for a batch of eight. The inbox instead asks the kernel for up to
``size`` bytes at a time and hands out requests from its buffer, so a checked
read costs one ``recv`` and a whole pipelined batch usually one too.

Payload bytes that arrive in the same ``recv`` as their header (a write's pad
and the start of its payload) are copied out of the buffer first; the rest of
a payload is received straight into its destination as before (``read_into``),
at the same stream offset, so its alignment does not change.

Invariants: bytes are handed out exactly once, in stream order (the server
counts them: its write pads depend on it); a recv that returns 0 in the middle
of a request raises ``ConnectionLostError`` (the peer hung up).
"""

from __future__ import annotations

import socket

from kvpool.errors import ConnectionLostError
from kvpool.transport import tcp_wire as w

INBOX_SIZE = 4096  # bytes asked per recv: 85 checked-read requests, or a write's start


class Inbox:
    """Buffered requests of one connection (used by its one serving thread)."""

    def __init__(self, sock: socket.socket, size: int = INBOX_SIZE) -> None:
        self._sock = sock
        self.buf = bytearray(size)
        self._mv = memoryview(self.buf)
        self.start = 0  # first byte not handed out yet
        self.end = 0  # end of the bytes received so far

    @property
    def buffered(self) -> int:
        """Bytes received and not handed out yet."""
        return self.end - self.start

    def recv_more(self) -> int:
        """One ``recv`` appended to the buffer (moving what is left to its front when
        the tail is short); the bytes it brought. 0 means the peer hung up.
        ``BlockingIOError`` (the socket's timeout) passes through."""
        if self.start == self.end:
            self.start = self.end = 0
        elif len(self.buf) - self.end < w.ALIGN:
            left = self.end - self.start
            self.buf[:left] = self._mv[self.start : self.end]
            self.start, self.end = 0, left
        got = self._sock.recv_into(self._mv[self.end :])
        self.end += got
        return got

    def take(self, n: int) -> int:
        """Hand out the next ``n`` bytes (``n`` <= the buffer's size); their position
        in ``buf``, valid until the next call."""
        if self.end - self.start < n:
            if self.start + n > len(self.buf):  # make room behind what is left
                left = self.end - self.start
                self.buf[:left] = self._mv[self.start : self.end]
                self.start, self.end = 0, left
            while self.end - self.start < n:
                got = self._sock.recv_into(self._mv[self.end :])
                if not got:
                    raise ConnectionLostError(
                        f"peer closed the data connection ({self.end - self.start} of {n} B)"
                    )
                self.end += got
        pos = self.start
        self.start += n
        return pos

    def read_into(self, pad: memoryview, payload: memoryview) -> None:
        """Fill ``pad`` (bytes to skip) then ``payload``: from the buffer first, the
        rest straight from the socket (one scatter recv when the pad is not done)."""
        pad = self._copy_out(pad)
        payload = self._copy_out(payload)  # (nothing is left buffered if pad is not done)
        if pad.nbytes or payload.nbytes:
            w.recv_padded(self._sock, pad, payload)

    def discard(self, n: int) -> None:
        """Drop the next ``n`` bytes (a refused write's pad and payload)."""
        k = min(n, self.buffered)
        self.start += k
        n -= k
        if n:
            scratch = memoryview(bytearray(min(n, 1 << 20)))
            while n:
                k = min(n, scratch.nbytes)
                w.recv_into_exact(self._sock, scratch[:k])
                n -= k

    def _copy_out(self, view: memoryview) -> memoryview:
        """Copy buffered bytes into the front of ``view``; what is left of it."""
        k = min(view.nbytes, self.end - self.start)
        if k:
            view[:k] = self._mv[self.start : self.start + k]
            self.start += k
        return view[k:]


class Outbox:
    """Replies to payload-less fenced ops held while more of them are buffered whole,
    then sent in one ``sendall``: a refill's claims taken ahead (one pipelined batch)
    cost the client one wake-up and one receive, not one per claim, and the node one
    loopback send (issue 17). Invariant: flushed before anything else is sent on the
    connection and before a receive can wait, so replies keep the requests' order and
    none waits on the client's next request."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock, self._parts = sock, list[bytes]()

    def sendall(self, data: bytes) -> None:
        self._parts.append(data)

    def flush(self) -> None:
        if self._parts:
            self._sock.sendall(b"".join(self._parts))
            self._parts.clear()

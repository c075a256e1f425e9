"""Node side of the TCP data path: serves (offset, length) ranges of one region.

One thread per client connection. READ sends the range straight from the region
(``sendmsg`` of a memoryview, no copy), after a header padded so the payload sits at
an aligned stream offset (see ``tcp_wire``); WRITE receives its pad and payload
straight into the region (the client pads too). The server knows nothing about
blocks: the master decides which ranges are valid; this server only refuses ranges
outside the region and, given a ``fence`` (kvpool.transport.fencing), passes every
stamped op through it before a byte lands (the node's block table checks the epoch
and allocation) and serves a checked read only while its block holds the range
(kvpool.transport.tcp_checked_reads; given the node's ``read_gate``, most of them
natively: kvpool.transport.tcp_read_gate). Given ``commits`` (a ``CommitDesk``) it also
takes final writes whose writer asks the node to send the master commit
(``WRITE_COMMIT``) and answers how those commits went (``COMMITS``). The token rule
of ``kvpool.rpc.auth`` applies (a non-loopback bind needs a token).
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import socket
import threading
from typing import Any

from kvpool.bindings.buffers import host_view
from kvpool.errors import ConnectionLostError
from kvpool.rpc.auth import check_bind, resolve_token
from kvpool.rpc.frame import linger_close, set_io_timeout
from kvpool.transport import tcp_congestion
from kvpool.transport import tcp_wire as w
from kvpool.transport.fencing import (
    FENCE_BUSY,
    FENCE_OK,
    STAMP,
    CommitDesk,
    WriteFence,
    WriteStamp,
)
from kvpool.transport.tcp_checked_reads import PADS, CheckedReads
from kvpool.transport.tcp_inbox import Inbox, Outbox
from kvpool.transport.tcp_read_gate import ReadGate

log = logging.getLogger("kvpool.transport.tcp")
#: Fenced ops with no payload either way (a claim taken ahead, a seal, a release):
#: their replies to a pipelined batch leave together (``Outbox``).
_QUIET_OPS = frozenset((w.OP_CLAIM, w.OP_SEAL, w.OP_RELEASE))
_QUIET_REQ = w.REQ.size + STAMP.size


class TcpDataServer:
    """Serve ``region`` (any writable contiguous host buffer) on host:port."""

    def __init__(
        self,
        region: Any,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        token: str | None = None,
        handshake_timeout: float = 10.0,
        fence: WriteFence | None = None,
        write_timeout: float = 30.0,
        max_connections: int = 1024,
        commits: CommitDesk | None = None,
        read_gate: ReadGate | None = None,
    ) -> None:
        self.token = resolve_token(token)
        check_bind(host, self.token)
        self.region = host_view(region, writable=True, what="region")
        if read_gate is not None and (fence is None or read_gate.size != self.region.nbytes):
            raise ValueError("a read gate needs the fence of the region it was made for")
        self._mv = memoryview(self.region)  # type: ignore[arg-type]
        self.size = self.region.nbytes
        self.handshake_timeout = handshake_timeout
        self.fence, self.write_timeout = fence, write_timeout
        self.commits = commits  # takes OP_WRITE_COMMIT and OP_COMMITS (None: refused)
        self.max_connections = max_connections
        self._listener = tcp_congestion.listen(host, port)
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closed = False
        self._thread: threading.Thread | None = None
        self.reads = CheckedReads(self._mv, fence, read_gate)  # READ_BLOCK (READ counts there)
        self.bytes_written = 0
        self.instance = secrets.token_hex(8)  # this incarnation (see tcp_wire)

    @property
    def bytes_read(self) -> int:
        """Payload bytes served (plain and checked reads)."""
        return self.reads.bytes_read

    @property
    def address(self) -> tuple[str, int]:
        host, port = self._listener.getsockname()[:2]
        return str(host), int(port)

    def start(self) -> tuple[str, int]:
        self._thread = threading.Thread(target=self.serve_forever, daemon=True)
        self._thread.start()
        return self.address

    def serve_forever(self) -> None:
        while not self._closed:
            try:
                sock, peer = self._listener.accept()
            except OSError:
                break
            with self._lock:
                full = len(self._conns) >= self.max_connections
                if not full:
                    self._conns.add(sock)
            if full:  # each connection costs a thread: refuse past the cap
                log.warning("data server: %d connections open: refusing %s", len(self._conns), peer)
                sock.close()
                continue
            threading.Thread(target=self._serve, args=(sock, peer), daemon=True).start()

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        with self._lock:
            conns = list(self._conns)
        for sock in conns:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        if self._thread is not None:
            self._thread.join(timeout=5)

    def __enter__(self) -> TcpDataServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _serve(self, sock: socket.socket, peer: Any) -> None:
        try:
            w.tune(sock)
            sock.settimeout(self.handshake_timeout)
            ok, sent, received = w.answer_hello(sock, self.token, self.instance, peer)
            if ok:
                # Kernel timeouts from here on: a peer that stops sending mid-request or
                # stops reading a reply gets its connection dropped after write_timeout
                # without progress, so a stalled writer cannot hold its claim, nor a
                # stalled reader its block, forever. Idle between requests is fine.
                set_io_timeout(sock, self.write_timeout)
                if not self._loop(sock, sent, received):
                    return
            # Refused, or ended on a protocol error: let the peer read our last reply.
            linger_close(sock)
        except (OSError, ConnectionLostError):
            pass
        finally:
            if self.fence is not None:
                self.fence.owner_gone(sock)
            with self._lock:
                self._conns.discard(sock)
            sock.close()

    def _error(
        self, sock: socket.socket | Outbox, status: int, rid: int, message: str, fill: int = 0
    ) -> int:
        """An error reply (its message NUL-filled to ``fill`` bytes); the bytes sent."""
        msg = message.encode().ljust(fill, b"\0")
        sock.sendall(w.RESP.pack(status, rid, len(msg)) + msg)
        return w.RESP.size + len(msg)

    def _loop(self, sock: socket.socket, sent: int, received: int) -> bool:
        """Serve requests; False when the peer hung up, True after a fatal protocol error.

        ``sent`` counts every byte sent on the connection: it fixes each READ's pad;
        ``received`` every byte received: it fixes each WRITE's pad. Requests come
        out of an ``Inbox`` (one recv for a request, or for a pipelined batch).
        """
        inbox = Inbox(sock)
        outbox = Outbox(sock)
        buf = inbox.buf
        skip = memoryview(bytearray(w.ALIGN))
        unpack_from, req_size = w.REQ.unpack_from, w.REQ.size
        read_block, block_req = w.OP_READ_BLOCK, w.READ_BLOCK_REQ.size
        batch = 2 * block_req  # two checked reads buffered whole: serve them as a batch
        while True:
            if inbox.start == inbox.end:  # nothing buffered: wait for the next request
                outbox.flush()
                try:
                    if not inbox.recv_more():
                        return False  # the peer hung up
                except BlockingIOError:
                    continue  # write_timeout passed with no request: an idle client, keep it
            if buf[inbox.start] == read_block:  # the common request first, fewest steps
                outbox.flush()
                try:
                    start = inbox.start
                    if inbox.end - start < batch or buf[start + block_req] != read_block:
                        sent += self.reads.one(sock, inbox, sent)  # one alone
                        received += block_req
                    else:  # a pipelined batch: one gather send for those here whole
                        n_sent, n_received = self.reads.batch(sock, inbox, sent)
                        sent += n_sent
                        received += n_received
                except ConnectionLostError:
                    return False
                continue
            try:
                op, pad, rid, offset, length = unpack_from(buf, inbox.take(req_size))
            except ConnectionLostError:
                return False
            received += req_size + (STAMP.size if op in w.STAMPED_OPS else 0)
            quiet = op in _QUIET_OPS
            if not quiet:
                outbox.flush()
            if op in w.PAYLOAD_OPS:
                if pad != w.write_pad(received):
                    self._error(sock, w.ST_BAD_OP, rid, "data stream out of sync (write pad)")
                    return True
                received += pad + length  # the stream goes on only if all of it is read
            if op == w.OP_PING:
                sock.sendall(w.RESP.pack(w.ST_OK, rid, 0))
                sent += w.RESP.size
                continue
            if op == w.OP_COMMITS:  # ``offset``: how long to wait for owed ones (us)
                n = self._commit_answers(sock, inbox, rid, length, offset / 1e6)
                if n is None:
                    return True  # its ids are not drained: the stream is unusable
                sent, received = sent + n, received + length
                continue
            if op in w.STAMPED_OPS:
                out = outbox if quiet else sock
                n = self._stamped(sock, inbox, op, rid, offset, length, skip[:pad], out)
                if n is None:
                    outbox.flush()
                    return True
                sent += n
                at = inbox.start
                if inbox.end - at < _QUIET_REQ or buf[at] not in _QUIET_OPS:
                    outbox.flush()  # no whole quiet request next: answer the batch now
                continue
            if op not in (w.OP_READ, w.OP_WRITE):
                self._error(sock, w.ST_BAD_OP, rid, f"unknown op {op}")
                return True
            if op == w.OP_WRITE and self.fence is not None:  # would bypass the fence
                self._error(sock, w.ST_BAD_OP, rid, "this node takes only stamped writes")
                return True  # its payload is not drained: the stream is unusable
            if offset + length > self.size:
                sent += self._error(
                    sock,
                    w.ST_RANGE,
                    rid,
                    f"range [{offset}, {offset + length}) outside region of {self.size} B",
                )
                if op == w.OP_WRITE:
                    return True  # its payload is not drained: the stream is unusable
                continue
            span = self._mv[offset : offset + length]
            if op == w.OP_READ:
                pad = w.read_pad(sent)
                reply = w.READ_RESP.pack(w.ST_OK, pad, rid, length) + PADS[pad]
                w.send_parts(sock, reply, span)
                sent += len(reply) + length
                self.reads.bytes_read += length
            else:
                inbox.read_into(skip[:pad], span)
                sock.sendall(w.RESP.pack(w.ST_OK, rid, 0))
                sent += w.RESP.size
                self.bytes_written += length

    def _stamped(
        self,
        sock: socket.socket,
        inbox: Inbox,
        op: int,
        rid: int,
        offset: int,
        length: int,
        pad: memoryview,
        out: socket.socket | Outbox,
    ) -> int | None:
        """One fenced write op (its STAMP next in ``inbox``): the bytes it sent back
        (through ``out``: the socket, or the outbox of a quiet op), or None after a
        fatal error (the stream is unusable). ``pad`` receives a write's pad bytes."""
        stamp = WriteStamp.unpack(inbox.buf[(at := inbox.take(STAMP.size)) : at + STAMP.size])
        payload = length if op in w.PAYLOAD_OPS else 0
        fence = self.fence
        if fence is None or (op == w.OP_WRITE_COMMIT and self.commits is None):
            self._error(out, w.ST_BAD_OP, rid, "this data server takes no such stamped writes")
            return None
        if stamp.offset + stamp.size > self.size or (payload and not stamp.covers(offset, length)):
            n = self._error(out, w.ST_RANGE, rid, f"stamp range outside region of {self.size} B")
            return None if payload else n  # an undrained payload leaves the stream unusable
        if op == w.OP_SEAL or op == w.OP_RELEASE:
            sealed = op == w.OP_SEAL
            status = fence.finish(stamp, sock, ok=sealed, seal=sealed, any_owner=True)
            return self._fence_reply(out, rid, status)
        status = fence.claim(stamp, sock)
        if status != FENCE_OK or op == w.OP_CLAIM:
            if op in w.PAYLOAD_OPS:
                inbox.discard(pad.nbytes + payload)
            return self._fence_reply(out, rid, status)
        inbox.read_into(pad, self._mv[offset : offset + length])  # <= write_timeout stalls
        status = fence.finish(stamp, sock, ok=True, seal=op != w.OP_WRITE_PART)
        if op == w.OP_WRITE_COMMIT and status == FENCE_OK and self.commits is not None:
            self.commits.owe(stamp)  # before the ack: an ask after it finds the commit owed
        self.bytes_written += length
        return self._fence_reply(out, rid, status)

    def _commit_answers(
        self, sock: socket.socket, inbox: Inbox, rid: int, length: int, wait_s: float
    ) -> int | None:
        """``COMMITS``: one state byte per id named; the bytes sent, or None after a
        fatal error (its ids are not drained)."""
        n, rest = divmod(length, w.COMMIT_ID.size)
        if self.commits is None or rest or n > w.MAX_COMMIT_IDS:
            self._error(sock, w.ST_BAD_OP, rid, "no commits by this node, or a bad COMMITS")
            return None
        raw = bytearray(length)
        inbox.read_into(memoryview(raw)[:0], memoryview(raw))
        states = self.commits.outcomes(list(w.COMMIT_ID.iter_unpack(raw)), wait_s)
        sock.sendall(w.RESP.pack(w.ST_OK, rid, len(states)) + states)
        return w.RESP.size + len(states)

    def _fence_reply(self, sock: socket.socket | Outbox, rid: int, status: int) -> int:
        """The fence's verdict as a reply; the bytes sent."""
        if status == FENCE_OK:
            sock.sendall(w.RESP.pack(w.ST_OK, rid, 0))
            return w.RESP.size
        if status == FENCE_BUSY:
            return self._error(
                sock, w.ST_BUSY, rid, "range busy: an older write is still in flight"
            )
        return self._error(
            sock, w.ST_STALE, rid, "stale write: the range belongs to a newer allocation"
        )

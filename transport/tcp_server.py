"""Node side of the TCP data path: serves (offset, length) ranges of one region.

One thread per client connection. READ sends the range straight from the region
(``sendmsg`` of a memoryview, no copy), after a header padded so the payload sits at
an aligned stream offset (see ``tcp_wire``); WRITE receives its pad and payload
straight into the region (the client pads too). The server knows nothing about
blocks: the master decides which ranges are valid; this server only refuses ranges
outside the region and, given a ``fence`` (kvpool.transport.fencing), passes every
stamped op through it before a byte lands (the node's block table checks the epoch
and allocation) and serves a checked read only while its block holds the range. The
token rule of ``kvpool.rpc.auth`` applies (a non-loopback bind needs a token).
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
from kvpool.rpc.frame import linger_close, listen, set_io_timeout
from kvpool.transport import tcp_wire as w
from kvpool.transport.fencing import (
    FENCE_BUSY,
    FENCE_OK,
    STAMP,
    WriteFence,
    WriteStamp,
)
from kvpool.transport.tcp_inbox import Inbox, Outbox

log = logging.getLogger("kvpool.transport.tcp")
_STALE_MSG = b"that block no longer holds this range"
#: Checked reads one gather send answers, at most: requests, payload bytes so far
GATHER_MAX, GATHER_BYTES = 64, 1 << 20
_BLOCK = w.READ_BLOCK_REQ
_BLOCK_REQ = _BLOCK.size
_PADS = tuple(bytes(n) for n in range(w.ALIGN))  # an ok reply's pad, by length: no slicing
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
    ) -> None:
        self.token = resolve_token(token)
        check_bind(host, self.token)
        self.region = host_view(region, writable=True, what="region")
        self._mv = memoryview(self.region)  # type: ignore[arg-type]
        self.size = self.region.nbytes
        self.handshake_timeout = handshake_timeout
        self.fence, self.write_timeout = fence, write_timeout
        self.max_connections = max_connections
        self._listener = listen(host, port)
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closed = False
        self._thread: threading.Thread | None = None
        self.bytes_read = 0
        self.bytes_written = 0
        self.instance = secrets.token_hex(8)  # this incarnation (see tcp_wire)

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
        read_block, block_req = w.OP_READ_BLOCK, _BLOCK_REQ
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
                        sent += self._read_block(sock, inbox, sent)  # one alone
                        received += block_req
                    else:  # a pipelined batch: one gather send for those here whole
                        n_sent, n_received = self._read_blocks(sock, inbox, sent)
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
                reply = w.READ_RESP.pack(w.ST_OK, pad, rid, length) + _PADS[pad]
                w.send_parts(sock, reply, span)
                sent += len(reply) + length
                self.bytes_read += length
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
        payload = length if op in (w.OP_WRITE_FINAL, w.OP_WRITE_PART) else 0
        fence = self.fence
        if fence is None:
            self._error(out, w.ST_BAD_OP, rid, "this data server takes no stamped writes")
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
        status = fence.finish(stamp, sock, ok=True, seal=op == w.OP_WRITE_FINAL)
        self.bytes_written += length
        return self._fence_reply(out, rid, status)

    def _read_block(self, sock: socket.socket, inbox: Inbox, sent: int) -> int:
        """The checked read at the head of ``inbox``, alone (``_read_blocks`` without its
        lists, Inbox.take inline); the bytes sent. Served only while the named block
        holds the range, held until the send ends; else ST_STALE as long as an ok reply."""
        at = inbox.start
        if inbox.end - at >= _BLOCK_REQ:
            inbox.start = at + _BLOCK_REQ
        else:
            at = inbox.take(_BLOCK_REQ)
        _, _, rid, offset, length, key, block_offset = _BLOCK.unpack_from(inbox.buf, at)
        fence = self.fence
        held = None if fence is None else fence.begin_read(key, block_offset, offset, length)
        pad = -(sent + w.RESP.size) % w.ALIGN  # w.read_pad, inline
        if held is None:
            reply = _stale_reply(rid, pad, length, offset + length <= self.size)
            sock.sendall(reply)
            return len(reply)
        total = w.RESP.size + pad + length
        try:
            head = w.READ_RESP.pack(w.ST_OK, pad, rid, length)
            parts: list[bytes | memoryview] = [head, _PADS[pad], self._mv[offset : offset + length]]
            done = sock.sendmsg(parts)  # one gather send, nearly always the whole reply
            if done < total:
                w.send_all(sock, parts, done)
            self.bytes_read += length
        finally:
            assert fence is not None
            fence.end_read(held)
        return total

    def _read_blocks(self, sock: socket.socket, inbox: Inbox, sent: int) -> tuple[int, int]:
        """The checked read at the head of ``inbox`` and each whole one buffered behind
        it (a pipelined batch, up to GATHER_*), answered with one gather send; their
        blocks held (one fence call for all) until the send ends; (bytes sent, bytes
        received). The caller saw the first two whole: both checked reads."""
        start, block_req, read_block = inbox.start, _BLOCK_REQ, w.OP_READ_BLOCK
        whole = min((inbox.end - start) // block_req, GATHER_MAX)
        reads = []  # (op, pad, rid, offset, length, key, block offset) per request
        asked = 0  # payload bytes the requests taken ask for
        for request in _BLOCK.iter_unpack(inbox.buf[start : start + whole * block_req]):
            if request[0] != read_block:
                break
            reads.append(request)
            asked += request[4]
            if asked >= GATHER_BYTES:
                break
        inbox.start = start + len(reads) * block_req
        fence = self.fence
        if fence is None:
            held: list[Any] = [None] * len(reads)
        else:
            held = fence.begin_reads([(r[5], r[6], r[3], r[4]) for r in reads])
        size, region, pack, head = self.size, self._mv, w.READ_RESP.pack, w.RESP.size
        parts: list[bytes | memoryview] = []
        first, nbytes = sent, 0  # nbytes: the payload bytes served
        try:
            for (_, _, rid, offset, length, _, _), entry in zip(reads, held, strict=True):
                pad = -(sent + head) % w.ALIGN  # w.read_pad, inline
                if entry is None:
                    reply = _stale_reply(rid, pad, length, offset + length <= size)
                    parts.append(reply)
                    sent += len(reply)
                    continue
                parts += (
                    pack(w.ST_OK, pad, rid, length),
                    _PADS[pad],
                    region[offset : offset + length],
                )
                sent += head + pad + length
                nbytes += length
            done = sock.sendmsg(parts)  # one gather send, nearly always the whole batch
            if done < sent - first:
                w.send_all(sock, parts, done)
            self.bytes_read += nbytes
        finally:
            if fence is not None:
                fence.end_reads([entry for entry in held if entry is not None])
        return sent - first, len(reads) * block_req

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


def _stale_reply(rid: int, pad: int, length: int, in_region: bool) -> bytes:
    """A refused checked read's reply, as long as the ok one would be (its ``pad`` +
    ``length`` bytes of payload) when the range lies ``in_region`` (else the whole
    message, unpadded: the reader's stream is lost anyway). Only the first ``pad``
    bytes carry text, the rest NULs: the reader receives this where the payload
    would land, so its buffer gets NULs, never text that could pass for bytes."""
    msg = _STALE_MSG[:pad].ljust(pad + length, b"\0") if in_region else _STALE_MSG
    return w.RESP.pack(w.ST_STALE, rid, len(msg)) + msg

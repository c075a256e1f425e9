"""One client connection of the TCP data path: handshake, requests, replies.

A ``DataConn`` is used by one thread at a time (``TcpTransport`` lends it
out of its pool). Reads land in the caller's buffer through a scatter
``recvmsg_into`` (reply header and its alignment pad + payload in one call,
no copy; the connection counts the bytes it received, which fixes each pad,
see ``tcp_wire``); writes leave through a gather ``sendmsg`` (request header,
its alignment pad + payload; the connection counts the bytes it sent, which
fixes each write's pad). Any exception leaves the stream position unknown: the owner must
close the connection. Before each receive of a reply the connection spins on its
socket for a bounded time instead of sleeping at once, longer for a write's answer
(``kvpool.transport.tcp_recv``: why, what it costs, how to turn it off).

The socket stays in blocking mode and the inactivity timeout is the kernel's
(``SO_RCVTIMEO``/``SO_SNDTIMEO``), not Python's ``settimeout``: a Python
timeout makes the socket non-blocking and puts a ``poll`` before every
``recv``, and each non-blocking recv returns whatever has arrived so far.
Measured (issue 17, ``perf stat`` syscall counts per 1 MiB read, client and
node together): raw socket 5 recv; Python timeout 9.75 recv + 9.75 poll;
kernel timeout 7 recv. A kernel timeout surfaces as ``BlockingIOError``
(EAGAIN), mapped to ``CallTimeoutError``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from kvpool.bindings.buffers import plain_host
from kvpool.errors import CallTimeoutError, ConnectionLostError, HandshakeRefusedError, RemoteError
from kvpool.rpc.frame import set_io_timeout
from kvpool.transport import tcp_congestion, tcp_recv
from kvpool.transport import tcp_wire as w
from kvpool.transport.fencing import IDENT
from kvpool.transport.tcp_recv import spin, spin_ack

_ZEROS = bytes(w.ALIGN)
_FENCE_STATUSES = (w.ST_OK, w.ST_STALE, w.ST_BUSY)  # a fenced op's answers (others raise)
ASK_MARGIN_S = 0.25  # a ``COMMITS`` answer's allowance past the wait it asked for
#: Replies one scatter receive takes at most (two iovecs each, far below IOV_MAX).
SCATTER_REPLIES = 64


class DataConn:
    def __init__(
        self, host: str, port: int, token: str | None, timeout: float, instance: str = ""
    ) -> None:
        addr = (host, port)
        try:
            sock = tcp_congestion.connect(addr, timeout)
        except TimeoutError as exc:
            raise CallTimeoutError(f"data connect to {addr} timed out") from exc
        except OSError as exc:
            raise ConnectionLostError(f"cannot open data connection to {addr}: {exc}") from exc
        self._timeout = timeout
        try:
            w.tune(sock)
            set_io_timeout(sock, timeout)
            opening = w.hello(token, instance)
            sock.sendall(opening)
            head = bytearray(w.HELLO_REPLY.size)
            w.recv_into_exact(sock, memoryview(head))
            magic, status, rlen = w.HELLO_REPLY.unpack(head)
            reason = bytearray(rlen)
            w.recv_into_exact(sock, memoryview(reason))
        except (TimeoutError, BlockingIOError) as exc:
            sock.close()
            raise CallTimeoutError(f"data handshake with {addr} timed out") from exc
        except (OSError, ConnectionLostError) as exc:
            sock.close()
            raise ConnectionLostError(f"data handshake with {addr} failed: {exc}") from exc
        if magic != w.MAGIC or status != w.ST_OK:
            sock.close()
            raise HandshakeRefusedError(reason.decode(errors="replace") or f"status {status}")
        self.sock = sock
        self._fd = sock.fileno()
        self._rid = 0
        self._resp = bytearray(w.RESP.size + w.ALIGN)  # a header and its largest pad
        self._resp_mv = memoryview(self._resp)
        self._received = w.HELLO_REPLY.size + rlen  # bytes read so far: fixes READ pads
        self._sent = len(opening)  # bytes sent so far: fixes WRITE pads

    def close(self) -> None:
        self.sock.close()

    def _next_rid(self) -> int:
        self._rid = (self._rid + 1) & 0xFFFFFFFF
        return self._rid

    def _next_rids(self, n: int) -> list[int]:
        """``n`` request ids in a row (``_next_rid`` n times, one list)."""
        first = self._rid
        self._rid = (first + n) & 0xFFFFFFFF
        return [(first + i) & 0xFFFFFFFF for i in range(1, n + 1)]

    def _read_resp(self, rid: int, payload: int = 0) -> int:
        spin_ack(self._fd, payload)
        w.recv_into_exact(self.sock, self._resp_mv[: w.RESP.size])
        status, got_rid, length = w.RESP.unpack_from(self._resp)
        self._received += w.RESP.size
        if status != w.ST_OK:
            msg = bytearray(w.message_length(length))
            w.recv_into_exact(self.sock, memoryview(msg))
            self._received += length
            raise RemoteError("data", msg.decode(errors="replace"))
        if got_rid != rid:
            raise ConnectionLostError(f"data stream out of sync (reply {got_rid} for {rid})")
        return int(length)

    def _recv_read(self, rid: int, payload: memoryview, flags: int = 0) -> None:
        """One READ reply: header, pad, payload in one scatter ``recvmsg_into``. The
        buffers are exactly the expected lengths, so an ok reply never over-reads
        into the next one. ``MSG_WAITALL`` in ``flags`` (checked reads, whose every
        reply is at least as long as an ok one, of up to ``w.WAITALL_MAX`` bytes):
        one syscall for the whole reply."""
        n, h = payload.nbytes, w.RESP.size
        pad = -(self._received + h) % w.ALIGN  # w.read_pad, inline: the hot path
        hdr = self._resp_mv[: h + pad]
        spin(self._fd, 1 if flags else h + pad + n)  # a large reply: 64 KiB first
        got = self.sock.recvmsg_into([hdr, payload] if n else [hdr], 0, flags)[0]
        if got == 0:
            raise ConnectionLostError("peer closed the data connection")
        if got < h:
            w.recv_into_exact(self.sock, hdr[got:h])
            got = h
        status, got_rid, length = w.RESP.unpack_from(self._resp)
        if status != w.ST_OK:  # an error carries no pad: its message came in hdr, then payload
            if got > h + length:  # a short error spilled the next reply into our buffers
                raise ConnectionLostError("data stream out of sync (short error reply)")
            early = bytes(hdr[h:got]) + bytes(payload[: max(0, got - h - pad)])
            msg = bytearray(w.message_length(length, max(w.MAX_MESSAGE, pad + n)))
            k = min(len(early), length)
            msg[:k] = early[:k]
            if k < length:
                w.recv_into_exact(self.sock, memoryview(msg)[k:])
            self._received += h + length
            raise RemoteError("data", msg.rstrip(b"\0").decode(errors="replace"))
        if got < h + pad:
            w.recv_into_exact(self.sock, hdr[got:])
            got = h + pad
        if got_rid != rid or length != n or self._resp[1] != pad:
            raise ConnectionLostError(f"data stream out of sync (reply {got_rid}/{length} B)")
        if got < h + pad + n:  # the rest as it arrives, spinning before each receive
            w.recv_scatter(self.sock, [payload[got - h - pad :]], h + pad + n - got)
        self._received += h + pad + n

    def read_one(self, offset: int, region: np.ndarray) -> None:
        rid = self._next_rid()
        self.sock.sendall(w.REQ.pack(w.OP_READ, 0, rid, offset, region.nbytes))
        self._sent += w.REQ.size
        self._recv_read(rid, w.byte_view(region))

    def read_many(self, plan: list[tuple[int, Any]]) -> None:
        """Pipelined: every request goes out before the first reply is read."""
        rids = self._next_rids(len(plan))
        self.sock.sendall(
            b"".join(
                w.REQ.pack(w.OP_READ, 0, rid, off, host.nbytes)
                for rid, (off, host) in zip(rids, plan, strict=True)
            )
        )
        self._sent += w.REQ.size * len(plan)
        for rid, (_, host) in zip(rids, plan, strict=True):
            self._recv_read(rid, w.byte_view(host))

    def read_block(self, offset: int, host: np.ndarray, ident: bytes) -> bool:
        """One checked read (``read_blocks`` of one, without its lists) into ``host``,
        a flat contiguous uint8 array (``plain_host``)."""
        self._rid = rid = (self._rid + 1) & 0xFFFFFFFF  # _next_rid, inline: the hot path
        request = w.REQ.pack(w.OP_READ_BLOCK, 0, rid, offset, host.nbytes) + ident
        self.sock.sendall(request)
        self._sent += len(request)
        try:
            self._recv_read(rid, memoryview(host), w.recv_flags(host.nbytes))  # type: ignore[arg-type]
        except RemoteError:  # the error reply was read whole: the stream is in sync
            return False
        return True

    def read_blocks(
        self, items: list[tuple[int, Any, bytes, int]], size: int
    ) -> tuple[list[bool], int] | None:
        """Checked reads (offset, host buffer, key, block offset), pipelined: per read,
        True, or False when the node no longer holds that block there; and the payload
        bytes served. None, nothing sent, when a read is not one this path takes: its
        buffer not writable contiguous host memory, its range not inside the region of
        ``size`` bytes, its key not 16 bytes (the caller checks or stages it).

        Every reply to a checked read is exactly as long as an ok one (a refusal
        is padded, see tcp_server), so where each header, pad and payload lands
        is known before any arrives. Where the ``tcp_recv`` extension is built one
        native call checks the reads, sends the requests, receives every reply
        (scatter receives, one ``MSG_WAITALL`` syscall for a small batch; see
        ``w.WAITALL_MAX``) and checks the headers, no Python per read; else the same
        in Python, ``SCATTER_REPLIES`` replies per scatter receive."""
        first, n = (self._rid + 1) & 0xFFFFFFFF, len(items)
        native = tcp_recv.read_blocks
        if native is not None:
            heads = bytearray(w.HEAD_STEP * n)
            start = self._received
            got = native(self._fd, items, first, start, heads, w.WAITALL_MAX, size)
            if got is None:
                return None
            found, at, self._received, served = got
            self._rid = (first + n - 1) & 0xFFFFFFFF
            self._sent += w.READ_BLOCK_REQ.size * n
            if at < n:  # raises: that reply was neither ok nor refused as stale
                hosts = [w.byte_view(host) for _, host, _, _ in items]
                pad = w.read_pads(start, hosts)[at]
                w.checked_reply_found(heads, at, (first + at) & 0xFFFFFFFF, pad, hosts[at])
                raise ConnectionLostError(f"data stream out of sync (reply {at} of {n})")
            return found, served
        for offset, host, key, block in items:
            if not plain_host(host, writable=True) or min(offset, block) < 0:
                return None
            if type(key) is not bytes or len(key) != 16 or offset + host.nbytes > size:
                return None
        pack, op, ident = w.REQ.pack, w.OP_READ_BLOCK, IDENT.pack
        requests = b"".join(
            [
                pack(op, 0, (first + i) & 0xFFFFFFFF, off, host.nbytes) + ident(key, block)
                for i, (off, host, key, block) in enumerate(items)
            ]
        )
        self._rid = (first + n - 1) & 0xFFFFFFFF
        self.sock.sendall(requests)
        self._sent += len(requests)
        found = []
        for at in range(0, n, SCATTER_REPLIES):
            hosts = [h for _, h, _, _ in items[at : at + SCATTER_REPLIES]]
            found += self._recv_replies(first + at, hosts)
        served = sum(host.nbytes for (_, host, _, _), ok in zip(items, found, strict=True) if ok)
        return found, served

    def _recv_replies(self, first: int, hosts: list[Any]) -> list[bool]:
        """The replies to pipelined checked reads (request ids from ``first``) into
        ``hosts``, in one scatter receive; per reply True, or False when refused
        (ST_STALE)."""
        h = w.RESP.size
        heads = bytearray(w.HEAD_STEP * len(hosts))
        mv = memoryview(heads)
        views, total = [], 0
        pads = w.read_pads(self._received, hosts)
        for i, (host, pad) in enumerate(zip(hosts, pads, strict=True)):
            views.append(mv[i * w.HEAD_STEP : i * w.HEAD_STEP + h + pad])
            if host.nbytes:
                views.append(w.byte_view(host))
            total += h + pad + host.nbytes
        w.recv_scatter(self.sock, views, total)
        self._received += total
        return [
            w.checked_reply_found(heads, i, (first + i) & 0xFFFFFFFF, pad, host)
            for i, (host, pad) in enumerate(zip(hosts, pads, strict=True))
        ]

    def stamped_one(
        self,
        op: int,
        stamp: bytes,
        off: int,
        data: np.ndarray,
        meanwhile: Callable[[], object] | None = None,
    ) -> int:
        """``stamped_many`` of one payload-carrying op (a put's final write) from a flat
        host array, without its lists: one gather send, then the status reply read
        into the connection's header buffer (its message, if any, after it).
        ``meanwhile`` runs between the two, while the node lands the payload and
        answers: work of the caller's that needs no answer costs no time there."""
        self._rid = rid = (self._rid + 1) & 0xFFFFFFFF  # _next_rid, inline: the hot path
        self._send_request(op, rid, off, data, stamp)
        if meanwhile is not None:
            meanwhile()
        h = w.RESP.size
        spin_ack(self._fd, data.nbytes)
        w.recv_into_exact(self.sock, self._resp_mv[:h])
        status, got_rid, length = w.RESP.unpack_from(self._resp)
        msg = bytearray(w.message_length(length))
        if length:
            w.recv_into_exact(self.sock, memoryview(msg))
        self._received += h + length
        return _fence_status(status, got_rid, rid, msg)

    def stamped_many(self, plan: list[tuple[int, bytes, int, Any]]) -> list[int]:
        """Fenced ops (op, packed stamp, offset, payload or None), pipelined; the
        status of each (ST_OK, ST_STALE or ST_BUSY; others raise)."""
        sent = self._sent  # the sends run first: arguments are evaluated left to right
        return self.stamped_statuses(self.stamped_send(plan), self._sent - sent)

    def stamped_send(self, plan: list[tuple[int, bytes, int, Any]]) -> list[int]:
        """Send fenced ops (op, packed stamp, offset, payload: None, a host buffer, or a
        list of them sent back to back as the op's bytes); their request ids, for
        ``stamped_statuses``. The whole run leaves in one gather ``sendmsg`` (more only
        past ``tcp_wire.IOV_MAX`` parts or a short send): on loopback each send runs the
        node's receive path on this CPU and wakes the node once (issue 17, session 47)."""
        rids = self._next_rids(len(plan))
        parts: list[bytes | memoryview] = []
        heads = bytearray()  # requests since the last payload: one part (a refill's claims)
        sent = self._sent
        for rid, (op, stamp, off, data) in zip(rids, plan, strict=True):
            if data is None:
                heads += w.REQ.pack(op, 0, rid, off, 0) + stamp
                continue
            views = [w.byte_view(d) for d in (data if isinstance(data, list) else [data])]
            n = sum(v.nbytes for v in views)
            pad = w.write_pad(sent + len(heads) + w.REQ.size + len(stamp))
            heads += w.REQ.pack(op, pad, rid, off, n) + stamp + _ZEROS[:pad]
            parts += (bytes(heads), *views)
            sent += len(heads) + n
            heads.clear()
        if heads:
            parts.append(bytes(heads))
            sent += len(heads)
        w.send_all(self.sock, parts)
        self._sent = sent
        return rids

    def _send_request(self, op: int, rid: int, off: int, data: Any, extra: bytes) -> None:
        """REQ + ``extra`` (a STAMP) [+ pad + payload] in one gather send; a
        payload-carrying op's pad puts its payload at an aligned stream offset."""
        payload = None if data is None else w.byte_view(data)
        n = 0 if payload is None else payload.nbytes
        pad = w.write_pad(self._sent + w.REQ.size + len(extra)) if op in w.PAYLOAD_OPS else 0
        head = w.REQ.pack(op, pad, rid, off, n) + extra + _ZEROS[:pad]
        w.send_parts(self.sock, head, payload)
        self._sent += len(head) + n

    def stamped_statuses(self, rids: list[int], payload: int = 0) -> list[int]:
        """The status replies to ``rids`` (``payload``: the bytes their requests sent),
        in as few receives as they arrive in (the node answers a pipelined batch of
        payload-less ops with one send).

        A receive never asks for more than the replies still owed hold at the least
        (a header each, plus the message of one whose header is in), so it never
        reads into a later reply on this connection."""
        h = w.RESP.size
        pending = bytearray()  # received, not parsed yet
        out: list[int] = []
        for rid, left in zip(rids, range(len(rids), 0, -1), strict=True):
            self._recv_owed(pending, h, h * left, payload)
            status, got_rid, length = w.RESP.unpack_from(pending)
            if length:
                self._recv_owed(pending, h + w.message_length(length), h * left + length, payload)
            msg = bytes(pending[h : h + length])
            del pending[: h + length]
            self._received += h + length
            out.append(_fence_status(status, got_rid, rid, msg))
        return out

    def _recv_owed(self, pending: bytearray, need: int, owed: int, payload: int) -> None:
        """Receive until ``pending`` holds ``need`` bytes, asking each time for at most
        the ``owed`` bytes (counted from ``pending``'s start) known to be on their way
        (answers to writes that sent ``payload`` bytes: ``spin_ack``)."""
        while len(pending) < need:
            spin_ack(self._fd, payload)
            chunk = self.sock.recv(owed - len(pending))
            if not chunk:
                raise ConnectionLostError("peer closed the data connection")
            pending += chunk

    def commit_outcomes(self, ids: list[tuple[int, int]], wait_s: float) -> bytes:
        """``COMMITS``: the node's state byte for each (allocation id, block offset),
        once none is owed any more or ``wait_s`` passed. No answer within ``wait_s``
        + ``ASK_MARGIN_S`` (a stopped node) times out: a flush never waits on a node
        longer than it meant to."""
        rid = self._next_rid()
        body = b"".join([w.COMMIT_ID.pack(alloc_id, offset) for alloc_id, offset in ids])
        request = w.REQ.pack(w.OP_COMMITS, 0, rid, int(wait_s * 1e6), len(body)) + body
        set_io_timeout(self.sock, min(self._timeout, wait_s + ASK_MARGIN_S))
        try:
            self.sock.sendall(request)
            self._sent += len(request)
            states = bytearray(w.message_length(self._read_resp(rid), len(ids)))
            w.recv_into_exact(self.sock, memoryview(states))
        finally:
            set_io_timeout(self.sock, self._timeout)
        self._received += len(states)
        if len(states) != len(ids):
            raise ConnectionLostError(f"{len(states)} commit answers for {len(ids)} asks")
        return bytes(states)

    def write_many(self, plan: list[tuple[int, np.ndarray]]) -> None:
        rids, sent = self._next_rids(len(plan)), self._sent
        for rid, (off, data) in zip(rids, plan, strict=True):
            self._send_request(w.OP_WRITE, rid, off, data, b"")
        for rid in rids:  # a write's acknowledgement carries no bytes
            w.message_length(self._read_resp(rid, self._sent - sent), 0)


def _fence_status(status: int, got_rid: int, rid: int, msg: bytes | bytearray) -> int:
    """A fenced op's reply to request ``rid``, read whole (its message ``msg`` too):
    ST_OK, ST_STALE or ST_BUSY; another status raises ``RemoteError`` (the stream
    stays in sync), a reply to another request ``ConnectionLostError``."""
    if status not in _FENCE_STATUSES:
        raise RemoteError("data", msg.decode(errors="replace"))
    if got_rid != rid:
        raise ConnectionLostError(f"data stream out of sync (reply {got_rid} for {rid})")
    return int(status)

"""The data server's checked reads (``READ_BLOCK``): bytes served only while their block holds them.

A checked read names its block (``IDENT``: key, block offset). The server asks
the write fence (kvpool.transport.fencing) to hold that block for the read,
sends the range straight from the region, and lets the block go when the send
ended; a range that holds another block now is answered ``ST_STALE``, padded to
the ok reply's length, so a client that placed every reply of a pipeline ahead
of time stays in step (kvpool.transport.tcp_wire). A pipelined batch buffered
whole is answered with one gather send (``GATHER_MAX`` requests, ``GATHER_BYTES``
of payload at most), its blocks held by one fence call.

``CheckedReads`` serves them for one data server (kvpool.transport.tcp_server);
every connection's thread calls it. Given the node's read gate, a read alone
whose block's identity record names it is served in one native call, held by
the gate's count instead of the fence (kvpool.transport.tcp_read_gate), and so is
a pipelined batch's longest prefix the gate takes; the others as above.
Invariant: a block is held from before its first byte is sent until its send
ended (or failed), and released exactly once.
"""

from __future__ import annotations

import socket
from typing import Any

from kvpool.transport import tcp_wire as w
from kvpool.transport.fencing import WriteFence
from kvpool.transport.tcp_inbox import Inbox
from kvpool.transport.tcp_read_gate import ReadGate

_STALE_MSG = b"that block no longer holds this range"
#: Checked reads one gather send answers, at most: requests, payload bytes so far.
#: A batch of 8 x 1 MiB in one send, not eight: between sends the server's Python
#: leaves the socket idle and the reader waits (1 MiB here cost 0.92 -> 0.95 of a raw
#: stream, 4 MiB 0.96 -> 1.02; session 41). The byte cap bounds how long one send
#: holds its blocks against a newer write.
GATHER_MAX, GATHER_BYTES = 64, 16 << 20
_BLOCK = w.READ_BLOCK_REQ
_BLOCK_REQ = _BLOCK.size
PADS = tuple(bytes(n) for n in range(w.ALIGN))  # an ok reply's pad, by length: no slicing


class CheckedReads:
    """The checked reads of one data server's ``region`` (a flat byte view)."""

    def __init__(
        self, region: memoryview, fence: WriteFence | None, gate: ReadGate | None = None
    ) -> None:
        self._mv, self.size, self.fence = region, region.nbytes, fence
        self._serve = None if gate is None else gate.serve  # None: every read in Python
        self.bytes_read = 0  # payload bytes served (the server's plain reads count here too)
        self.gated = 0  # checked reads the read gate served

    def one(self, sock: socket.socket, inbox: Inbox, sent: int) -> int:
        """The checked read at the head of ``inbox``, alone (``batch`` without its
        lists, Inbox.take inline); the bytes sent. Served only while the named block
        holds the range, held until the send ends; else ST_STALE as long as an ok reply."""
        at = inbox.start
        if inbox.end - at >= _BLOCK_REQ:
            if self._serve is not None and (gated := self._gated(sock, inbox, sent, 1)):
                return gated[0]
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
            parts: list[bytes | memoryview] = [head, PADS[pad], self._mv[offset : offset + length]]
            done = sock.sendmsg(parts)  # one gather send, nearly always the whole reply
            if done < total:
                w.send_all(sock, parts, done)
            self.bytes_read += length
        finally:
            assert fence is not None
            fence.end_read(held)
        return total

    def batch(self, sock: socket.socket, inbox: Inbox, sent: int) -> tuple[int, int]:
        """The checked read at the head of ``inbox`` and each whole one buffered behind
        it (a pipelined batch, up to GATHER_*), answered with one gather send; their
        blocks held (one fence call for all) until the send ends; (bytes sent, bytes
        received). The caller saw the first two whole: both checked reads."""
        start, block_req, read_block = inbox.start, _BLOCK_REQ, w.OP_READ_BLOCK
        if self._serve is not None and (gated := self._gated(sock, inbox, sent, GATHER_MAX)):
            return gated
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
                    PADS[pad],
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

    def _gated(
        self, sock: socket.socket, inbox: Inbox, sent: int, max_n: int
    ) -> tuple[int, int] | None:
        """The node's read gate first (kvpool.transport.tcp_read_gate): the checked
        reads at the head of ``inbox`` it serves, at most ``max_n`` (bytes sent, bytes
        received); None when it takes none, nothing sent."""
        assert self._serve is not None
        at = inbox.start
        got = self._serve(sock.fileno(), inbox.buf, at, inbox.end, sent, max_n, GATHER_BYTES)
        if got is None:
            return None
        n, done, payload = got
        inbox.start = at + n * _BLOCK_REQ
        self.bytes_read += payload
        self.gated += n
        return done, n * _BLOCK_REQ


def _stale_reply(rid: int, pad: int, length: int, in_region: bool) -> bytes:
    """A refused checked read's reply, as long as the ok one would be (its ``pad`` +
    ``length`` bytes of payload) when the range lies ``in_region`` (else the whole
    message, unpadded: the reader's stream is lost anyway). Only the first ``pad``
    bytes carry text, the rest NULs: the reader receives this where the payload
    would land, so its buffer gets NULs, never text that could pass for bytes."""
    msg = _STALE_MSG[:pad].ljust(pad + length, b"\0") if in_region else _STALE_MSG
    return w.RESP.pack(w.ST_STALE, rid, len(msg)) + msg

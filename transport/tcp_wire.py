"""Binary wire format of the TCP data path (payloads are raw bytes, not msgpack).

Connection start: the client sends ``HELLO`` (magic, version, token length,
instance length) followed by the token's and the expected server instance's
UTF-8 bytes; the server answers ``HELLO_REPLY`` (magic, status, reason
length) + reason. Status 0 is ok; otherwise the server closes the
connection. The instance is a random id each data server draws when it
starts (advertised in ``RegionInfo.tcp_instance``): a client that learned a
node's offsets from an earlier incarnation on the same host and port is
refused (``ST_WRONG_INSTANCE``) instead of reading or writing someone
else's bytes. An empty instance skips the check. ``hello`` builds the
client's side, ``answer_hello`` runs the server's.

Then any number of requests, answered strictly in order:

- ``REQ`` (op, pad, request id, offset, length); a WRITE is followed by
  ``pad`` zero bytes and then exactly ``length`` payload bytes;
- stamped ops (the node's write fence, kvpool.transport.fencing): ``REQ``
  then a ``STAMP``; ``WRITE_FINAL`` / ``WRITE_PART`` then carry ``length``
  payload bytes (the whole block, which the node then knows complete; or a
  part of it); ``CLAIM`` / ``SEAL`` / ``RELEASE`` carry none and bracket a
  write made another way (same-host shared memory, UCX). A refused stamp
  gets ``ST_STALE`` or ``ST_BUSY`` (its pad and payload are drained: the
  connection stays usable); ``READ_BLOCK`` (+ ``IDENT``) is a READ answered ``ST_STALE``
  when the range no longer holds the named block, that refusal exactly as long as
  an ok reply (its message cut to the ok reply's pad, NULs in place of the payload), so a
  client places every reply of a pipeline of checked reads before any arrives (one
  scatter receive); a server may answer a batch of them with one gather send;
- commits by the node (kvpool.cluster.node_commits; a node that takes them says so in
  ``RegionInfo.tcp_node_commits``): ``WRITE_COMMIT`` is a ``WRITE_FINAL`` whose writer
  asks the node to send the block's master commit once it is whole (its ok reply:
  the block is whole and owed that commit); ``COMMITS`` (no stamp; its ``offset``:
  how many microseconds the node may wait for commits still owed) carries ``length``
  bytes of ``COMMIT_ID`` (allocation id, block offset) and is answered with one
  state byte per id (kvpool.transport.shm_seal's ``NODE_COMMITS`` while owed,
  ``VISIBLE``, ``NOT_COMMITTED``, or ``UNKNOWN``: the node has no answer for it);
- ``RESP`` (status, request id, length); for an ok READ or READ_BLOCK ``pad``
  zero bytes (``RESP``'s second byte, 0-63) and then ``length`` payload bytes
  follow; for an error, ``length`` bytes of UTF-8 message follow (no pad).

The pad puts every READ payload at a stream offset that is a multiple of
``ALIGN`` (counted from the first byte the server sends, the hello reply
included), so the kernel copies it cacheline-aligned on both ends: a payload
16 bytes off alignment (the bare header) cost ~15% of loopback read
throughput on AMD EPYC (p10, 1 MiB; a 64-byte prefix none). Both ends know
the pad without asking: it is ``read_pad(bytes the server sent so far)``;
the header repeats it so a desynchronised stream is caught. Every reply the
server sends counts, stamped ones included.

WRITE payloads are aligned the same way in the other direction (protocol 4):
the request's pad (``REQ``'s second byte) is ``write_pad(bytes the client
sent so far, this request's header and STAMP included)``, counted from the
client's first hello byte; requests without a payload have pad 0. The server
counts what it received and refuses (closing the connection) a request whose
pad differs. Why (issue 17, raw sockets, pinned, interleaved): a put whose
payload followed a bare 24-byte header ran at 0.78-0.88x of one after a
64-byte header at 1 MiB.

A WRITE with a bad range is answered with an error and the connection is
closed (its payload is never drained); a READ with a bad range gets an error
and the connection stays usable.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import struct
from typing import Any

from kvpool.errors import ConnectionLostError, RemoteError
from kvpool.rpc.auth import token_matches
from kvpool.rpc.frame import tune_socket
from kvpool.transport import tcp_recv
from kvpool.transport.fencing import IDENT

log = logging.getLogger("kvpool.transport.tcp")
MAGIC = b"KVDT"
VERSION = 4  # 3: READ payloads aligned (pad after the reply header); 4: WRITE payloads too
HELLO = struct.Struct("!4sHHH")  # magic, version | token length, instance length
HELLO_HEAD = struct.Struct("!4sH")  # what every version starts with
HELLO_LENGTHS = struct.Struct("!HH")
MAX_HELLO_FIELD = 1024  # token or instance bytes a server reads before authenticating
HELLO_REPLY = struct.Struct("!4sBxH")
REQ = struct.Struct("!BBxxIQQ")  # op, pad (WRITE payloads), request id, offset, length
RESP = struct.Struct("!BxxxIQ")
READ_RESP = struct.Struct("!BBxxIQ")  # an ok READ's RESP: status, pad, request id, length
#: A checked read's request, whole: ``REQ`` (op READ_BLOCK, pad 0) + ``IDENT``
READ_BLOCK_REQ = struct.Struct(REQ.format + IDENT.format[1:])
ALIGN = 64

OP_READ, OP_WRITE, OP_PING = 1, 2, 3
OP_WRITE_FINAL, OP_WRITE_PART, OP_CLAIM, OP_SEAL, OP_RELEASE = 4, 5, 6, 7, 8  # + STAMP
OP_READ_BLOCK = 9  # + IDENT: a READ served only if that block still holds the range
OP_WRITE_COMMIT, OP_COMMITS = 10, 11  # commits by the node: a final write; its answers
STAMPED_OPS = frozenset(
    (OP_WRITE_FINAL, OP_WRITE_PART, OP_CLAIM, OP_SEAL, OP_RELEASE, OP_READ_BLOCK, OP_WRITE_COMMIT)
)
PAYLOAD_OPS = frozenset((OP_WRITE, OP_WRITE_FINAL, OP_WRITE_PART, OP_WRITE_COMMIT))  # + pad
COMMIT_ID = struct.Struct("!QQ")  # what ``COMMITS`` asks about: allocation id, block offset
MAX_COMMIT_IDS = 1 << 16  # ids one ``COMMITS`` may name
UNKNOWN = 0xFF  # a ``COMMITS`` answer: no such block owed or answered (or forgotten)
ST_OK, ST_BAD_VERSION, ST_BAD_TOKEN, ST_RANGE, ST_BAD_OP, ST_WRONG_INSTANCE = 0, 1, 2, 3, 4, 5
ST_STALE, ST_BUSY = 6, 7  # the write fence refused the stamp (kvpool.transport.fencing)

SOCK_BUF = 8 * 1024 * 1024
MAX_CHUNK = 1 << 30  # per recv_into/send call; keeps counts well inside int limits
IOV_MAX = 512  # buffers one scatter/gather call takes at most (Linux refuses over 1024)
#: Replies up to this many bytes are received with one blocking ``MSG_WAITALL`` call;
#: larger ones with plain receives that return what has arrived. Why (issue 17,
#: session 9, loopback, client and node pinned apart): a 1 MiB checked read ran at
#: 0.82-0.88x a raw socket's speed with MSG_WAITALL and 1.03-1.06x without it
#: (4 interleaved pairs; 4 MiB and batches of 8 gained less, 64 KiB nothing).
#: Our reading of why: a MSG_WAITALL receive keeps the socket owned by the reader
#: for the whole reply, so segments arriving meanwhile wait on the socket's backlog
#: and their TCP processing runs on the reader's CPU after its copies, instead of on
#: the sender's CPU while it copies. Below this size a reply mostly arrives whole,
#: and the one call is the cheaper way to take it.
WAITALL_MAX = 128 << 10
#: The longest error message a data server sends (its texts run to ~100 B; a refused
#: checked read's, padded as long as an ok reply, is checked against that reply).
MAX_MESSAGE = 64 << 10


def recv_flags(nbytes: int) -> int:
    """The flags a receive of a whole reply of ``nbytes`` bytes uses (``WAITALL_MAX``)."""
    return socket.MSG_WAITALL if nbytes <= WAITALL_MAX else 0


def hello(token: str | None, instance: str = "") -> bytes:
    """The client's opening bytes."""
    tok, inst = (token or "").encode(), instance.encode()
    return HELLO.pack(MAGIC, VERSION, len(tok), len(inst)) + tok + inst


def read_pad(sent: int) -> int:
    """Zero bytes after an ok READ's header when the server has sent ``sent`` bytes
    on the connection before it: the payload then starts at a multiple of ALIGN."""
    return -(sent + RESP.size) % ALIGN


#: Room for a checked read's reply header and its largest pad: where a client places
#: reply ``i``'s header of a pipeline (``heads[i * HEAD_STEP]``).
HEAD_STEP = RESP.size + ALIGN


def read_pads(received: int, hosts: list[Any]) -> list[int]:
    """The pad of each reply to checked reads into ``hosts`` when the server has
    sent ``received`` bytes before the first (``read_pad``, reply by reply)."""
    pads = []
    for host in hosts:
        pad = read_pad(received)
        pads.append(pad)
        received += RESP.size + pad + host.nbytes
    return pads


def message_length(length: int, most: int = MAX_MESSAGE) -> int:
    """``length``, an error reply's message length from its header, checked before a
    buffer that long is made: past ``most`` the header was no reply's (the stream is
    out of sync), and allocating it would fail or take the host's memory."""
    if length > most:
        raise ConnectionLostError(f"data stream out of sync (a reply of {length} B)")
    return length


def checked_reply_found(heads: bytearray, i: int, rid: int, pad: int, host: Any) -> bool:
    """Reply ``i`` of a pipeline of checked reads, its header (and pad) at
    ``heads[i * HEAD_STEP]``, its payload in ``host``: True when ok, False when
    refused (ST_STALE); anything else raises (``ConnectionLostError`` for a reply
    out of sync, ``RemoteError`` for another refusal, the stream then in sync)."""
    h, at = RESP.size, i * HEAD_STEP
    status, got_rid, length = RESP.unpack_from(heads, at)
    if got_rid != rid:
        raise ConnectionLostError(f"data stream out of sync (reply {got_rid} for {rid})")
    if status == ST_OK:
        if length != host.nbytes or heads[at + 1] != pad:
            raise ConnectionLostError(f"data stream out of sync (reply {rid}: {length} B)")
        return True
    if length != pad + host.nbytes:  # an error not padded like an ok reply
        raise ConnectionLostError("data stream out of sync (short error reply)")
    if status != ST_STALE:
        msg = bytes(heads[at + h : at + h + pad]) + bytes(byte_view(host))
        raise RemoteError("data", msg.rstrip(b"\0").decode(errors="replace"))
    return False


def write_pad(sent: int) -> int:
    """Zero bytes between a payload-carrying request's header and its payload when
    the client has sent ``sent`` bytes on the connection, that header included:
    the payload then starts at a multiple of ALIGN."""
    return -sent % ALIGN


def hello_size(token_bytes: int, instance_bytes: int) -> int:
    """Bytes of a hello (both ends start counting the client's stream with it)."""
    return HELLO.size + token_bytes + instance_bytes


def tune(sock: socket.socket) -> None:
    """NODELAY + keepalive (``tune_socket``) and large kernel buffers (best effort)."""
    tune_socket(sock)
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, opt, SOCK_BUF)


def recv_into_exact(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` entirely (zero-copy into its memory); EOF -> ConnectionLostError."""
    got, n = 0, view.nbytes
    while got < n:  # the first recv nearly always fills a small view: no slice for it
        k = sock.recv_into(view[got:] if got else view, min(n - got, MAX_CHUNK))
        if k == 0:
            raise ConnectionLostError(f"peer closed the data connection ({got} of {n} B received)")
        got += k


def recv_padded(sock: socket.socket, pad: memoryview, payload: memoryview) -> None:
    """Fill ``pad`` (the bytes to skip) then ``payload``: a write's bytes, known to
    be on their way. Where the ``tcp_recv`` extension is built, one native call
    fills both, spinning before each receive with the GIL released (the node
    neither sleeps between the chunks of a large payload nor runs Python per
    chunk); else one scatter ``recvmsg_into`` takes the pad and what has arrived
    of the payload, and ``recv_into_exact`` the rest."""
    fill = tcp_recv.recv_all
    if fill is not None:
        total = pad.nbytes + payload.nbytes
        got = fill(sock.fileno(), [pad, payload] if pad.nbytes else [payload], 0)
        if got < total:
            raise ConnectionLostError(
                f"peer closed the data connection ({got} of {total} B of a write received)"
            )
        return
    if not pad.nbytes:
        recv_into_exact(sock, payload)
        return
    got = sock.recvmsg_into([pad, payload[:MAX_CHUNK]])[0]
    if got == 0:
        raise ConnectionLostError("peer closed the data connection (0 B of a write received)")
    if got < pad.nbytes:
        recv_into_exact(sock, pad[got:])
        got = pad.nbytes
    recv_into_exact(sock, payload[got - pad.nbytes :])


def send_parts(sock: socket.socket, header: bytes, payload: memoryview | None) -> None:
    """Send header + payload with one gather ``sendmsg`` (``send_all`` sends the rest)."""
    if payload is None or payload.nbytes == 0:
        sock.sendall(header)
        return
    sent = sock.sendmsg([header, payload[:MAX_CHUNK]])
    if sent < len(header) + payload.nbytes:
        send_all(sock, [header, payload], sent)


def recv_scatter(sock: socket.socket, views: list[memoryview], total: int) -> None:
    """Fill every view (``total`` bytes in all), in order: up to ``WAITALL_MAX``
    bytes with ``MSG_WAITALL`` receives (one, unless a timeout or a signal cuts it
    short), more as they arrive; EOF -> ConnectionLostError. A client's receive:
    it spins before each one (``tcp_recv``), all of it in one native call where
    the extension is built."""
    flags = recv_flags(total)
    fill = tcp_recv.recv_all
    if fill is not None:
        got = fill(sock.fileno(), views, flags)
        if got < total:
            raise ConnectionLostError(f"peer closed the data connection ({got} of {total} B)")
        return
    got = 0
    while True:  # no extension (so no spinning either): the same loop in Python
        _skip(views, got)
        if not views:
            return
        got = sock.recvmsg_into(_iov(views), 0, flags)[0]
        if got == 0:
            raise ConnectionLostError(f"peer closed the data connection ({total} B expected)")


def send_all(sock: socket.socket, parts: list[bytes | memoryview], done: int = 0) -> None:
    """Send every part, in order, with gather ``sendmsg`` calls (one, nearly always);
    ``done``: bytes of them already sent (the rest after a short send)."""
    views = [memoryview(p) for p in parts]
    _skip(views, done)
    while views:
        _skip(views, sock.sendmsg(_iov(views)))


def _skip(views: list[memoryview], n: int) -> None:
    """Drop the first ``n`` bytes of ``views`` (what a scatter/gather call moved): the
    whole views in one slice deletion (a batch's send can hold thousands of views, and
    one ``pop(0)`` each moved the rest of the list every time)."""
    whole = 0
    while whole < len(views) and n >= views[whole].nbytes:
        n -= views[whole].nbytes
        whole += 1
    del views[:whole]
    if views and n:
        views[0] = views[0][n:]


def _iov(views: list[memoryview]) -> list[memoryview]:
    """The views one scatter/gather call may take: up to the first over ``MAX_CHUNK``,
    cut to it, and ``IOV_MAX`` at most (the views after them wait: the stream's bytes
    stay in order)."""
    out = []
    for v in views[:IOV_MAX]:
        if v.nbytes > MAX_CHUNK:
            out.append(v[:MAX_CHUNK])
            break
        out.append(v)
    return out


def byte_view(arr: object) -> memoryview:
    """A flat unsigned-byte memoryview of a (host) buffer."""
    mv = memoryview(arr)  # type: ignore[arg-type]
    return mv if mv.format == "B" and mv.ndim == 1 else mv.cast("B")


def answer_hello(
    sock: socket.socket, token: str | None, instance: str, peer: object
) -> tuple[bool, int, int]:
    """The server's side of the handshake: read the client's hello, check its magic,
    version, token (``kvpool.rpc.auth``) and the incarnation (``instance``) it
    expects, and answer. (accepted, bytes sent: the reply, bytes received: the hello)."""
    head = bytearray(HELLO_HEAD.size)
    recv_into_exact(sock, memoryview(head))
    magic, version = HELLO_HEAD.unpack(head)
    status, reason = ST_OK, ""
    if magic != MAGIC:
        status, reason = ST_BAD_VERSION, "not a kvpool data connection"
    elif version != VERSION:  # answered before reading a body we cannot parse
        status, reason = ST_BAD_VERSION, f"data protocol {version} unsupported"
    else:
        lengths = bytearray(HELLO_LENGTHS.size)
        recv_into_exact(sock, memoryview(lengths))
        tlen, ilen = HELLO_LENGTHS.unpack(lengths)
        if tlen > MAX_HELLO_FIELD or ilen > MAX_HELLO_FIELD:
            log.warning("refused data connection from %s: oversized hello", peer)
            return False, 0, 0  # nothing read or allocated past the lengths
        got_token, got_instance = bytearray(tlen), bytearray(ilen)
        recv_into_exact(sock, memoryview(got_token))
        recv_into_exact(sock, memoryview(got_instance))
        if not token_matches(token, got_token.decode(errors="replace")):
            status, reason = ST_BAD_TOKEN, "wrong token" if tlen else "missing token"
        elif got_instance and got_instance.decode(errors="replace") != instance:
            status = ST_WRONG_INSTANCE
            reason = "this data server is another incarnation of the node (it restarted)"
    if status != ST_OK:
        log.warning("refused data connection from %s: %s", peer, reason)
    msg = reason.encode()
    reply = HELLO_REPLY.pack(MAGIC, status, len(msg)) + msg
    sock.sendall(reply)
    if status != ST_OK:
        return False, len(reply), 0
    return True, len(reply), hello_size(tlen, ilen)

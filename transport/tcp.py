"""Client side of the TCP data path: zero-copy ``recv_into`` / ``sendmsg``.

One connection per transport (opened lazily, re-opened after any failure),
guarded by a lock; batch calls pipeline every request before reading the
answers. Host destinations are filled by ``recv_into`` directly; device (CUDA)
buffers go through a host staging buffer (page-locked where CUDA exists) and
one ``copy_region``.

Timeouts are inactivity timeouts: no socket operation waits more than
``timeout`` seconds for the peer. After a timeout or any I/O error the
connection is dropped (its stream position is unknown) and the error is
raised as ``CallTimeoutError`` / ``ConnectionLostError``.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvpool.bindings.buffers import as_region, copy_region, region_is_device, region_nbytes
from kvpool.errors import (
    BufferSpecError,
    CallTimeoutError,
    ConnectionLostError,
    HandshakeRefusedError,
    KVPoolError,
    RemoteError,
)
from kvpool.rpc_auth import resolve_token
from kvpool.transport import tcp_wire as w
from kvpool.transport.base import RegionInfo, Transport, check_range


class TcpTransport(Transport):
    name = "tcp"

    def __init__(self, info: RegionInfo, *, token: str | None = None, timeout: float = 10.0):
        super().__init__(info)
        if not info.tcp_port:
            raise ConnectionLostError(f"node {info.node_id} serves no TCP data port")
        self.token = resolve_token(token)
        self.timeout = timeout
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()
        self._rid = 0
        self._resp = bytearray(w.RESP.size)
        self._resp_mv = memoryview(self._resp)

    # --- connection -----------------------------------------------------------

    def _connect(self) -> socket.socket:
        addr = (self.info.tcp_host, self.info.tcp_port)
        try:
            sock = socket.create_connection(addr, timeout=self.timeout)
            w.tune(sock)
            token = (self.token or "").encode()
            sock.sendall(w.HELLO.pack(w.MAGIC, w.VERSION, len(token)) + token)
            head = bytearray(w.HELLO_REPLY.size)
            w.recv_into_exact(sock, memoryview(head))
            magic, status, rlen = w.HELLO_REPLY.unpack(head)
            reason = bytearray(rlen)
            w.recv_into_exact(sock, memoryview(reason))
        except TimeoutError as exc:
            raise CallTimeoutError(f"data connect to {addr} timed out") from exc
        except OSError as exc:
            raise ConnectionLostError(f"cannot open data connection to {addr}: {exc}") from exc
        if magic != w.MAGIC or status != w.ST_OK:
            sock.close()
            raise HandshakeRefusedError(reason.decode(errors="replace") or f"status {status}")
        return sock

    def _drop(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def close(self) -> None:
        with self._lock:
            self._drop()

    def _io(self, fn: Any, *args: Any) -> None:
        """Run ``fn(sock, *args)`` under the lock, mapping failures to kvpool errors."""
        with self._lock:
            try:
                if self._sock is None:
                    self._sock = self._connect()
                fn(self._sock, *args)
            except KVPoolError:  # RemoteError included: the stream may hold unread replies
                self._drop()
                raise
            except TimeoutError as exc:
                self._drop()
                raise CallTimeoutError(f"data transfer with {self.info.node_id} timed out") from exc
            except OSError as exc:
                self._drop()
                raise ConnectionLostError(f"data connection to {self.info.node_id}: {exc}") from exc
            except BaseException:
                self._drop()
                raise

    def _next_rid(self) -> int:
        self._rid = (self._rid + 1) & 0xFFFFFFFF
        return self._rid

    def _read_resp(self, sock: socket.socket, rid: int) -> int:
        w.recv_into_exact(sock, memoryview(self._resp))
        status, got_rid, length = w.RESP.unpack(self._resp)
        if status != w.ST_OK:
            msg = bytearray(length)
            w.recv_into_exact(sock, memoryview(msg))
            raise RemoteError("data", msg.decode(errors="replace"))
        if got_rid != rid:
            raise ConnectionLostError(f"data stream out of sync (reply {got_rid} for {rid})")
        return int(length)

    def _recv_read(self, sock: socket.socket, rid: int, payload: memoryview) -> None:
        """Receive one READ reply: header and payload with one scatter ``recvmsg_into``.

        The payload buffer is exactly the expected length, so an ok reply never
        over-reads into the next one; on any error the caller drops the stream.
        """
        hdr, n, h = self._resp_mv, payload.nbytes, w.RESP.size
        got = sock.recvmsg_into([hdr, payload] if n else [hdr])[0]
        if got == 0:
            raise ConnectionLostError("peer closed the data connection")
        if got < h:
            w.recv_into_exact(sock, hdr[got:])
            got = h
        status, got_rid, length = w.RESP.unpack(self._resp)
        body = got - h
        if status != w.ST_OK:
            msg = bytearray(length)
            msg[: min(body, length)] = payload[: min(body, length)]
            if body < length:
                w.recv_into_exact(sock, memoryview(msg)[body:])
            raise RemoteError("data", msg.decode(errors="replace"))
        if got_rid != rid or length != n:
            raise ConnectionLostError(f"data stream out of sync (reply {got_rid}/{length} B)")
        if body < n:
            w.recv_into_exact(sock, payload[body:])

    # --- transfers --------------------------------------------------------------

    def read_into(self, offset: int, out: Any) -> None:
        if type(out) is np.ndarray and out.dtype == np.uint8 and out.ndim == 1:
            region = out if out.flags.writeable else as_region(out, writable=True)
        else:
            region = as_region(out, writable=True, what="output buffer")
        if region_is_device(region):
            self.read_many([(offset, out)])
            return
        check_range(offset, region.nbytes, self.info.size)
        self._io(self._read_one, offset, region)
        self.bytes_read += region.nbytes

    def _read_one(self, sock: socket.socket, offset: int, region: np.ndarray) -> None:
        rid = self._next_rid()
        sock.sendall(w.REQ.pack(w.OP_READ, rid, offset, region.nbytes))
        self._recv_read(sock, rid, w.byte_view(region))

    def write(self, offset: int, data: Any) -> None:
        region = as_region(data, what="data")
        if region_is_device(region):
            self.write_many([(offset, data)])
            return
        check_range(offset, region.nbytes, self.info.size)
        self._io(self._write_many, [(offset, region)])
        self.bytes_written += region.nbytes

    def read_many(self, items: Sequence[tuple[int, Any]]) -> None:
        plan = []  # (offset, host region to fill, device region or None)
        for offset, out in items:
            region = as_region(out, writable=True, what="output buffer")
            check_range(offset, region_nbytes(region), self.info.size)
            host = _staging(region_nbytes(region)) if region_is_device(region) else region
            plan.append((offset, host, region if region_is_device(region) else None))
        self._io(self._read_many, plan)
        for _, host, device in plan:
            if device is not None:
                copy_region(device, host)
            self.bytes_read += host.nbytes

    def _read_many(self, sock: socket.socket, plan: list[tuple[int, Any, Any]]) -> None:
        rids = [self._next_rid() for _ in plan]
        reqs = b"".join(
            w.REQ.pack(w.OP_READ, rid, off, host.nbytes)
            for rid, (off, host, _) in zip(rids, plan, strict=True)
        )
        sock.sendall(reqs)
        for rid, (_, host, _) in zip(rids, plan, strict=True):
            self._recv_read(sock, rid, w.byte_view(host))

    def write_many(self, items: Sequence[tuple[int, Any]]) -> None:
        plan = []
        for offset, data in items:
            region = as_region(data, what="data")
            check_range(offset, region_nbytes(region), self.info.size)
            if region_is_device(region):
                host = _staging(region_nbytes(region))
                copy_region(host, region)
                region = host
            plan.append((offset, region))
        self._io(self._write_many, plan)
        self.bytes_written += sum(r.nbytes for _, r in plan)

    def _write_many(self, sock: socket.socket, plan: list[tuple[int, np.ndarray]]) -> None:
        rids = [self._next_rid() for _ in plan]
        for rid, (off, data) in zip(rids, plan, strict=True):
            w.send_parts(sock, w.REQ.pack(w.OP_WRITE, rid, off, data.nbytes), w.byte_view(data))
        for rid in rids:
            self._read_resp(sock, rid)


def _staging(n: int) -> np.ndarray:
    """Host bounce buffer for device transfers (page-locked when CUDA is present)."""
    import torch

    if torch.cuda.is_available():
        return torch.empty(n, dtype=torch.uint8, pin_memory=True).numpy()
    raise BufferSpecError("a CUDA buffer was given but CUDA is not available")

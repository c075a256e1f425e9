"""Client side of the TCP data path: a small pool of zero-copy connections per node.

Each operation borrows one ``DataConn`` (opened lazily, at most
``max_connections`` at once, so concurrent threads stream in parallel) and
returns it when done; a connection that saw any error is closed instead
(its stream position is unknown). Batch calls pipeline every request on one
connection before reading the answers. Host destinations are filled by
``recvmsg_into`` directly; device (CUDA) buffers go through a host staging
buffer (page-locked where CUDA exists) and one ``copy_region``.

Timeouts are inactivity timeouts: no socket operation, and no wait for a free
connection, lasts more than ``timeout`` seconds. Failures surface as
``CallTimeoutError`` / ``ConnectionLostError`` / ``HandshakeRefusedError``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any, NoReturn, TypeVar

import numpy as np

from kvpool.bindings.buffers import (
    as_region,
    copy_region,
    plain_host,
    region_is_device,
    region_nbytes,
)
from kvpool.errors import (
    BufferSpecError,
    CallTimeoutError,
    ConnectionLostError,
    KVPoolError,
    PoolClosedError,
)
from kvpool.rpc.auth import resolve_token
from kvpool.transport import tcp_wire as w
from kvpool.transport.base import RegionInfo, Transport, check_range
from kvpool.transport.fencing import IDENT
from kvpool.transport.tcp_conn import DataConn

_T = TypeVar("_T")


class TcpTransport(Transport):
    name = "tcp"

    def __init__(
        self,
        info: RegionInfo,
        *,
        token: str | None = None,
        timeout: float = 10.0,
        max_connections: int = 4,
    ) -> None:
        super().__init__(info)
        if not info.tcp_port:
            raise ConnectionLostError(f"node {info.node_id} serves no TCP data port")
        self.token = resolve_token(token)
        self.timeout = timeout
        self.max_connections = max(1, max_connections)
        self._idle: list[DataConn] = []
        self._open = 0
        self._waiting = 0
        self._closed = False
        self._cond = threading.Condition()

    # --- connection pool -----------------------------------------------------------

    def _acquire(self) -> DataConn:
        try:
            return self._idle.pop()  # fast path: list.pop is atomic, no lock taken
        except IndexError:
            pass
        with self._cond:
            self._waiting += 1  # before the check: a release that misses it left a conn
            try:
                while not self._idle and self._open >= self.max_connections:
                    if self._closed:
                        raise PoolClosedError("TCP transport is closed")
                    if not self._cond.wait(self.timeout):
                        raise CallTimeoutError(f"no free data connection to {self.info.node_id}")
            finally:
                self._waiting -= 1
            if self._closed:
                raise PoolClosedError("TCP transport is closed")
            if self._idle:
                return self._idle.pop()
            self._open += 1
        try:
            i = self.info
            return DataConn(i.tcp_host, i.tcp_port, self.token, self.timeout, i.tcp_instance)
        except BaseException:
            with self._cond:
                self._open -= 1
                self._cond.notify()
            raise

    def _release(self, conn: DataConn, healthy: bool) -> None:
        if healthy and not self._closed:
            self._idle.append(conn)
            if self._waiting:
                with self._cond:
                    self._cond.notify()
            if self._closed:  # raced with close(): drain again
                self.close()
            return
        with self._cond:
            conn.close()
            self._open -= 1
            self._cond.notify()

    def connect_ahead(self) -> None:
        """Open a data connection now unless one is open, so that the first call
        skips the connect and handshake (kvpool.cluster.client.warm_up)."""
        if not self._open:
            self._release(self._acquire(), True)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            idle = []
            while self._idle:
                idle.append(self._idle.pop())
            self._open -= len(idle)
            self._cond.notify_all()
        for conn in idle:
            conn.close()

    def _io(self, fn: Callable[..., _T], *args: Any) -> _T:
        """Run ``fn(conn, *args)`` on a borrowed connection, mapping failures to kvpool errors."""
        conn = self._acquire()
        healthy = False
        try:
            result = fn(conn, *args)
            healthy = True
            return result
        except KVPoolError:
            raise
        except (TimeoutError, BlockingIOError) as exc:  # BlockingIOError: SO_RCVTIMEO/SNDTIMEO
            raise CallTimeoutError(f"data transfer with {self.info.node_id} timed out") from exc
        except OSError as exc:
            raise ConnectionLostError(f"data connection to {self.info.node_id}: {exc}") from exc
        finally:
            self._release(conn, healthy)

    # --- transfers -----------------------------------------------------------------

    def read_into(self, offset: int, out: Any) -> None:
        plain = plain_host(out, writable=True)
        region = out if plain else as_region(out, writable=True, what="output buffer")
        if region_is_device(region):
            self.read_many([(offset, out)])
            return
        check_range(offset, region.nbytes, self.info.size)
        self._io(DataConn.read_one, offset, region)
        self.bytes_read += region.nbytes

    def write(self, offset: int, data: Any) -> None:
        region = as_region(data, what="data")
        if region_is_device(region):
            self.write_many([(offset, data)])
            return
        check_range(offset, region.nbytes, self.info.size)
        self._io(DataConn.write_many, [(offset, region)])
        self.bytes_written += region.nbytes

    def read_many(self, items: Sequence[tuple[int, Any]]) -> None:
        plan = []  # (offset, host region to fill)
        devices = []  # (device region, its host staging buffer)
        for offset, out in items:
            region = as_region(out, writable=True, what="output buffer")
            check_range(offset, region_nbytes(region), self.info.size)
            if region_is_device(region):
                host = _staging(region_nbytes(region))
                devices.append((region, host))
                region = host
            plan.append((offset, region))
        self._io(DataConn.read_many, plan)
        for device, host in devices:
            copy_region(device, host)
        self.bytes_read += sum(r.nbytes for _, r in plan)

    def read_block(self, block_offset: int, start: int, out: Any, key: bytes) -> bool:
        """Bytes [start, start + len(out)) of block ``key`` at ``block_offset`` into
        ``out``, checked by the node (as ``ShmTransport.read_block`` takes them): True,
        or False (``out`` holds no meaningful bytes) when that block no longer holds
        the range. The single-read fast path: one borrowed connection, no lists."""
        offset = block_offset + start
        if not plain_host(out, writable=True):
            return self.read_blocks([(offset, out, key, block_offset)])[0]
        n = out.nbytes
        if offset < 0 or offset + n > self.info.size:
            check_range(offset, n, self.info.size)  # raises the usual error
        try:  # _io, inline: the hot path (_acquire's own fast path first)
            conn = self._idle.pop()
        except IndexError:
            conn = self._acquire()
        try:
            ok = conn.read_block(offset, out, IDENT.pack(key, block_offset))
        except BaseException as exc:
            self._release(conn, False)
            _raise_transfer_error(self.info.node_id, exc)
        self._release(conn, True)
        if ok:
            self.bytes_read += n
        return ok

    def read_blocks(self, items: Sequence[tuple[int, Any, bytes, int]]) -> list[bool]:
        """Reads that name their block (offset, out, key, block offset): the node
        serves the bytes only while that block holds the range. Per read: True,
        or False (``out`` untouched or partly written) when it does not."""
        if len(items) == 1 and plain_host(items[0][1], writable=True):  # one block into host memory
            offset, out, key, block_offset = items[0]
            return [self.read_block(block_offset, offset - block_offset, out, key)]
        reads = items if type(items) is list else list(items)
        got = self._io(DataConn.read_blocks, reads, self.info.size)  # host reads: as they are
        if got is None:  # one is not: the checks (their errors) and device staging here
            return self._read_staged(reads)
        self.bytes_read += got[1]
        return got[0]

    def _read_staged(self, items: list[tuple[int, Any, bytes, int]]) -> list[bool]:
        """``read_blocks`` where an output is not plain host memory: each checked
        (``BufferSpecError``), device buffers read through host staging."""
        plan, devices = [], []
        for offset, out, key, block_offset in items:
            region = as_region(out, writable=True, what="output buffer")
            check_range(offset, region_nbytes(region), self.info.size)
            if region_is_device(region):
                host = _staging(region_nbytes(region))
                devices.append((region, host))
                region = host
            plan.append((offset, region, key, block_offset))
        got = self._io(DataConn.read_blocks, plan, self.info.size)
        if got is None:  # every output is a host view inside the region now
            raise ValueError("a checked read names a 16-byte key and offsets >= 0")
        for device, host in devices:
            copy_region(device, host)
        self.bytes_read += got[1]
        return got[0]

    def _source(self, offset: int, data: Any) -> Any:
        """``data`` as a host region to send to ``offset`` (device buffers staged)."""
        region = as_region(data, what="data")
        check_range(offset, region_nbytes(region), self.info.size)
        if region_is_device(region):
            host = _staging(region_nbytes(region))
            copy_region(host, region)
            region = host
        return region

    def stamped(self, items: Sequence[tuple[int, bytes, int, Any]]) -> list[int]:
        """Fenced ops (op, packed stamp, offset, data) on one connection, pipelined
        and sent in one gather send: each one's status (tcp_wire ST_OK, ST_STALE or
        ST_BUSY). ``data`` is None, a buffer, or a list of buffers whose bytes go
        back to back as the op's one payload (adjacent pieces of one block:
        ``fenced.write_parts``)."""
        plan = [
            (op, stamp, offset, None if data is None else self._payload(offset, data))
            for op, stamp, offset, data in items
        ]
        out: list[int] = []
        self._io(lambda conn: out.extend(conn.stamped_many(plan)))
        self.bytes_written += sum(_nbytes(r) for _, _, _, r in plan if r is not None)
        return out

    def _payload(self, offset: int, data: Any) -> Any:
        """``_source`` of a buffer, or of a list of buffers sent back to back (device
        ones staged together into one host buffer)."""
        if not isinstance(data, list):
            return self._source(offset, data)
        regions = [as_region(r, what="data") for r in data]
        sizes = [region_nbytes(r) for r in regions]
        check_range(offset, sum(sizes), self.info.size)
        if not any(region_is_device(r) for r in regions):
            return regions
        host, at = _staging(sum(sizes)), 0
        for region, n in zip(regions, sizes, strict=True):
            copy_region(host[at : at + n], region)
            at += n
        return host

    def stamped_one(
        self,
        op: int,
        stamp: bytes,
        offset: int,
        data: np.ndarray,
        meanwhile: Callable[[], object] | None = None,
    ) -> int:
        """``stamped`` of one payload-carrying op from a flat host array (``plain_host``):
        the single put's fast path, one borrowed connection and no lists. ``meanwhile``
        runs once the op is sent, before its answer is read (``DataConn.stamped_one``)."""
        n = data.nbytes
        if offset < 0 or offset + n > self.info.size:
            check_range(offset, n, self.info.size)  # raises the usual error
        try:  # _io, inline (as read_block)
            conn = self._idle.pop()
        except IndexError:
            conn = self._acquire()
        try:
            status = conn.stamped_one(op, stamp, offset, data, meanwhile)
        except BaseException as exc:
            self._release(conn, False)
            _raise_transfer_error(self.info.node_id, exc)
        self._release(conn, True)
        self.bytes_written += n
        return status

    def stamped_later(
        self, items: Sequence[tuple[int, bytes, int, None]]
    ) -> Callable[[], list[int]]:
        """Send payload-less fenced ops now; the returned call waits for their
        statuses (the connection stays lent out until then: call it exactly once)."""
        plan = list(items)
        conn = self._acquire()
        try:
            rids = conn.stamped_send(plan)
        except BaseException as exc:
            self._release(conn, False)
            _raise_transfer_error(self.info.node_id, exc)

        def statuses() -> list[int]:
            healthy = False
            try:
                out = conn.stamped_statuses(rids)
                healthy = True
                return out
            except BaseException as exc:
                _raise_transfer_error(self.info.node_id, exc)
            finally:
                self._release(conn, healthy)

        return statuses

    def commit_outcomes(self, ids: Sequence[tuple[int, int]], wait_s: float = 0.0) -> list[int]:
        """How the node's commits of these (allocation id, block offset) went, one state
        each (tcp_wire ``COMMITS``; its node commits them: ``info.tcp_node_commits``),
        waiting up to ``wait_s`` (the node caps it at 1 s) for those still owed."""
        out: list[int] = []
        for at in range(0, len(ids), w.MAX_COMMIT_IDS):
            part = list(ids[at : at + w.MAX_COMMIT_IDS])
            out += self._io(DataConn.commit_outcomes, part, wait_s)
        return out

    def write_many(self, items: Sequence[tuple[int, Any]]) -> None:
        plan = [(offset, self._source(offset, data)) for offset, data in items]
        self._io(DataConn.write_many, plan)
        self.bytes_written += sum(r.nbytes for _, r in plan)


def _raise_transfer_error(node_id: str, exc: BaseException) -> NoReturn:
    """Raise the kvpool error for a failed data-path operation (as ``_io`` maps them)."""
    if isinstance(exc, KVPoolError) or not isinstance(exc, OSError):
        raise exc
    if isinstance(exc, (TimeoutError, BlockingIOError)):  # BlockingIOError: SO_RCVTIMEO/SNDTIMEO
        raise CallTimeoutError(f"data transfer with {node_id} timed out") from exc
    raise ConnectionLostError(f"data connection to {node_id}: {exc}") from exc


def _nbytes(payload: Any) -> int:
    """Bytes of a ``_payload``: one host region or a list of them."""
    return sum(r.nbytes for r in payload) if isinstance(payload, list) else int(payload.nbytes)


def _staging(n: int) -> np.ndarray:
    """Host bounce buffer for device transfers (page-locked when CUDA is present)."""
    import torch

    if torch.cuda.is_available():
        return torch.empty(n, dtype=torch.uint8, pin_memory=True).numpy()
    raise BufferSpecError("a CUDA buffer was given but CUDA is not available")

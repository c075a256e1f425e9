"""UCX data path through UCXX (optional extra ``kvpool[ucx]``, imported lazily).

Useful where UCX finds RDMA (InfiniBand/RoCE) or GPU transports (cuda_ipc,
GPUDirect): then reads land straight in the destination, CUDA buffers
included. Over plain TCP UCX is slower than our socket path (about 1 GB/s
against 3-5 GB/s here), so ``select_transport`` only picks it when both the
node (``UcxInfo.rdma``) and this process's host have an RDMA device.

Two ways to connect, as measured on this project's machines:
- same host: endpoints made from the node's *worker address*
  (``create_endpoint_from_worker_address``, no error handling), tagged
  messages, which lets UCX use its shared-memory transports (sm/posix/cma,
  10-14 GB/s); listener endpoints would always pick TCP;
- other hosts: the node's listener (``create_endpoint(host, port)``).
Progress runs in ``blocking`` mode (``UCXPY_PROGRESS_MODE``), since the
default thread mode gets 0.3-0.6 GB/s on 2 cores and polling burns a core.

Wire (all little-endian uint64 arrays): HELLO (fixed 8 KiB: tags, token,
client worker address) answered by (status, 0); then requests (``REQUEST``
words: op, id, offset, length, block offset, key as two words, 0), answered
by (status, length) [+ payload for a READ that is ok]; a WRITE sends its
payload right after the request. Every UCX call runs on one private asyncio
loop thread per process; callers block with a timeout.

Checked reads (``OP_READ_BLOCK``, ``read_blocks``) name their block (key and
block offset, as TCP's ``IDENT``): the node's data server asks its fence
(kvpool.transport.fencing, the node's block table) to hold that block for
the range while the payload is sent, and answers ``ST_STALE`` with no
payload when the range holds another block now. A reader with an outdated
lease therefore gets a miss, never another block's bytes -- the same check,
by the same code, as a TCP read. (UCX moves a read's bytes as a tagged
message the node sends, not as a one-sided RDMA get, so the node sees every
read and needs no identity record in registered memory.)
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import importlib.util
import os
import secrets
import struct
import threading
from collections.abc import Coroutine, Sequence
from functools import cache
from typing import Any

import numpy as np

from kvpool.bindings.buffers import as_region, region_nbytes
from kvpool.errors import CallTimeoutError, ConnectionLostError, HandshakeRefusedError
from kvpool.rpc.auth import resolve_token
from kvpool.transport.base import RegionInfo, Transport, UcxInfo, check_range, host_identity

HELLO_TAG = 0x6B76706F6F6C  # "kvpool"
HELLO_SIZE = 8192
HELLO_HEAD = struct.Struct("<QQII")  # client send tag, client recv tag, token len, address len
OP_READ, OP_WRITE, OP_READ_BLOCK, OP_BYE = 1, 2, 3, 4
ST_OK, ST_BAD_TOKEN, ST_RANGE, ST_STALE, ST_FULL = 0, 2, 3, 4, 5
#: u64 words of a request: op, id, offset, length, block offset, key (2 words), 0
REQUEST = 8
#: Environment switch for a node's UCX listener: "on", "off" or "auto" (default:
#: where UCXX is installed and this host has an RDMA device)
UCX_ENV = "KVPOOL_UCX"


@cache
def ucx_available() -> bool:
    return importlib.util.find_spec("ucxx") is not None


def import_ucxx() -> Any:
    os.environ.setdefault("UCXPY_PROGRESS_MODE", "blocking")
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    import ucxx

    return ucxx


def ucx_wanted() -> bool:
    """Whether a node serves its region over UCX too (``$KVPOOL_UCX``, see above)."""
    mode = os.environ.get(UCX_ENV, "auto").strip().lower()
    if mode in ("on", "1", "yes"):
        return True
    if mode in ("off", "0", "no"):
        return False
    return ucx_available() and ucx_has_rdma()


def pack_request(
    op: int, rid: int, offset: int, length: int, key: bytes = bytes(16), block_offset: int = 0
) -> np.ndarray:
    """One request (``REQUEST`` u64 words); ``key`` and ``block_offset`` name the
    block of an ``OP_READ_BLOCK``."""
    req = np.zeros(REQUEST, np.uint64)
    req[:5] = (op, rid, offset, length, block_offset)
    req[5:7] = np.frombuffer(key, np.uint64)
    return req


def unpack_request(req: np.ndarray) -> tuple[int, int, int, bytes, int]:
    """(op, offset, length, key, block offset) of a request."""
    op, _, offset, length, block_offset = (int(x) for x in req[:5])
    return op, offset, length, req[5:7].tobytes(), block_offset


#: Where the kernel lists RDMA devices (InfiniBand, RoCE, iWARP NICs alike).
RDMA_SYSFS = "/sys/class/infiniband"


def rdma_devices() -> list[str]:
    """This host's RDMA devices (``mlx5_0``, ...); [] when there are none."""
    try:
        return sorted(os.listdir(RDMA_SYSFS))
    except OSError:
        return []


def ucx_has_rdma() -> bool:
    """An RDMA device is present: the one case where UCX beats the socket path.

    CUDA alone does not count: without RDMA, UCX moves bytes between hosts
    over TCP (~1 GB/s here against 2-3 GB/s for our socket path, which also
    stages CUDA buffers through page-locked host memory).
    """
    return bool(rdma_devices())


class _Loop:
    """One asyncio loop on a daemon thread; ``run`` blocks the caller with a timeout.

    Where CUDA is present the thread first makes the CUDA device's context
    current: UCX's CUDA transports call the driver from the thread that
    progresses the worker (arming it in blocking mode queries CUDA events),
    and with no current context there the driver call crashes the process.
    """

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        device = _cuda_device()  # in the caller's thread: before UCX starts, as UCX wants
        threading.Thread(target=self._serve, args=(device,), name="kvpool-ucx", daemon=True).start()

    def _serve(self, device: int | None) -> None:
        if device is not None:
            import torch

            torch.cuda.set_device(device)
            torch.cuda.synchronize(device)  # the context exists and is current here
        self.loop.run_forever()

    def run(self, coro: Coroutine[Any, Any, Any], timeout: float) -> Any:
        fut = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return fut.result(timeout)
        except concurrent.futures.TimeoutError:
            fut.cancel()
            raise CallTimeoutError(f"UCX operation timed out after {timeout} s") from None


def _cuda_device() -> int | None:
    """The CUDA device whose context the UCX thread uses; None without CUDA (and
    without importing torch where there is no NVIDIA driver)."""
    if not os.path.exists("/proc/driver/nvidia"):
        return None
    try:
        import torch
    except ImportError:
        return None
    return int(torch.cuda.current_device()) if torch.cuda.is_available() else None


@cache
def ucx_loop() -> _Loop:
    return _Loop()


class _Chan:
    """An endpoint plus the tags of a worker-address connection (None: listener endpoint)."""

    def __init__(self, ep: Any, send_tag: int | None, recv_tag: int | None) -> None:
        self.ep, self.send_tag, self.recv_tag = ep, send_tag, recv_tag

    async def send(self, buf: Any) -> None:
        if self.send_tag is None:
            await self.ep.send(buf)
        else:
            await self.ep.send(buf, tag=self.send_tag, force_tag=True)

    async def recv(self, buf: Any) -> None:
        if self.recv_tag is None:
            await self.ep.recv(buf)
        else:
            await self.ep.recv(buf, tag=self.recv_tag, force_tag=True)


def _pack_hello(token: str | None, send_tag: int, recv_tag: int, address: bytes) -> np.ndarray:
    tok = (token or "").encode()
    buf = np.zeros(HELLO_SIZE, np.uint8)
    body = HELLO_HEAD.pack(send_tag, recv_tag, len(tok), len(address)) + tok + address
    if len(body) > HELLO_SIZE:
        raise ValueError("UCX hello too large (token + worker address > 8 KiB)")
    buf[: len(body)] = np.frombuffer(body, np.uint8)
    return buf


def unpack_hello(buf: np.ndarray) -> tuple[int, int, str, bytes]:
    raw = buf.tobytes()
    send_tag, recv_tag, tlen, alen = HELLO_HEAD.unpack_from(raw)
    pos = HELLO_HEAD.size
    token = raw[pos : pos + tlen].decode(errors="replace")
    return send_tag, recv_tag, token, raw[pos + tlen : pos + tlen + alen]


_NO_KEY = bytes(16)
#: one planned transfer: op, offset, buffer, block key, block offset
_Item = tuple[int, int, Any, bytes, int]


class UcxTransport(Transport):
    name = "ucx"

    def __init__(self, info: RegionInfo, *, token: str | None = None, timeout: float = 10.0):
        super().__init__(info)
        if info.ucx is None:
            raise ConnectionLostError(f"node {info.node_id} has no UCX listener")
        self.ucx: UcxInfo = info.ucx
        self.token = resolve_token(token)
        self.timeout = timeout
        self._chan: _Chan | None = None
        self._lock = threading.Lock()
        self._loop = ucx_loop()

    async def _connect(self) -> _Chan:
        ucxx = import_ucxx()
        if self.ucx.worker_address and self.info.host_id == host_identity():
            ep = await ucxx.create_endpoint_from_worker_address(
                ucxx.get_ucx_address_from_buffer(self.ucx.worker_address),
                endpoint_error_handling=False,
            )
            send_tag, recv_tag = secrets.randbits(63), secrets.randbits(63)
            me = bytes(ucxx.get_worker_address())
            await ep.send(_pack_hello(self.token, send_tag, recv_tag, me), tag=HELLO_TAG,
                          force_tag=True)  # fmt: skip
            chan = _Chan(ep, send_tag, recv_tag)
        else:
            ep = await ucxx.create_endpoint(self.ucx.host, self.ucx.port)
            chan = _Chan(ep, None, None)
            await chan.send(_pack_hello(self.token, 0, 0, b""))
        status = np.empty(2, np.uint64)
        await chan.recv(status)
        if int(status[0]) == ST_FULL:
            raise ConnectionLostError(f"node {self.info.node_id} serves its cap of UCX clients")
        if int(status[0]) != ST_OK:
            raise HandshakeRefusedError("wrong or missing token (UCX data path)")
        return chan

    async def _transfer(self, plan: list[_Item]) -> list[bool]:
        if self._chan is None:
            self._chan = await self._connect()
        chan = self._chan
        status = np.empty(2, np.uint64)
        found = []
        for i, (op, offset, region, key, block_offset) in enumerate(plan):
            n = region_nbytes(region)
            await chan.send(pack_request(op, i, offset, n, key, block_offset))
            if op == OP_WRITE and n:
                await chan.send(region)
            await chan.recv(status)
            if op == OP_READ_BLOCK and int(status[0]) == ST_STALE:
                found.append(False)  # another block holds the range now: no payload
                continue
            if int(status[0]) != ST_OK or (op != OP_WRITE and int(status[1]) != n):
                raise ConnectionLostError(f"node {self.info.node_id} refused range at {offset}")
            if op != OP_WRITE and n:
                await chan.recv(region)
            found.append(True)
        return found

    def _run(
        self, op: int, items: Sequence[tuple[int, Any, bytes, int]], writable: bool
    ) -> list[bool]:
        plan = []
        for offset, buf, key, block_offset in items:
            region = as_region(buf, writable=writable, what="buffer")
            check_range(offset, region_nbytes(region), self.info.size)
            if op == OP_READ_BLOCK and len(key) != 16:
                raise ValueError("a checked read names a 16-byte key")
            plan.append((op, offset, region, key, block_offset))
        with self._lock:
            try:
                found = self._loop.run(self._transfer(plan), self.timeout)
            except (CallTimeoutError, HandshakeRefusedError, ConnectionLostError):
                self._chan = None
                raise
            except Exception as exc:  # UCX endpoint errors
                self._chan = None
                raise ConnectionLostError(f"UCX transfer with {self.info.node_id}: {exc}") from exc
            moved = sum(region_nbytes(p[2]) for p, ok in zip(plan, found, strict=True) if ok)
            if op == OP_WRITE:
                self.bytes_written += moved
            else:
                self.bytes_read += moved
            return found

    def read_into(self, offset: int, out: Any) -> None:
        self._run(OP_READ, [(offset, out, _NO_KEY, 0)], True)

    def write(self, offset: int, data: Any) -> None:
        self._run(OP_WRITE, [(offset, data, _NO_KEY, 0)], False)

    def read_many(self, items: Sequence[tuple[int, Any]]) -> None:
        self._run(OP_READ, [(offset, out, _NO_KEY, 0) for offset, out in items], True)

    def write_many(self, items: Sequence[tuple[int, Any]]) -> None:
        self._run(OP_WRITE, [(offset, data, _NO_KEY, 0) for offset, data in items], False)

    def read_blocks(self, items: Sequence[tuple[int, Any, bytes, int]]) -> list[bool]:
        """Reads that name their block (offset, out, key, block offset), as
        ``TcpTransport.read_blocks`` takes them: the node serves the bytes only
        while that block holds the range. Per read: True, or False (``out``
        untouched) when it does not."""
        return self._run(OP_READ_BLOCK, items, True)

    def close(self) -> None:
        with self._lock:
            chan, self._chan = self._chan, None
        if chan is not None:
            with contextlib.suppress(Exception):
                self._loop.run(_bye(chan), 5)


async def _bye(chan: _Chan) -> None:
    """End the channel on both sides: a same-host (worker-address) endpoint has no
    error handling, so the node learns that its client is gone only from this."""
    with contextlib.suppress(Exception):
        await chan.send(pack_request(OP_BYE, 0, 0, 0))
    await chan.ep.close()

"""Node side of the UCX data path (see ``kvpool.transport.ucx`` for the wire).

Serves one region to two kinds of clients on the process's UCX loop thread:
listener endpoints (other hosts) and worker-address endpoints (same host,
announced by a HELLO on ``HELLO_TAG``). A client with a wrong token gets
status ``ST_BAD_TOKEN``; a bad range ends that client's channel only. The
listener is bound to the node's ``--host`` when UCXX can bind an address;
otherwise it listens everywhere and therefore requires a token, as any
wildcard bind does (kvpool.rpc.auth). UCXX 0.52 (our ``ucx`` extra) cannot:
its ``create_listener`` takes a port only and UCX binds every interface.

Given a ``fence`` (the node's block table, kvpool.transport.fencing), a
checked read (``OP_READ_BLOCK``) is served only while the block it names
holds the range, and that block is held until its bytes are sent
(``admit``); otherwise the answer is ``ST_STALE`` and the channel stays
usable. Without a fence there are no blocks to check against: checked reads
are refused, as the TCP server does.

Hardening, as on the TCP servers: the HELLO is a fixed ``HELLO_SIZE`` buffer
(a larger first message fails to land in it and ends that endpoint; nothing
is allocated from a peer's length), and at most ``max_clients`` listener
channels are served at once (a client past the cap gets ``ST_FULL``). The
cap counts listener channels only: UCX reports a listener peer's loss (its
endpoints have error handling), so a dead client frees its place. Same-host
(worker-address) endpoints have no error handling -- with it UCX leaves out
its shared-memory transports (measured: ~0.2 against ~3 GB/s here) -- so
their channels end on the client's ``OP_BYE``; one of a killed same-host
client stays (an idle coroutine) until the node stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
from typing import Any

import numpy as np

from kvpool.bindings.buffers import as_region, region_nbytes
from kvpool.rpc.auth import check_bind, resolve_token, token_matches
from kvpool.transport.base import UcxInfo
from kvpool.transport.fencing import WriteFence
from kvpool.transport.ucx import (
    HELLO_SIZE,
    HELLO_TAG,
    OP_BYE,
    OP_READ,
    OP_READ_BLOCK,
    OP_WRITE,
    REQUEST,
    ST_BAD_TOKEN,
    ST_FULL,
    ST_OK,
    ST_RANGE,
    ST_STALE,
    _Chan,
    import_ucxx,
    ucx_has_rdma,
    ucx_loop,
    unpack_hello,
    unpack_request,
)


def listener_address(create_listener: Any, host: str) -> dict[str, str]:
    """The keyword that binds a UCXX listener to ``host``, if this UCXX has one."""
    try:
        params = inspect.signature(create_listener).parameters
    except (TypeError, ValueError):
        return {}
    for name in ("ip_address", "address", "host", "ip"):
        if name in params:
            return {name: host}
    return {}


#: listener channels served at once (as the TCP servers cap their connections)
MAX_CLIENTS = 1024


def admit(req: np.ndarray, size: int, fence: WriteFence | None) -> tuple[int, Any]:
    """The verdict on one request against a region of ``size`` bytes: (status,
    the fence's hold on the block for a checked read, to end once its bytes are
    sent; else None). ``ST_RANGE`` ends the channel (a WRITE's payload may
    follow); ``ST_STALE`` answers a checked read whose block is not there."""
    op, offset, length, key, block_offset = unpack_request(req)
    if offset + length > size or op not in (OP_READ, OP_WRITE, OP_READ_BLOCK):
        return ST_RANGE, None
    if op != OP_READ_BLOCK:
        return ST_OK, None
    held = None if fence is None else fence.begin_read(key, block_offset, offset, length)
    return (ST_STALE, None) if held is None else (ST_OK, held)


class UcxDataServer:
    """Node side: serves ``region`` to listener and worker-address clients."""

    def __init__(
        self,
        region: Any,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        token: str | None = None,
        fence: WriteFence | None = None,
        max_clients: int = MAX_CLIENTS,
    ) -> None:
        self.token = resolve_token(token)
        self.fence = fence
        self.max_clients = max_clients
        self.clients = 0  # listener channels served now (counted on the loop thread)
        check_bind(host, self.token)
        self.host = host
        self.region = as_region(region, writable=True, what="region")
        self.size = region_nbytes(self.region)
        self._loop = ucx_loop()
        self._tasks: set[asyncio.Future[None]] = set()
        self.bytes_read = 0  # payload bytes served, as TcpDataServer counts them
        self.bytes_written = 0
        self.port, self.worker_address = self._loop.run(self._start(port), 60)

    async def _start(self, port: int) -> tuple[int, bytes]:
        ucxx = import_ucxx()
        where = listener_address(ucxx.create_listener, self.host)
        if not where:
            # This UCXX binds its listener on every interface: serve it only as a
            # wildcard bind would be served (with a token), never silently wider.
            check_bind("0.0.0.0", self.token)
        self._listener = ucxx.create_listener(self._on_endpoint, port=port, **where)
        self._accept = asyncio.ensure_future(self._accept_by_address())
        return int(self._listener.port), bytes(ucxx.get_worker_address())

    def info(self) -> UcxInfo:
        return UcxInfo(self.host, self.port, self.worker_address, ucx_has_rdma())

    def close(self) -> None:
        async def stop() -> None:
            self._accept.cancel()
            self._listener.close()

        self._loop.run(stop(), 10)

    async def _on_endpoint(self, ep: Any) -> None:
        chan = _Chan(ep, None, None)
        hello = np.empty(HELLO_SIZE, np.uint8)
        try:
            await chan.recv(hello)
        except Exception:
            return
        await self._serve(chan, unpack_hello(hello)[2], capped=True)

    async def _accept_by_address(self) -> None:
        ucxx = import_ucxx()
        while True:
            hello = np.empty(HELLO_SIZE, np.uint8)
            await ucxx.recv(hello, tag=HELLO_TAG)
            send_tag, recv_tag, token, address = unpack_hello(hello)
            try:
                ep = await ucxx.create_endpoint_from_worker_address(
                    ucxx.get_ucx_address_from_buffer(address), endpoint_error_handling=False
                )
            except Exception:
                continue
            # The client's send tag is our receive tag and vice versa.
            task = asyncio.ensure_future(self._serve(_Chan(ep, recv_tag, send_tag), token))
            self._tasks.add(task)  # a strong reference until it ends
            task.add_done_callback(self._tasks.discard)

    async def _serve(self, chan: _Chan, token: str, *, capped: bool = False) -> None:
        status = np.zeros(2, np.uint64)
        if not capped:
            await self._serve_requests(chan, token, status)
            return
        if self.clients >= self.max_clients:
            status[0] = ST_FULL
            with contextlib.suppress(Exception):
                await chan.send(status)
                await chan.ep.close()
            return
        self.clients += 1
        try:
            await self._serve_requests(chan, token, status)
        finally:
            self.clients -= 1

    async def _serve_requests(self, chan: _Chan, token: str, status: np.ndarray) -> None:
        req = np.empty(REQUEST, np.uint64)
        try:
            if not token_matches(self.token, token):
                status[0] = ST_BAD_TOKEN
                await chan.send(status)
                return
            await chan.send(status)
            while True:
                await chan.recv(req)
                if int(req[0]) == OP_BYE:
                    return
                verdict, held = admit(req, self.size, self.fence)
                op, offset, length = (int(x) for x in (req[0], req[2], req[3]))
                if verdict != ST_OK:
                    status[:] = (verdict, 0)
                    await chan.send(status)
                    if verdict == ST_RANGE:
                        return  # a WRITE payload may follow: this channel is unusable
                    continue
                span = self.region[offset : offset + length]
                if op == OP_WRITE:
                    if length:
                        await chan.recv(span)
                    self.bytes_written += length
                    status[:] = (ST_OK, 0)
                    await chan.send(status)
                    continue
                try:
                    status[:] = (ST_OK, length)
                    await chan.send(status)
                    if length:
                        await chan.send(span)
                    self.bytes_read += length
                finally:
                    if held is not None:
                        assert self.fence is not None
                        self.fence.end_read(held)
        except Exception:
            return  # peer gone or endpoint error: drop this client only

"""Node side of the UCX data path (see ``kvpool.transport.ucx`` for the wire).

Serves one region to two kinds of clients on the process's UCX loop thread:
listener endpoints (other hosts) and worker-address endpoints (same host,
announced by a HELLO on ``HELLO_TAG``). A client with a wrong token gets
status ``ST_BAD_TOKEN``; a bad range ends that client's channel only. The
listener is bound to the node's ``--host`` when UCXX can bind an address;
otherwise it listens everywhere and therefore requires a token, as any
wildcard bind does (kvpool.rpc.auth).
"""

from __future__ import annotations

import asyncio
import inspect
from typing import Any

import numpy as np

from kvpool.bindings.buffers import as_region, region_nbytes
from kvpool.rpc.auth import check_bind, resolve_token, token_matches
from kvpool.transport.base import UcxInfo
from kvpool.transport.ucx import (
    HELLO_SIZE,
    HELLO_TAG,
    OP_READ,
    OP_WRITE,
    ST_BAD_TOKEN,
    ST_OK,
    ST_RANGE,
    _Chan,
    import_ucxx,
    ucx_has_rdma,
    ucx_loop,
    unpack_hello,
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


class UcxDataServer:
    """Node side: serves ``region`` to listener and worker-address clients."""

    def __init__(
        self, region: Any, *, host: str = "127.0.0.1", port: int = 0, token: str | None = None
    ) -> None:
        self.token = resolve_token(token)
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
        await self._serve(chan, unpack_hello(hello)[2])

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

    async def _serve(self, chan: _Chan, token: str) -> None:
        status = np.zeros(2, np.uint64)
        req = np.empty(4, np.uint64)
        try:
            if not token_matches(self.token, token):
                status[0] = ST_BAD_TOKEN
                await chan.send(status)
                return
            await chan.send(status)
            while True:
                await chan.recv(req)
                op, _, offset, length = (int(x) for x in req)
                if offset + length > self.size or op not in (OP_READ, OP_WRITE):
                    status[:] = (ST_RANGE, 0)
                    await chan.send(status)
                    return  # a WRITE payload may follow: this channel is unusable
                span = self.region[offset : offset + length]
                if op == OP_READ:
                    status[:] = (ST_OK, length)
                    await chan.send(status)
                    if length:
                        await chan.send(span)
                    self.bytes_read += length
                else:
                    if length:
                        await chan.recv(span)
                    self.bytes_written += length
                    status[:] = (ST_OK, 0)
                    await chan.send(status)
        except Exception:
            return  # peer gone or endpoint error: drop this client only

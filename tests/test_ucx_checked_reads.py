"""UCX reads that name their block, and the UCX server's hardening.

The first tests need no UCXX: they drive the node-side verdict (``admit``)
with a fake fence and the request packing. The others run the real UCX data
path (skipped where ucxx is not installed: ``pip install 'kvpool[ucx]'``):
a ``UcxDataServer`` guarded by the node's real fence (``BlockTable``) and a
TCP data server for the claim/seal bracket, as a node serves them, and a
``UcxTransport`` client over loopback (UCX over TCP here; no RDMA device).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvpool.transport import ucx
from kvpool.transport.ucx import (
    OP_READ,
    OP_READ_BLOCK,
    OP_WRITE,
    ST_OK,
    ST_RANGE,
    ST_STALE,
    pack_request,
    unpack_request,
)
from kvpool.transport.ucx_server import admit

K1, K2 = b"\x01" * 16, b"\x02" * 16
PAGE = 4096
TOKEN = "ucx-checked-reads"
needs_ucxx = pytest.mark.skipif(
    importlib.util.find_spec("ucxx") is None,
    reason="ucxx not installed (pip install 'kvpool[ucx]')",
)


class FakeFence:
    """Holds block K1 at offset 0 (2 pages); records the reads it was asked for."""

    def __init__(self) -> None:
        self.asked: list[tuple[bytes, int, int, int]] = []

    def begin_read(self, key: bytes, block_offset: int, offset: int, length: int) -> Any:
        self.asked.append((key, block_offset, offset, length))
        ok = key == K1 and block_offset == 0 and offset + length <= 2 * PAGE
        return ("held", key) if ok else None


def test_requests_round_trip() -> None:
    req = pack_request(OP_READ_BLOCK, 7, PAGE + 5, 100, K2, PAGE)
    assert req.dtype == np.uint64 and req.size == ucx.REQUEST
    assert unpack_request(req) == (OP_READ_BLOCK, PAGE + 5, 100, K2, PAGE)
    assert unpack_request(pack_request(OP_WRITE, 0, 3, 4)) == (OP_WRITE, 3, 4, bytes(16), 0)


def test_a_checked_read_is_admitted_only_while_its_block_holds_the_range() -> None:
    fence = FakeFence()
    assert admit(pack_request(OP_READ_BLOCK, 0, 100, 50, K1, 0), 8 * PAGE, fence) == (
        ST_OK,
        ("held", K1),
    )
    assert fence.asked == [(K1, 0, 100, 50)]
    # another block now: a miss, not the bytes; past the block: a miss too
    assert admit(pack_request(OP_READ_BLOCK, 0, 0, 10, K2, 0), 8 * PAGE, fence) == (ST_STALE, None)
    assert admit(pack_request(OP_READ_BLOCK, 0, PAGE, 2 * PAGE, K1, 0), 8 * PAGE, fence) == (
        ST_STALE,
        None,
    )
    # outside the region: the channel ends (before the fence is asked)
    asked = len(fence.asked)
    assert admit(pack_request(OP_READ_BLOCK, 0, 8 * PAGE, 1, K1, 0), 8 * PAGE, fence)[0] == ST_RANGE
    assert admit(pack_request(99, 0, 0, 1), 8 * PAGE, fence)[0] == ST_RANGE
    assert len(fence.asked) == asked


def test_plain_ops_are_not_checked_and_no_fence_refuses_checked_reads() -> None:
    fence = FakeFence()
    assert admit(pack_request(OP_READ, 0, 0, PAGE), PAGE, fence) == (ST_OK, None)
    assert admit(pack_request(OP_WRITE, 0, 0, PAGE), PAGE, fence) == (ST_OK, None)
    assert fence.asked == []
    # a region served without a fence has no blocks to check against (as TCP)
    assert admit(pack_request(OP_READ_BLOCK, 0, 0, 1, K1, 0), PAGE, None) == (ST_STALE, None)


def test_kvpool_ucx_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ucx.UCX_ENV, "on")
    assert ucx.ucx_wanted()
    monkeypatch.setenv(ucx.UCX_ENV, "off")
    assert not ucx.ucx_wanted()
    monkeypatch.setenv(ucx.UCX_ENV, "auto")
    assert ucx.ucx_wanted() == (ucx.ucx_available() and ucx.ucx_has_rdma())


# -- the real UCX data path --------------------------------------------------------------


@pytest.fixture
def node():
    """A node's two data servers over one region, guarded by one real fence."""
    from kvpool.cluster.block_table import BlockTable
    from kvpool.transport.base import RegionInfo
    from kvpool.transport.tcp import TcpTransport
    from kvpool.transport.tcp_server import TcpDataServer
    from kvpool.transport.ucx_server import UcxDataServer

    region = np.zeros(16 * PAGE, np.uint8)
    fence = BlockTable(lambda offset, size: 1, claim_wait=0.2)
    fence.new_term(3)
    tcp = TcpDataServer(region, fence=fence, token=TOKEN)
    tcp.start()
    server = UcxDataServer(region, token=TOKEN, fence=fence)
    info = RegionInfo("n", region.nbytes, host_id="elsewhere", tcp_host="127.0.0.1")
    info.tcp_port, info.tcp_instance, info.ucx = tcp.address[1], tcp.instance, server.info()
    control = TcpTransport(info, token=TOKEN, timeout=5)
    yield region, server, info, control
    control.close()
    server.close()
    tcp.close()


def _client(info: Any) -> Any:
    from kvpool.transport.ucx import UcxTransport

    return UcxTransport(info, token=TOKEN, timeout=10)


@needs_ucxx
def test_ucx_reads_never_return_another_blocks_bytes(node) -> None:
    """A block written over UCX (claimed and sealed on the TCP port) reads back
    checked; once a newer allocation holds the range, the old key's read is a
    miss with ``out`` untouched, the channel stays usable, and the new block
    reads back exactly."""
    from kvpool.cluster.client import fenced
    from kvpool.transport import tcp_wire as w
    from kvpool.transport.fencing import WriteStamp

    region, server, info, control = node
    data = np.random.default_rng(1).integers(0, 256, 2 * PAGE, dtype=np.uint8)
    with _client(info) as t:
        claims, sealed = fenced.write_blocks_begin(
            t, control, [(WriteStamp(3, 10, 0, 2 * PAGE, K1), 0, data)]
        )
        assert claims == [w.ST_OK] and sealed is not None and sealed() == [w.ST_OK]
        out = np.empty(2 * PAGE, np.uint8)
        assert t.read_blocks([(0, out, K1, 0)]) == [True] and np.array_equal(out, data)
        part = np.empty(100, np.uint8)
        assert t.read_blocks([(PAGE + 7, part, K1, 0)]) == [True]
        assert np.array_equal(part, data[PAGE + 7 : PAGE + 107])
        # the master gave the range to another block (a newer allocation)
        other = np.full(PAGE, 0xEE, np.uint8)
        newer = WriteStamp(3, 11, 0, PAGE, K2)
        claims, sealed = fenced.write_blocks_begin(t, control, [(newer, 0, other)])
        assert claims == [w.ST_OK] and sealed is not None and sealed() == [w.ST_OK]
        out[:] = 7
        assert t.read_blocks([(0, out[:PAGE], K1, 0), (0, part, K2, 0)]) == [False, True]
        assert (out == 7).all()  # nothing landed for the miss
        assert np.array_equal(part, other[:100])
        # an older allocation's write is refused and moves no byte over UCX
        stale = WriteStamp(3, 10, 0, PAGE, K1)
        claims, sealed = fenced.write_blocks_begin(t, control, [(stale, 0, data[:PAGE])])
        assert claims == [w.ST_STALE]
        assert sealed is None or sealed() == [w.ST_STALE]
        assert np.array_equal(region[:PAGE], other)
        assert t.bytes_read == 2 * PAGE + 100 + 100
    assert server.bytes_read == t.bytes_read


def test_an_admitted_read_holds_its_block_until_released() -> None:
    """``admit`` takes the node's real fence's read hold: while the server sends
    the bytes (until ``end_read``), a newer claim of the range is BUSY."""
    from kvpool.cluster.block_table import BlockTable
    from kvpool.transport.fencing import FENCE_BUSY, FENCE_OK, WriteStamp

    fence = BlockTable(lambda offset, size: 1, claim_wait=0.1)
    fence.new_term(3)
    stamp = WriteStamp(3, 1, 0, PAGE, K1)
    assert fence.claim(stamp, "w") == FENCE_OK
    assert fence.finish(stamp, "w", ok=True, seal=True) == FENCE_OK
    status, held = admit(pack_request(OP_READ_BLOCK, 0, 0, PAGE, K1, 0), PAGE, fence)
    assert status == ST_OK and held is not None
    assert fence.claim(WriteStamp(3, 2, 0, PAGE, K2), "w2") == FENCE_BUSY
    fence.end_read(held)
    assert fence.claim(WriteStamp(3, 2, 0, PAGE, K2), "w2") == FENCE_OK


@needs_ucxx
def test_ucx_listener_address_and_token(node) -> None:
    """UCXX 0.52 cannot bind its listener to an address: it listens on every
    interface, so the node serves it only with a token (the wildcard rule of
    kvpool.rpc.auth), and a wrong token is refused before any range is served."""
    from kvpool.errors import HandshakeRefusedError, InsecureBindError
    from kvpool.transport.ucx import UcxTransport, import_ucxx
    from kvpool.transport.ucx_server import UcxDataServer, listener_address

    _, server, info, _ = node
    if listener_address(import_ucxx().create_listener, "127.0.0.1"):
        pytest.skip("this UCXX binds an address: tests/test_hardening.py checks it")
    bound = _listening_on(server.port)
    assert bound and bound <= {"0.0.0.0", "::"}  # every interface: hence the token
    with pytest.raises(InsecureBindError):
        UcxDataServer(np.zeros(PAGE, np.uint8), host="127.0.0.1", token=None)
    with pytest.raises(HandshakeRefusedError), UcxTransport(info, token="wrong", timeout=10) as t:
        t.read_into(0, np.empty(8, np.uint8))


@needs_ucxx
def test_ucx_first_frame_is_fixed_and_clients_are_capped(node) -> None:
    """The hello lands in a fixed 8 KiB buffer: a 16 MiB first message from an
    unauthenticated peer ends that endpoint without the node allocating it, and
    the node keeps serving. Past ``max_clients`` listener channels a client is
    refused (``ConnectionLostError``); a closed one frees its place."""
    import asyncio

    from kvpool.errors import ConnectionLostError
    from kvpool.transport.ucx import import_ucxx, ucx_loop
    from kvpool.transport.ucx_server import UcxDataServer

    region, _, info, _ = node
    region[:8] = 5
    server = UcxDataServer(region, token=TOKEN, max_clients=1)
    info.ucx = server.info()
    try:

        async def flood() -> None:
            ucxx = import_ucxx()
            ep = await ucxx.create_endpoint("127.0.0.1", server.port)
            big = np.zeros(16 << 20, np.uint8)
            with pytest.raises(Exception):  # noqa: B017 - any UCX error
                await asyncio.wait_for(ep.send(big), 5)
                reply = np.empty(2, np.uint64)
                await asyncio.wait_for(ep.recv(reply), 2)
            await ep.close()

        ucx_loop().run(flood(), 30)
        out = np.empty(8, np.uint8)
        first = _client(info)
        first.read_into(0, out)
        assert (out == 5).all()
        with pytest.raises(ConnectionLostError, match="cap"), _client(info) as second:
            second.read_into(0, out)
        first.close()
        assert _wait(lambda: server.clients == 0)
        with _client(info) as third:
            third.read_into(0, out)
    finally:
        server.close()


def _wait(cond: Any, timeout: float = 10.0) -> bool:
    import time

    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            return False
        time.sleep(0.02)
    return True


def _listening_on(port: int) -> set[str]:
    """The local addresses of TCP sockets listening on ``port`` (/proc/net/tcp{,6})."""
    import ipaddress

    found = set()
    for name, width in (("/proc/net/tcp", 4), ("/proc/net/tcp6", 16)):
        try:
            lines = Path(name).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            local, state = line.split()[1], line.split()[3]
            addr, hexport = local.split(":")
            if state != "0A" or int(hexport, 16) != port:
                continue
            raw = bytes.fromhex(addr)
            raw = b"".join(raw[i : i + 4][::-1] for i in range(0, width, 4))
            found.add(str(ipaddress.ip_address(raw)))
    return found

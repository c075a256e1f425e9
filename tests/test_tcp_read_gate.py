"""The node's read gate (kvpool.transport.tcp_read_gate, kvpool.cluster.outside_reads).

A real TCP data server behind the node's real block table, identity records and gate:
checked reads of whole blocks are served natively, byte-exact, whole or in part; a read
the gate does not take (another block's key, a claim not yet whole, the gate off) takes
the Python path with its usual answer; a pipelined batch is served natively up to
the first read the gate declines, in turns past the gather bounds. A native read in
flight -- a reader that stops reading a 48 MiB reply, so the node's send blocks with the
block held -- holds its block (a batch: each of its blocks)
against a newer claim (busy after the claim's bound, the block's record retracted
first) and an SSD load's ``take_over``, and keeps a freed block's entry until a writer
finds it idle; once the reader drains its reply, the claim is granted.
"""

from __future__ import annotations

import os
import secrets
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pytest
from clusterhelpers import wait_until

from kvpool.cluster.block_table import BlockTable
from kvpool.cluster.outside_reads import OutsideReads
from kvpool.transport import tcp_read_gate
from kvpool.transport import tcp_wire as w
from kvpool.transport.base import RegionInfo
from kvpool.transport.fencing import FENCE_BUSY, FENCE_OK, IDENT, WriteStamp
from kvpool.transport.shm import shm_path
from kvpool.transport.shm_ident import ALIGN, BlockIdents, ident_name
from kvpool.transport.tcp import TcpTransport
from kvpool.transport.tcp_checked_reads import GATHER_MAX
from kvpool.transport.tcp_conn import DataConn
from kvpool.transport.tcp_read_gate import ReadGate
from kvpool.transport.tcp_server import TcpDataServer

if tcp_read_gate.STATUS.startswith("Python") and os.environ.get("KVPOOL_REQUIRE_TCP_SERVE") == "1":
    pytest.fail(f"KVPOOL_REQUIRE_TCP_SERVE=1 but the gate is {tcp_read_gate.STATUS}", pytrace=False)
needs_gate = pytest.mark.skipif(
    tcp_read_gate.STATUS.startswith("Python"), reason=f"no native gate: {tcp_read_gate.STATUS}"
)
K1, K2 = b"\x01" * 16, b"\x02" * 16
BIG = 48 << 20  # more than both ends' socket buffers hold (8 MiB asked, twice that given)
REGION = 64 << 20


@dataclass
class Gated:
    region: np.ndarray
    idents: BlockIdents
    gate: ReadGate
    table: BlockTable
    server: TcpDataServer
    transport: TcpTransport


@pytest.fixture
def gated() -> Iterator[Gated]:
    """A 64 MiB region (term 3, claims wait 0.2 s) behind the node's table, records and gate."""
    region = np.zeros(REGION, np.uint8)
    name = f"kvpool-test-{os.getpid()}-{secrets.token_hex(4)}"
    idents = BlockIdents(shm_path(ident_name(name)), REGION, create=True)
    gate = ReadGate(idents, region)
    table = BlockTable(lambda offset, size: 1, claim_wait=0.2, idents=idents, read_gate=gate)
    table.new_term(3)
    server = TcpDataServer(region, fence=table, read_gate=gate)
    server.start()
    info = RegionInfo("n", REGION, tcp_host="127.0.0.1", tcp_port=server.address[1])
    info.tcp_instance = server.instance
    transport = TcpTransport(info)
    yield Gated(region, idents, gate, table, server, transport)
    transport.close()
    server.close()
    idents.close()


def _whole(g: Gated, key: bytes, offset: int, size: int, alloc: int, seed: int) -> np.ndarray:
    """Block ``key`` written whole at ``offset`` (allocation ``alloc``); its bytes."""
    stamp = WriteStamp(3, alloc, offset, size, key)
    assert g.table.claim(stamp, "w") == FENCE_OK
    data = np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)
    g.region[offset : offset + size] = data
    assert g.table.finish(stamp, "w", ok=True, seal=True) == FENCE_OK
    return data


class _StalledRead:
    """Checked reads of whole blocks (key, offset, length), pipelined, whose reader does
    not read the replies yet."""

    def __init__(self, g: Gated, *blocks: tuple[bytes, int, int]) -> None:
        self.conn = DataConn("127.0.0.1", g.server.address[1], None, 10.0, g.server.instance)
        self.conn.sock.sendall(
            b"".join(
                w.REQ.pack(w.OP_READ_BLOCK, 0, rid, offset, length) + IDENT.pack(key, offset)
                for rid, (key, offset, length) in enumerate(blocks, start=1)
            )
        )
        self.lengths = [length for _, _, length in blocks]

    def drain(self) -> list[bytes]:
        """Every reply's payload (each ok): the node's send ends."""
        received, payloads = w.HELLO_REPLY.size, []
        for rid, n in enumerate(self.lengths, start=1):
            pad = w.read_pad(received)
            got = bytearray(w.RESP.size + pad + n)
            w.recv_into_exact(self.conn.sock, memoryview(got))
            assert w.READ_RESP.unpack_from(got) == (w.ST_OK, pad, rid, n)
            payloads.append(bytes(got[w.RESP.size + pad :]))
            received += len(got)
        self.conn.close()
        return payloads


@needs_gate
def test_checked_reads_are_served_natively_byte_exact_whole_or_in_part(gated: Gated) -> None:
    a = _whole(gated, K1, 0, 1 << 20, 1, seed=1)
    b = _whole(gated, K2, 2 << 20, 100_000, 2, seed=2)  # not a multiple of the granule
    out = np.zeros(1 << 20, np.uint8)
    assert gated.transport.read_block(0, 0, out, K1) and np.array_equal(out, a)
    part = np.zeros(5000, np.uint8)
    assert gated.transport.read_block(2 << 20, 777, part, K2)
    assert np.array_equal(part, b[777:5777])
    outs = [np.zeros(1 << 20, np.uint8) for _ in range(3)]  # one after another, pads vary
    for i, o in enumerate(outs):
        assert gated.transport.read_block(0, 0, o, K1), i
        assert np.array_equal(o, a)
    # (the server's thread counts once it has the GIL again: the client may be first)
    assert wait_until(lambda: gated.server.reads.gated == 5 and not gated.gate.readers.any())
    assert gated.server.bytes_read == 4 * (1 << 20) + 5000  # every count back down above


@needs_gate
def test_a_read_the_gate_declines_takes_the_python_path(gated: Gated) -> None:
    a = _whole(gated, K1, 0, 8192, 1, seed=3)
    out = np.zeros(8192, np.uint8)
    assert not gated.transport.read_block(0, 0, out, K2)  # another key: refused as stale
    assert not gated.transport.read_block(0, 4096, out, K1)  # past the block's end
    claim = WriteStamp(3, 2, 1 << 20, 8192, K2)
    assert gated.table.claim(claim, "w") == FENCE_OK  # claimed, not whole: no record
    assert not gated.transport.read_block(1 << 20, 0, out, K2)
    assert gated.server.reads.gated == 0
    assert gated.transport.read_block(0, 0, out, K1) and np.array_equal(out, a)
    assert wait_until(lambda: gated.server.reads.gated == 1)


def test_with_the_gate_off_every_read_takes_the_python_path(
    gated: Gated, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tcp_read_gate, "_module", None)  # as $KVPOOL_TCP_SERVE=0 leaves it
    off = ReadGate(gated.idents, gated.region)
    assert off.serve is None
    server = TcpDataServer(gated.region, fence=gated.table, read_gate=off)
    server.start()
    info = RegionInfo("n", REGION, tcp_host="127.0.0.1", tcp_port=server.address[1])
    info.tcp_instance = server.instance
    transport = TcpTransport(info)
    try:
        a = _whole(gated, K1, 0, 1 << 20, 1, seed=4)
        out = np.zeros(1 << 20, np.uint8)
        assert transport.read_block(0, 0, out, K1) and np.array_equal(out, a)
        assert wait_until(lambda: server.bytes_read == 1 << 20)
        assert server.reads.gated == 0
    finally:
        transport.close()
        server.close()


@needs_gate
def test_a_pipelined_batch_is_served_natively_up_to_the_first_read_it_declines(
    gated: Gated,
) -> None:
    """The gate serves the batch's prefix in one gather send; the Python path answers
    the rest (a stale read among them refused), every reply in its place."""
    blocks = [_whole(gated, bytes([i + 1]) * 16, i << 20, 300_000, i + 1, seed=i) for i in range(4)]
    outs = [np.zeros(300_000, np.uint8) for _ in range(6)]
    plan = [(i << 20, outs[k], bytes([i + 1]) * 16, i << 20) for k, i in enumerate([0, 1, 0])]
    assert gated.transport.read_blocks(plan) == [True] * 3  # a block twice: held twice
    assert wait_until(lambda: gated.server.reads.gated == 3 and not gated.gate.readers.any())
    assert all(np.array_equal(outs[k], blocks[i]) for k, i in enumerate([0, 1, 0]))
    stale = (2 << 20, outs[4], K1, 2 << 20)  # block 2's range, another key: declined
    plan = [(3 << 20, outs[3], bytes([4]) * 16, 3 << 20), stale, plan[1], plan[0]]
    assert gated.transport.read_blocks(plan) == [True, False, True, True]

    def served() -> tuple[int, int]:  # (its thread counts after its send: wait for it too)
        return gated.server.reads.gated, gated.server.bytes_read

    assert wait_until(lambda: served() == (4, 6 * 300_000)), served()  # 1 native, 3 Python
    assert np.array_equal(outs[3], blocks[3]) and np.array_equal(outs[1], blocks[1])


@needs_gate
def test_a_batch_past_the_gather_bounds_is_served_in_turns(gated: Gated) -> None:
    data = _whole(gated, K1, 0, 8192, 1, seed=9)
    outs = [np.zeros(100, np.uint8) for _ in range(GATHER_MAX + 6)]
    plan = [(k, out, K1, 0) for k, out in enumerate(outs)]  # 70 reads of one block's parts
    assert gated.transport.read_blocks(plan) == [True] * len(plan)
    assert wait_until(lambda: gated.server.reads.gated == len(plan))
    assert all(np.array_equal(out, data[k : k + 100]) for k, out in enumerate(outs))


@needs_gate
def test_a_native_batch_in_flight_holds_every_block_it_sends(gated: Gated) -> None:
    small = 8 << 20  # under the gather's byte bound: the next read joins the same send
    a = _whole(gated, K1, 0, small, 1, seed=10)
    b = _whole(gated, K2, small, BIG - small, 2, seed=11)
    stalled = _StalledRead(gated, (K1, 0, small), (K2, small, BIG - small))
    assert wait_until(lambda: (gated.gate.readers[[0, small // ALIGN]] == 1).all())
    assert gated.table.claim(WriteStamp(3, 9, 0, 8192, K2), "new") == FENCE_BUSY
    assert stalled.drain() == [a.tobytes(), b.tobytes()]
    assert wait_until(lambda: not gated.gate.readers.any())
    assert gated.table.claim(WriteStamp(3, 9, 0, 8192, K2), "new") == FENCE_OK


@needs_gate
def test_a_native_read_in_flight_holds_its_block_against_a_newer_claim(gated: Gated) -> None:
    a = _whole(gated, K1, 0, BIG, 1, seed=5)
    stalled = _StalledRead(gated, (K1, 0, BIG))
    assert wait_until(lambda: gated.gate.readers[0] == 1)  # the node's send blocks, the block held
    newer = WriteStamp(3, 9, 0, 8192, K2)
    assert gated.table.claim(newer, "new") == FENCE_BUSY  # after its 0.2 s bound
    assert gated.idents.seq(0) % 2 == 1  # retracted first: no new native read starts there
    assert gated.table.state_of(0) is not None  # the block is still there, held
    assert stalled.drain() == [a.tobytes()]  # the bytes sent are the block's, whole
    assert wait_until(lambda: gated.gate.readers[0] == 0)
    assert gated.table.claim(newer, "new") == FENCE_OK  # the range is the new claim's now
    out = np.zeros(8192, np.uint8)
    assert not gated.transport.read_block(0, 0, out, K1)  # the old block is gone


@needs_gate
def test_take_over_waits_for_a_native_read_in_flight(gated: Gated) -> None:
    gated.table.claim_wait = 10.0
    a = _whole(gated, K1, 0, BIG, 1, seed=6)
    stalled = _StalledRead(gated, (K1, 0, BIG))
    assert wait_until(lambda: gated.gate.readers[0] == 1)
    done = threading.Event()
    taker = threading.Thread(target=lambda: (gated.table.take_over(0, BIG), done.set()))
    taker.start()
    time.sleep(0.1)
    assert not done.is_set()  # an SSD load may not land under the read
    assert stalled.drain() == [a.tobytes()]
    assert done.wait(5.0)
    taker.join()
    assert gated.table.state_of(0) is None


@needs_gate
def test_a_freed_block_a_native_read_holds_stays_until_a_writer_finds_it_idle(
    gated: Gated,
) -> None:
    a = _whole(gated, K1, 0, BIG, 1, seed=7)
    gated.table.committed(K1, 0, BIG, None, 1)
    stalled = _StalledRead(gated, (K1, 0, BIG))
    assert wait_until(lambda: gated.gate.readers[0] == 1)
    gated.table.freed(0, 1)  # the master freed it mid-read (a lease ran out)
    assert gated.idents.seq(0) % 2 == 1  # no new read of it starts
    assert gated.table.state_of(0) is not None  # kept: the read in flight holds it
    newer = WriteStamp(3, 9, ALIGN, 8192, K2)  # overlaps the freed block, not its start
    assert gated.table.claim(newer, "new") == FENCE_BUSY
    assert stalled.drain() == [a.tobytes()]
    assert wait_until(lambda: gated.gate.readers[0] == 0)
    assert gated.table.claim(newer, "new") == FENCE_OK
    assert gated.table.state_of(0) is None  # the claim found it idle and removed it


def test_a_gate_needs_the_records_and_the_fence_of_its_region(gated: Gated) -> None:
    with pytest.raises(ValueError, match="read gate"):
        TcpDataServer(gated.region, read_gate=gated.gate)  # no fence
    with pytest.raises(ValueError, match="read gate"):
        TcpDataServer(np.zeros(1 << 20, np.uint8), fence=gated.table, read_gate=gated.gate)
    with pytest.raises(ValueError, match="identity records"):
        OutsideReads(None, gated.gate)

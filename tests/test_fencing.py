"""The node's write fence (kvpool.cluster.block_table) on its own, and over a real
TCP data server: stale and newer stamps, writes in flight, new terms, frees."""

from __future__ import annotations

import select
import socket
import threading
import time

import numpy as np
import pytest

from kvpool.cluster.block_table import COMMITTED, WRITTEN, BlockTable
from kvpool.errors import BufferSpecError, RemoteError
from kvpool.transport import tcp_wire as w
from kvpool.transport.base import RegionInfo
from kvpool.transport.fencing import FENCE_BUSY, FENCE_OK, FENCE_STALE, WriteStamp
from kvpool.transport.tcp import TcpTransport
from kvpool.transport.tcp_conn import DataConn
from kvpool.transport.tcp_server import TcpDataServer

K1, K2 = b"\x01" * 16, b"\x02" * 16


def table(epoch: int = 5, wait: float = 0.2) -> BlockTable:
    t = BlockTable(lambda offset, size: offset + size + 1, claim_wait=wait)
    t.new_term(epoch)
    return t


def stamp(alloc: int, offset: int = 0, size: int = 100, epoch: int = 5, key: bytes = K1):
    return WriteStamp(epoch, alloc, offset, size, key)


def test_stamp_round_trips_on_the_wire() -> None:
    s = WriteStamp(7, 2**60, 4096, 1 << 20, K1, K2)
    assert WriteStamp.unpack(s.pack()) == s
    assert WriteStamp.unpack(stamp(1).pack()).parent is None


def test_other_terms_and_older_allocations_are_stale() -> None:
    t = table()
    assert t.claim(stamp(1, epoch=4), "a") == FENCE_STALE
    assert t.claim(stamp(1, epoch=6), "a") == FENCE_STALE
    assert t.claim(stamp(10), "a") == FENCE_OK
    assert t.finish(stamp(10), "a", ok=True, seal=True) == FENCE_OK
    assert t.state_of(0) == WRITTEN
    # an expired allocation of an overlapping range, older than the block there
    assert t.claim(stamp(9, offset=50), "b") == FENCE_STALE
    # a written block is immutable: its own stamp cannot write again
    assert t.claim(stamp(10), "a") == FENCE_STALE
    # a newer allocation takes the range over (the master freed the old block)
    assert t.claim(stamp(11, offset=50), "c") == FENCE_OK
    assert t.state_of(0) is None
    assert t.finish(stamp(10), "a", ok=True, seal=True) == FENCE_STALE


def test_a_newer_claim_waits_for_an_older_write_in_flight() -> None:
    t = table(wait=5.0)
    assert t.claim(stamp(1), "old") == FENCE_OK  # old writer is copying
    got: list[int] = []
    waiter = threading.Thread(target=lambda: got.append(t.claim(stamp(2, offset=10), "new")))
    waiter.start()
    time.sleep(0.1)
    assert not got  # still waiting
    # the old copy ends: too late, its range is taken over
    assert t.finish(stamp(1), "old", ok=True, seal=True) in (FENCE_OK, FENCE_STALE)
    waiter.join(5)
    assert got == [FENCE_OK]
    assert t.state_of(0) is None and t.state_of(10) is not None


def test_busy_after_the_wait_bound_and_a_dead_writer_frees_the_range() -> None:
    t = table(wait=0.1)
    assert t.claim(stamp(1), "old") == FENCE_OK
    assert t.claim(stamp(2), "new") == FENCE_BUSY
    t.owner_gone("old")  # its connection closed mid-copy
    assert t.claim(stamp(2), "new") == FENCE_OK


def test_a_new_term_aborts_unfinished_writes_but_keeps_whole_blocks() -> None:
    t = table(wait=0.1)
    assert t.claim(stamp(1, offset=0), "a") == FENCE_OK
    assert t.finish(stamp(1, offset=0), "a", ok=True, seal=True) == FENCE_OK  # acknowledged
    assert t.claim(stamp(2, offset=200, key=K2), "b") == FENCE_OK  # still copying
    t.new_term(6)
    assert [b[0] for b in t.listing()] == [K1]  # the acknowledged block is reported
    # the aborted writer's range stays fenced until its copy ends
    assert t.claim(stamp(1, offset=200, epoch=6), "c") == FENCE_BUSY
    assert t.finish(stamp(2, offset=200, key=K2), "b", ok=True, seal=True) == FENCE_STALE
    assert t.claim(stamp(1, offset=200, epoch=6), "c") == FENCE_OK


def test_free_events_drop_only_the_committed_block_they_name() -> None:
    t = table()
    assert t.promoted(K1, 0, 100, None, 0) is not None  # a block the node loaded itself
    assert t.claim(stamp(3, offset=0, key=K2), "a") == FENCE_OK  # newer allocation
    t.finish(stamp(3, offset=0, key=K2), "a", ok=True, seal=True)
    t.freed(0)  # the free of K1's range arrives after K2 was written there
    assert t.state_of(0) == WRITTEN
    assert t.committed(K1, 0, 100, None) is None  # K1's late commit does not clobber K2
    assert t.committed(K2, 0, 100, None) is not None
    assert t.state_of(0) == COMMITTED
    t.freed(0)
    assert t.state_of(0) is None


def test_listing_puts_confirmed_blocks_before_those_written_only() -> None:
    """Two whole blocks of one key (a writer's put lost the race for its key: its
    range is written, never committed): the one the master confirmed is listed first,
    and a new master restoring the listing keeps the first of a key (BlockCatalog)."""
    t = table()
    for alloc, offset in ((3, 0), (4, 200)):
        assert t.claim(stamp(alloc, offset=offset), "a") == FENCE_OK
        t.finish(stamp(alloc, offset=offset), "a", ok=True, seal=True)
    assert t.committed(K1, 200, 100, None, 4) is not None  # the block the master kept
    assert [(row[0], row[1]) for row in t.listing()] == [(K1, 200), (K1, 0)]


def test_listing_drops_blocks_whose_bytes_changed() -> None:
    sums = {"v": 1}
    t = BlockTable(lambda offset, size: sums["v"])
    t.new_term(1)
    t.promoted(K1, 0, 10, None, 0)
    assert len(t.listing()) == 1
    sums["v"] = 2
    assert t.listing() == []


def test_tcp_stamped_writes_are_fenced(fenced_server) -> None:
    region, fence, tcp = fenced_server
    new = np.full(4096, 7, np.uint8)
    old = np.full(4096, 9, np.uint8)
    s_new, s_old = WriteStamp(3, 20, 0, 4096, K2), WriteStamp(3, 10, 0, 4096, K1)
    assert tcp.stamped([(w.OP_WRITE_FINAL, s_new.pack(), 0, new)]) == [w.ST_OK]
    # the stale writer's bytes are drained, never stored; the connection stays usable
    assert tcp.stamped([(w.OP_WRITE_FINAL, s_old.pack(), 0, old)]) == [w.ST_STALE]
    assert np.array_equal(region[:4096], new)
    stale_term = WriteStamp(2, 99, 8192, 4096, K1)
    assert tcp.stamped([(w.OP_WRITE_PART, stale_term.pack(), 8192, old)]) == [w.ST_STALE]
    assert not region[8192 : 8192 + 4096].any()
    # claim/seal around an out-of-band copy
    s3 = WriteStamp(3, 30, 8192, 4096, K1)
    assert tcp.stamped([(w.OP_CLAIM, s3.pack(), 0, None)]) == [w.ST_OK]
    region[8192 : 8192 + 4096] = 5
    assert tcp.stamped([(w.OP_SEAL, s3.pack(), 0, None)]) == [w.ST_OK]
    assert fence.state_of(8192) == WRITTEN
    out = np.empty(4096, np.uint8)
    tcp.read_into(0, out)
    assert np.array_equal(out, new)


def test_a_single_stamped_write_answers_as_a_pipeline_of_one(fenced_server) -> None:
    """``stamped_one`` (a single put's fast path) answers what ``stamped`` would, refused
    writes included, and leaves the stream in sync for the ops after it (every pad);
    what the server cannot take raises and the next op gets a fresh connection."""
    region, _, tcp = fenced_server
    for i, size in enumerate([4096, 100, 4096 + 7]):  # payloads that move the stream's pads
        block = np.full(size, i + 1, np.uint8)
        off = 16384 * (i + 1)
        fresh = WriteStamp(3, 100 + i, off, size, K1)
        assert tcp.stamped_one(w.OP_WRITE_FINAL, fresh.pack(), off, block) == w.ST_OK
        older = WriteStamp(3, 50 + i, off, size, K2)  # an older allocation of that range
        assert tcp.stamped_one(w.OP_WRITE_FINAL, older.pack(), off, block + 1) == w.ST_STALE
        assert np.array_equal(region[off : off + size], block)
        out = np.zeros(size, np.uint8)
        tcp.read_into(off, out)  # still in sync after the refusal's message
        assert np.array_equal(out, block)
    with pytest.raises(BufferSpecError):  # outside the region: refused before anything moves
        tcp.stamped_one(w.OP_WRITE_FINAL, fresh.pack(), region.nbytes - 10, np.zeros(20, np.uint8))
    commit = WriteStamp(3, 200, 0, 4096, K1)  # this server commits nothing: refused, raises
    with pytest.raises(RemoteError, match="no such stamped writes"):
        tcp.stamped_one(w.OP_WRITE_COMMIT, commit.pack(), 0, np.zeros(4096, np.uint8))
    assert tcp.stamped_one(w.OP_WRITE_FINAL, commit.pack(), 0, np.ones(4096, np.uint8)) == w.ST_OK


def test_a_stale_checked_read_in_a_pipeline_keeps_the_stream_in_sync(fenced_server) -> None:
    """A refused checked read answers as many bytes as an ok one would, so the
    replies after it in the same pipelined exchange are read whole and exact."""
    _, _, tcp = fenced_server
    first, second = np.full(4096, 7, np.uint8), np.full(8192, 5, np.uint8)
    assert tcp.stamped([(w.OP_WRITE_FINAL, WriteStamp(3, 20, 0, 4096, K2).pack(), 0, first)]) == [
        w.ST_OK
    ]
    s2 = WriteStamp(3, 21, 8192, 8192, K1)
    assert tcp.stamped([(w.OP_WRITE_FINAL, s2.pack(), 8192, second)]) == [w.ST_OK]
    for rounds in range(3):  # every pad the stream offset can take along the way
        outs = [np.zeros(4096, np.uint8), np.zeros(4096, np.uint8), np.zeros(8192, np.uint8)]
        items = [(0, outs[0], K1, 0), (0, outs[1], K2, 0), (8192, outs[2], K1, 8192)]
        assert tcp.read_blocks(items) == [False, True, True], rounds
        assert np.array_equal(outs[1], first) and np.array_equal(outs[2], second)
        out = np.zeros(100, np.uint8)  # a short read after them: still in sync
        tcp.read_into(8192, out)
        assert (out == 5).all()


def test_a_refused_checked_read_puts_no_text_in_the_callers_buffer(fenced_server) -> None:
    """A refusal is as long as an ok reply and lands where the payload would: its
    message is cut to the reply's pad, so whatever the stream offset (each write's
    16-byte acknowledgement moves it, so four writes give every pad: 48, 32, 16,
    0), the reader's buffer gets NULs, never the message's text (which spilled
    into it where the pad was under its 37 bytes)."""
    _, _, tcp = fenced_server
    for i in range(4):
        stamp = WriteStamp(3, 50 + i, i * 4096, 4096, K2)
        assert tcp.stamped(
            [(w.OP_WRITE_FINAL, stamp.pack(), i * 4096, np.full(4096, 3, np.uint8))]
        ) == [w.ST_OK]
        batch, single = np.zeros(4096, np.uint8), np.zeros(4096, np.uint8)
        assert tcp.read_blocks([(i * 4096, batch, K1, i * 4096)]) == [False]
        assert not tcp.read_block(i * 4096, 0, single, K1)
        assert not batch.any() and not single.any(), i
    out = np.zeros(4096, np.uint8)  # still in sync
    assert tcp.read_block(3 * 4096, 0, out, K2) and (out == 3).all()


def test_a_batch_with_one_output_that_is_not_host_memory_reads_every_block(
    fenced_server,
) -> None:
    """``read_blocks`` hands a batch to the native call as it is while every output
    is writable contiguous host memory (a float32 array too: the same bytes land);
    an output it does not take -- a torch tensor, a read-only array, a strided view,
    a range past the region -- sends the whole batch down the general path, nothing
    sent before: byte-exact, or the usual error with the stream in sync.
    ``bytes_read`` counts the served reads' bytes only."""
    _, _, tcp = fenced_server
    first, second = np.full(4096, 7, np.uint8), np.full(8192, 5, np.uint8)
    s1, s2 = WriteStamp(3, 40, 0, 4096, K2), WriteStamp(3, 41, 8192, 8192, K1)
    assert tcp.stamped([(w.OP_WRITE_FINAL, s1.pack(), 0, first)]) == [w.ST_OK]
    assert tcp.stamped([(w.OP_WRITE_FINAL, s2.pack(), 8192, second)]) == [w.ST_OK]
    host, floats = np.zeros(4096, np.uint8), np.zeros(2048, np.float32)
    before = tcp.bytes_read
    assert tcp.read_blocks([(0, host, K2, 0), (8192, floats, K1, 8192)]) == [True, True]
    assert np.array_equal(host, first) and (floats.view(np.uint8) == 5).all()
    stale = np.zeros(4096, np.uint8)
    assert tcp.read_blocks([(0, stale, K1, 0), (0, host, K2, 0)]) == [False, True]
    assert tcp.bytes_read - before == 4096 + 8192 + 4096  # not the refused read's
    with pytest.raises(ValueError):
        tcp.read_blocks([(0, host, K2, 0), (1 << 16, np.zeros(10, np.uint8), K1, 8192)])
    strided = np.zeros(16384, np.uint8)[::2]
    with pytest.raises(BufferSpecError, match="C-contiguous"):
        tcp.read_blocks([(0, host, K2, 0), (8192, strided, K1, 8192)])
    frozen = np.zeros(8192, np.uint8)
    frozen.flags.writeable = False
    with pytest.raises(BufferSpecError, match="read-only"):
        tcp.read_blocks([(0, host, K2, 0), (8192, frozen, K1, 8192)])
    torch = pytest.importorskip("torch")
    tensor = torch.zeros(8192, dtype=torch.uint8)
    assert tcp.read_blocks([(0, host, K2, 0), (8192, tensor, K1, 8192)]) == [True, True]
    assert (tensor == 5).all()
    out = np.zeros(100, np.uint8)  # the connection is still in sync
    tcp.read_into(8192, out)
    assert (out == 5).all()


def test_single_checked_reads_refused_and_served_on_one_connection(fenced_server) -> None:
    """``read_blocks`` of one block into a host array (the fast path without the
    batch's lists): a stale one answers False and leaves the stream in sync."""
    _, _, tcp = fenced_server
    data = np.full(4096, 3, np.uint8)
    assert tcp.stamped([(w.OP_WRITE_FINAL, WriteStamp(3, 40, 0, 4096, K2).pack(), 0, data)]) == [
        w.ST_OK
    ]
    for rounds in range(3):
        out = np.zeros(4096, np.uint8)
        assert tcp.read_blocks([(0, out, K1, 0)]) == [False], rounds  # another block there
        assert tcp.read_blocks([(0, out, K2, 0)]) == [True], rounds
        assert np.array_equal(out, data)
        half = np.zeros(1000, np.uint8)  # a part of the block, at an offset inside it
        assert tcp.read_blocks([(100, half, K2, 0)]) == [True]
        assert (half == 3).all()


@pytest.mark.usefixtures("checked_read_path")
def test_read_block_checks_like_read_blocks_and_keeps_the_stream_in_sync(fenced_server) -> None:
    """``TcpTransport.read_block`` (the read fast path's call, the signature of the
    shm one): True and the bytes, or False when another block holds the range;
    any buffer that is not a flat host array goes through the general plan; a
    range outside the region is refused before anything is sent."""
    _, _, tcp = fenced_server
    data = np.arange(4096, dtype=np.uint32).astype(np.uint8)
    assert tcp.stamped([(w.OP_WRITE_FINAL, WriteStamp(3, 50, 0, 4096, K2).pack(), 0, data)]) == [
        w.ST_OK
    ]
    for rounds in range(3):  # every pad the stream offset can take along the way
        out = np.zeros(4096, np.uint8)
        assert not tcp.read_block(0, 0, out, K1), rounds  # another block there
        assert tcp.read_block(0, 0, out, K2) and np.array_equal(out, data)
        part = bytearray(1000)  # not a numpy array: the general path, same check
        assert tcp.read_block(0, 100, part, K2) and bytes(part) == data[100:1100].tobytes()
        assert not tcp.read_block(0, 100, part, K1)
        mixed = [np.zeros(4096, np.uint8), bytearray(4096), np.zeros(4096, np.uint8)]
        items = [(0, mixed[0], K2, 0), (0, mixed[1], K1, 0), (0, mixed[2], K2, 0)]
        assert tcp.read_blocks(items) == [True, False, True]
        assert np.array_equal(mixed[0], data) and np.array_equal(mixed[2], data)
    with pytest.raises(ValueError):
        tcp.read_block(tcp.info.size - 100, 0, np.zeros(4096, np.uint8), K2)
    out = np.zeros(4096, np.uint8)
    assert tcp.read_block(0, 0, out, K2) and np.array_equal(out, data)  # still in sync


@pytest.mark.usefixtures("checked_read_path")
def test_checked_reads_larger_than_one_waitall_receive_stay_exact_and_in_sync() -> None:
    """Replies over ``WAITALL_MAX`` are taken as they arrive (several receives): a
    single read and a pipelined batch of 1 MiB blocks, a refusal of the same length
    between them, then a short read: every byte where it belongs."""
    size = 1 << 20
    assert size > w.WAITALL_MAX
    region = np.zeros(4 * size, np.uint8)
    server = TcpDataServer(region, fence=table(epoch=3))
    server.start()
    info = RegionInfo("n", region.nbytes, tcp_host="127.0.0.1", tcp_port=server.address[1])
    info.tcp_instance = server.instance
    tcp = TcpTransport(info, timeout=5)
    try:
        rng = np.random.default_rng(3)
        blocks = [rng.integers(0, 256, size, dtype=np.uint8) for _ in range(3)]
        keys = [bytes([i + 1]) * 16 for i in range(3)]
        for i, (b, k) in enumerate(zip(blocks, keys, strict=True)):
            stamp = WriteStamp(3, 60 + i, i * size, size, k).pack()
            assert tcp.stamped([(w.OP_WRITE_FINAL, stamp, i * size, b)]) == [w.ST_OK]
        for rounds in range(3):  # every pad the stream offset can take along the way
            out = np.zeros(size, np.uint8)
            assert not tcp.read_block(0, 0, out, keys[1]), rounds  # another block there
            assert tcp.read_block(size, 0, out, keys[1]) and np.array_equal(out, blocks[1])
            outs = [np.zeros(size, np.uint8) for _ in range(3)]
            items = [(0, outs[0], keys[0], 0), (size, outs[1], keys[0], size)]
            items.append((2 * size, outs[2], keys[2], 2 * size))
            assert tcp.read_blocks(items) == [True, False, True], rounds
            assert np.array_equal(outs[0], blocks[0]) and np.array_equal(outs[2], blocks[2])
            short = np.zeros(100, np.uint8)
            tcp.read_into(size + 7, short)
            assert np.array_equal(short, blocks[1][7:107])
    finally:
        tcp.close()
        server.close()


def test_a_pipelined_batch_of_claims_is_answered_in_one_send(fenced_server) -> None:
    """The replies to payload-less fenced ops buffered together leave in one send
    (tcp_server's outbox): when the first reply is readable, all of them are."""
    _, _, tcp = fenced_server
    stamps = [WriteStamp(3, 100 + i, i * 1024, 1024, K1) for i in range(20)]
    conn = DataConn("127.0.0.1", tcp.info.tcp_port, None, 5.0, tcp.info.tcp_instance)
    try:
        rids = conn.stamped_send([(w.OP_CLAIM, s.pack(), 0, None) for s in stamps])
        select.select([conn.sock], [], [], 5.0)
        ready = conn.sock.recv(1 << 16, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        assert len(ready) == len(stamps) * w.RESP.size
        assert conn.stamped_statuses(rids) == [w.ST_OK] * len(stamps)
        release = conn.stamped_send([(w.OP_RELEASE, s.pack(), 0, None) for s in stamps])
        assert conn.stamped_statuses(release) == [w.ST_OK] * len(stamps)
    finally:
        conn.close()


def test_a_mixed_pipeline_keeps_its_replies_in_order_and_the_stream_in_sync(
    fenced_server,
) -> None:
    """Claims, refused (stale) claims whose replies carry a message, a write with
    its payload, a seal and a release in one pipelined exchange: each status in
    request order, the bytes where they belong, and a read after them exact."""
    region, fence, tcp = fenced_server
    for rounds in range(3):  # every pad the stream offset can take along the way
        data = np.full(4096, 8 + rounds, np.uint8)
        claimed = WriteStamp(3, 60 + 10 * rounds, 16384, 4096, K1)
        stale = WriteStamp(2, 61 + 10 * rounds, 20480, 4096, K1)  # an older term
        write = WriteStamp(3, 62 + 10 * rounds, 24576, 4096, K2)
        spare = WriteStamp(3, 63 + 10 * rounds, 28672, 4096, K1)
        plan = [
            (w.OP_CLAIM, claimed.pack(), 0, None),
            (w.OP_CLAIM, stale.pack(), 0, None),
            (w.OP_CLAIM, stale.pack(), 0, None),
            (w.OP_CLAIM, spare.pack(), 0, None),
            (w.OP_WRITE_FINAL, write.pack(), 24576, data),
            (w.OP_SEAL, claimed.pack(), 0, None),
            (w.OP_RELEASE, spare.pack(), 0, None),
        ]
        ok, no = w.ST_OK, w.ST_STALE
        assert tcp.stamped(plan) == [ok, no, no, ok, ok, ok, ok], rounds
        assert np.array_equal(region[24576 : 24576 + 4096], data)
        assert fence.state_of(16384) == WRITTEN
        out = np.zeros(4096, np.uint8)
        tcp.read_into(24576, out)
        assert np.array_equal(out, data)

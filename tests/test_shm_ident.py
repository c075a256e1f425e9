"""Block identity records in shared memory (kvpool.transport.shm_ident) and the
same-host checked read built on them (ShmTransport.read_block)."""

from __future__ import annotations

import os
import secrets
import threading
import time

import numpy as np
import pytest

from kvpool.cluster.block_entry import COMMITTED
from kvpool.cluster.block_table import BlockTable
from kvpool.storage.arena import SharedArena
from kvpool.transport import shm, shm_copy
from kvpool.transport.base import RegionInfo, host_identity
from kvpool.transport.fencing import FENCE_OK, WriteStamp
from kvpool.transport.shm import ShmTransport, shm_path
from kvpool.transport.shm_ident import ALIGN, RECORD, BlockIdents, ident_bytes, ident_name

K1, K2 = b"\x01" * 16, b"\x02" * 16


@pytest.fixture
def idents():
    path = shm_path(f"kvpool-test-{os.getpid()}-{secrets.token_hex(4)}.ident")
    writer = BlockIdents(path, 16 * ALIGN, create=True)
    reader = BlockIdents(path, 16 * ALIGN, create=False)
    yield writer, reader
    reader.close()
    writer.close()
    assert not os.path.exists(path)  # the node's close unlinks it


def test_a_record_names_a_whole_block_between_publish_and_retract(idents) -> None:
    writer, reader = idents
    assert ident_bytes(16 * ALIGN) == 16 * RECORD.size
    assert reader.check_then(K1, 0, 0, 10) == -1  # never published
    writer.publish(0, 2 * ALIGN, K1)
    seq = reader.check_then(K1, 0, 0, 2 * ALIGN)
    assert seq > 0 and seq % 2 == 0 and reader.still(0, seq)
    assert reader.check_then(K1, 0, ALIGN, ALIGN) == seq  # a range inside the block
    assert reader.check_then(K1, 0, ALIGN, ALIGN + 1) == -1  # past its end
    assert reader.check_then(K2, 0, 0, 10) == -1  # another key
    assert reader.check_then(K1, ALIGN, 0, 10) == -1  # not a block start
    assert reader.check_then(K1, 5, 0, 10) == -1  # unaligned: never a block
    assert reader.check_then(K1, 16 * ALIGN, 0, 10) == -1  # past the arena
    writer.retract(0)
    assert reader.seq(0) % 2 == 1  # odd: being claimed or freed
    assert not reader.still(0, seq) and reader.check_then(K1, 0, 0, 10) == -1
    writer.retract(0)  # idempotent: stays odd
    assert reader.seq(0) == seq + 1


def test_a_republished_record_never_looks_unchanged(idents) -> None:
    """The same key published again at the same place (a re-put) has a new seq:
    a copy that straddled the change is a miss."""
    writer, reader = idents
    writer.publish(0, ALIGN, K1)
    before = reader.check_then(K1, 0, 0, ALIGN)
    writer.retract(0)
    writer.publish(0, ALIGN, K1)
    after = reader.check_then(K1, 0, 0, ALIGN)
    assert after > before and not reader.still(0, before) and reader.still(0, after)
    writer.publish(0, ALIGN, K2)  # published over without a retract: still a new seq
    assert not reader.still(0, after) and reader.check_then(K2, 0, 0, ALIGN) == after + 2


def test_a_reader_refuses_an_identity_file_of_another_size(idents) -> None:
    writer, _ = idents
    with pytest.raises(ValueError, match="not the identity file"):
        BlockIdents(writer.path, 32 * ALIGN, create=False)


def test_the_node_table_publishes_whole_blocks_and_retracts_before_a_claim(idents) -> None:
    writer, reader = idents
    table = BlockTable(lambda offset, size: 1, idents=writer)
    table.new_term(3)
    old = WriteStamp(3, 10, 0, 2 * ALIGN, K1)
    assert table.claim(old, "a") == FENCE_OK
    assert reader.check_then(K1, 0, 0, 1) == -1  # claimed: not readable yet
    table.finish(old, "a", ok=True, seal=True)
    seq = reader.check_then(K1, 0, 0, 2 * ALIGN)
    assert seq > 0
    # A newer allocation overlapping the block's tail: the old record goes first.
    assert table.claim(WriteStamp(3, 11, ALIGN, ALIGN, K2), "b") == FENCE_OK
    assert not reader.still(0, seq) and reader.check_then(K1, 0, 0, 1) == -1
    assert reader.check_then(K2, ALIGN, 0, 1) == -1  # still being written
    table.finish(WriteStamp(3, 11, ALIGN, ALIGN, K2), "b", ok=True, seal=True)
    assert reader.check_then(K2, ALIGN, 0, ALIGN) > 0
    table.take_over(0, 4 * ALIGN)  # the node loads an SSD block over both ranges
    assert reader.check_then(K2, ALIGN, 0, 1) == -1
    assert table.promoted(K1, 0, ALIGN, None, 12) is not None  # the SSD block is whole
    assert reader.check_then(K1, 0, 0, ALIGN) > 0
    assert table.committed(K1, 0, ALIGN, None, 12) is not None  # the master's commit
    table.freed(0, 12)
    assert reader.check_then(K1, 0, 0, 1) == -1


def test_a_late_commit_of_a_block_loaded_before_never_returns_over_the_next_load(
    idents,
) -> None:
    """The order that lost a block in CI: the node loads block 1 from SSD into a
    range (allocation 21); the master evicts it and orders block 2 loaded into the
    same range (allocation 22, a direct RPC: ``take_over``, then the load). Block
    1's commit and free events, queued for the heartbeat, arrive only now, while
    block 2's bytes are landing. The commit must not bring block 1 back (its key
    published over block 2's bytes, and block 2 refused as overlapping): the range
    stays unreadable until block 2's load ends, then serves block 2 alone; a free
    that arrives late, even one naming no allocation, leaves block 2 (it is
    ``WRITTEN`` until its own commit, which the event stream delivers after)."""
    writer, reader = idents
    table = BlockTable(lambda offset, size: 1, idents=writer)
    table.new_term(3)
    table.take_over(0, ALIGN)
    assert table.promoted(K1, 0, ALIGN, None, 21) is not None
    assert reader.check_then(K1, 0, 0, ALIGN) > 0
    table.take_over(0, ALIGN)  # block 2's load starts
    assert table.committed(K1, 0, ALIGN, None, 21) is None  # block 1's late commit
    assert table.state_of(0) is None and reader.check_then(K1, 0, 0, 1) == -1
    assert table.promoted(K2, 0, ALIGN, None, 22) is not None  # block 2's load ends
    assert reader.check_then(K2, 0, 0, ALIGN) > 0 and reader.check_then(K1, 0, 0, 1) == -1
    table.freed(0, 21)  # block 1's late free: block 2 stays
    table.freed(0, 0)  # nor does a free naming no allocation (a block the master
    # knows from a re-registration: it was freed there before block 2 was loaded)
    assert reader.check_then(K2, 0, 0, ALIGN) > 0
    assert table.committed(K2, 0, ALIGN, None, 22) is not None  # its own commit: checksummed
    assert table.state_of(0) == COMMITTED
    held = table.begin_read(K2, 0, 0, ALIGN)
    assert held is not None and table.begin_read(K1, 0, 0, ALIGN) is None
    table.end_read(held)


def test_a_load_the_master_no_longer_wants_goes_on_its_own_free(idents) -> None:
    """The master freed a load's allocation instead of committing it (the block was
    removed meanwhile): the free names that allocation, and the loaded block goes
    (before, it stayed readable, and a re-registration would have reported it)."""
    writer, reader = idents
    table = BlockTable(lambda offset, size: 1, idents=writer)
    table.new_term(3)
    assert table.promoted(K1, 0, ALIGN, None, 21) is not None
    table.freed(0, 20)  # another allocation's free: kept
    table.freed(0, 0)
    assert reader.check_then(K1, 0, 0, ALIGN) > 0
    table.freed(0, 21)
    assert table.state_of(0) is None and reader.check_then(K1, 0, 0, 1) == -1


def test_a_commit_event_never_creates_an_entry() -> None:
    """Commit events only mark blocks the node holds: one naming a range the node
    has nothing in (freed, taken over, never written here) leaves it empty."""
    table = BlockTable(lambda offset, size: 1)
    table.new_term(3)
    assert table.committed(K1, 0, ALIGN, None, 5) is None
    assert table.committed(K1, 0, ALIGN, None) is None  # allocation unknown (0)
    assert table.state_of(0) is None and table.listing() == []
    assert table.promoted(K1, 0, ALIGN, None, 5) is not None
    assert table.promoted(K2, ALIGN // 2, ALIGN, None, 6) is None  # overlaps block 1
    assert [row[0] for row in table.listing()] == [K1]


@pytest.fixture
def arena():
    region = SharedArena(16 * ALIGN)
    path = shm_path(ident_name(region.name))
    writer = BlockIdents(path, region.size, create=True)
    info = RegionInfo("n", region.size, shm_name=region.name, host_id=host_identity())
    yield region, writer, info
    writer.close()
    region.close()


@pytest.mark.parametrize("native", [True, False], ids=["native", "python"])
@pytest.mark.parametrize("size", [4 * ALIGN, 16 * ALIGN])
def test_checked_reads_miss_rather_than_copy_another_blocks_bytes(
    arena, native: bool, size: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A node rewrites one range over and over with other blocks (claim, bytes,
    seal, as a writer does), while a same-host reader keeps reading the first
    block it was told about: every read it accepts holds that block's bytes. On
    the native checked read (kvpool.transport.shm_copy) and on the Python one;
    at 64 KiB the native one takes over once the size class's copy is settled."""
    if native and shm.read_checked is None:
        pytest.skip(shm_copy.STATUS)
    if not native:
        monkeypatch.setattr(shm, "read_checked", None)
    region, writer, info = arena
    table = BlockTable(lambda offset, size: 1, idents=writer)
    table.new_term(1)
    keys = [bytes([i + 1]) * 16 for i in range(2)]
    fills = [np.full(size, i + 1, np.uint8) for i in range(2)]
    stop = threading.Event()
    rounds = [0]

    def rewrite() -> None:
        alloc = 0
        while not stop.is_set():
            alloc += 1
            i = alloc % 2
            stamp = WriteStamp(1, alloc, 0, size, keys[i])
            assert table.claim(stamp, "w") == FENCE_OK
            for part in range(0, size, ALIGN):  # the bytes land in pieces
                region.view[part : part + ALIGN] = fills[i][part : part + ALIGN]
            table.finish(stamp, "w", ok=True, seal=True)
            rounds[0] += 1
            time.sleep(0.0002)  # lets the reader run (the copy releases the GIL to us)

    reader = ShmTransport(info)
    assert reader.checked
    thread = threading.Thread(target=rewrite)
    thread.start()
    out = np.empty(size, np.uint8)
    hits = misses = 0
    deadline = time.monotonic() + 0.5
    try:
        while time.monotonic() < deadline:
            if reader.read_block(0, 0, out, keys[0]):
                hits += 1
                assert np.array_equal(out, fills[0])
            else:
                misses += 1
    finally:
        stop.set()
        thread.join(5)
        reader.close()
    assert rounds[0] > 10 and misses > 0 and hits > 0  # both blocks were there in turn


def test_a_node_without_identity_records_is_read_unchecked() -> None:
    region = SharedArena(2 * ALIGN)
    try:
        region.view[:] = 7
        info = RegionInfo("n", region.size, shm_name=region.name, host_id=host_identity())
        reader = ShmTransport(info)
        out = np.empty(ALIGN, np.uint8)
        assert not reader.checked and reader.read_block(0, ALIGN, out, K1)
        assert (out == 7).all()
        reader.close()
    finally:
        region.close()


def test_a_commit_that_overtakes_the_seal_publishes_the_block(idents) -> None:
    """A same-host put seals and commits in parallel: the master's commit event may
    reach the node first. The bytes are in place by then, so the block is readable."""
    writer, reader = idents
    table = BlockTable(lambda offset, size: 1, idents=writer)
    table.new_term(3)
    stamp = WriteStamp(3, 10, 0, ALIGN, K1)
    assert table.claim(stamp, "a") == FENCE_OK
    assert reader.check_then(K1, 0, 0, ALIGN) == -1
    assert table.committed(K1, 0, ALIGN, None, 10) is not None
    seq = reader.check_then(K1, 0, 0, ALIGN)
    assert seq > 0
    table.finish(stamp, "a", ok=True, seal=True)  # the seal, late: still the same block
    assert reader.check_then(K1, 0, 0, ALIGN) > 0


def test_an_ssd_load_waits_for_a_read_in_flight_on_its_range(idents) -> None:
    """The node loads an SSD block into a range the master chose while a TCP reader
    (with an outdated lease) is still being sent the old block there: the load
    waits for that read; no new read of the old block starts meanwhile."""
    writer, reader = idents
    table = BlockTable(lambda offset, size: 1, claim_wait=5.0, idents=writer)
    table.new_term(3)
    stamp = WriteStamp(3, 10, 0, ALIGN, K1)
    assert table.claim(stamp, "a") == FENCE_OK
    table.finish(stamp, "a", ok=True, seal=True)
    held = table.begin_read(K1, 0, 0, ALIGN)
    assert held is not None
    done = threading.Event()
    loader = threading.Thread(target=lambda: (table.take_over(0, ALIGN), done.set()))
    loader.start()
    time.sleep(0.1)
    assert not done.is_set()  # waiting for the read in flight
    assert table.begin_read(K1, 0, 0, ALIGN) is None  # no new reader of the old block
    table.end_read(held)
    loader.join(5)
    assert done.is_set() and table.state_of(0) is None
    assert reader.check_then(K1, 0, 0, ALIGN) == -1

"""A same-host copy and its block's record in one native call (kvpool.transport.shm_copy).

The compiled functions against the Python modules that own the record
layouts: a record the node publishes (kvpool.transport.shm_ident) is the one
``read_checked`` checks, and a seal record ``write_sealed`` writes is the one
the node reads (kvpool.transport.shm_seal). Then ShmTransport's two entry
points, ``read_block`` and ``write_sealed``, on the native path and on the
Python one (a size class still learning its copy way, or no extension) alike:
the same answers, the same errors, exact bytes, and a transport closed under a
reader's copy. No wrong bytes while the node rewrites the range under a
reader, on either path: tests/test_shm_ident.py. End to end through real
processes: tests/test_shm_ident.py, tests/test_shm_seal.py and
tests/test_stream_copy.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from kvpool.bindings.copy_choice import NUMPY, STREAM
from kvpool.errors import BufferSpecError, PoolClosedError
from kvpool.storage.arena import SharedArena
from kvpool.transport import shm, shm_copy
from kvpool.transport.base import RegionInfo, host_identity
from kvpool.transport.fencing import WriteStamp
from kvpool.transport.shm import ShmTransport, shm_path
from kvpool.transport.shm_ident import ALIGN, BlockIdents, ident_name
from kvpool.transport.shm_seal import NODE_COMMITS, SEALED, SealRecords, seal_name

if shm_copy.read_checked is None and os.environ.get("KVPOOL_REQUIRE_SHM_COPY") == "1":
    pytest.fail(f"KVPOOL_REQUIRE_SHM_COPY=1 but {shm_copy.STATUS}", pytrace=False)
needs_native = pytest.mark.skipif(shm_copy.read_checked is None, reason=shm_copy.STATUS)

K1, K2, P1 = b"\x01" * 16, b"\x02" * 16, b"\x07" * 16
PAGES = 64  # the test arena: 256 KiB


def _random(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


class Node:
    """A node's side of one arena: the arena, its identity and seal files."""

    def __init__(self, pages: int = PAGES, node_commits: bool = True) -> None:
        self.arena = SharedArena(pages * ALIGN)
        name = self.arena.name
        self.idents = BlockIdents(shm_path(ident_name(name)), self.arena.size, create=True)
        self.seals = SealRecords(
            shm_path(seal_name(name)), self.arena.size, create=True, node_commits=node_commits
        )
        self.info = RegionInfo("n", self.arena.size, shm_name=name, host_id=host_identity())

    def store(self, offset: int, data: np.ndarray, key: bytes) -> None:
        """A whole block at ``offset``, published as a node publishes one."""
        self.idents.retract(offset)
        self.arena.view[offset : offset + data.size] = data
        self.idents.publish(offset, data.size, key)

    def close(self) -> None:
        self.seals.close()
        self.idents.close()
        self.arena.close()


@pytest.fixture
def node() -> Iterator[Node]:
    n = Node()
    yield n
    n.close()


@pytest.fixture(params=["native", "python"])
def path(request: Any, monkeypatch: pytest.MonkeyPatch) -> str:
    """Which way ShmTransport takes: the native call, or the checks in Python."""
    if request.param == "native":
        if shm_copy.read_checked is None:
            pytest.skip(shm_copy.STATUS)
    else:
        monkeypatch.setattr(shm, "read_checked", None)
        monkeypatch.setattr(shm, "read_checked_many", None)
        monkeypatch.setattr(shm, "write_sealed", None)
    return str(request.param)


# -- the compiled functions against the Python record layouts ----------------------------


@needs_native
@pytest.mark.parametrize("way", [NUMPY, STREAM])
@pytest.mark.parametrize("size", [1, 63, 4096, 3 * ALIGN + 17, 64 << 10])
def test_read_checked_copies_exactly_the_published_block(node: Node, way: int, size: int) -> None:
    data = _random(size, size)
    node.store(2 * ALIGN, data, K1)
    reader = BlockIdents(node.idents.path, node.arena.size, create=False)
    try:
        out = np.zeros(size + 128, np.uint8)
        dst = out[64 : 64 + size]  # guards either side stay untouched
        args = (node.arena.view, reader.mapping, 2 * ALIGN, 0, K1, way)
        assert shm_copy.read_checked(dst, *args) == 1
        assert np.array_equal(dst, data)
        assert not out[:64].any() and not out[64 + size :].any()
        if size > 1:  # a range inside the block
            part = np.zeros(size - 1, np.uint8)
            args = (node.arena.view, reader.mapping, 2 * ALIGN, 1, K1, way)
            assert shm_copy.read_checked(part, *args) == 1 and np.array_equal(part, data[1:])
    finally:
        reader.close()


@needs_native
def test_read_checked_misses_whatever_the_record_does_not_name(node: Node) -> None:
    data = _random(2 * ALIGN, 1)
    node.store(ALIGN, data, K1)
    view, records = node.arena.view, node.idents.mapping
    out = np.zeros(ALIGN, np.uint8)

    def read(block_offset: int, start: int = 0, key: Any = K1, dst: Any = out) -> int:
        return shm_copy.read_checked(dst, view, records, block_offset, start, key, NUMPY)

    assert read(ALIGN) == 1
    assert read(ALIGN, key=K2) == 0  # another block's key
    assert read(ALIGN, start=ALIGN + 1) == 0  # past the block's end
    assert read(ALIGN + 8) == 0  # no block starts there
    assert read(0) == 0 and read(3 * ALIGN) == 0  # never published
    assert read(-ALIGN) == 0 and read(ALIGN, start=-1) == 0
    assert read(PAGES * ALIGN) == 0  # no record that far
    assert read(ALIGN, key=K1[:8]) == 0 and read(ALIGN, key="not bytes") == 0
    node.idents.retract(ALIGN)  # being rewritten: odd seq
    assert read(ALIGN) == 0
    node.idents.publish(ALIGN, 2 * ALIGN, K1)
    assert read(ALIGN) == 1 and np.array_equal(out, data[:ALIGN])
    # a record naming more than the arena holds: nothing copied, -1 (the caller raises)
    node.idents.publish((PAGES - 1) * ALIGN, 2 * ALIGN, K2)
    assert read((PAGES - 1) * ALIGN, start=ALIGN, key=K2) == -1
    with pytest.raises(BufferError):  # a read-only destination
        shm_copy.read_checked(data[:1].tobytes(), view, records, ALIGN, 0, K1, NUMPY)
    with pytest.raises(TypeError):
        shm_copy.read_checked(out, view, records, ALIGN, 0, K1)


@needs_native
@pytest.mark.parametrize("way", [NUMPY, STREAM])
def test_read_checked_many_answers_as_read_checked_read_by_read(node: Node, way: int) -> None:
    """A batch of reads of one size -- hits, a range inside a block, misses of every
    kind, one past the arena -- answers per read as ``read_checked`` does, exact bytes;
    a destination of another size or not writable contiguous memory, an offset that
    is not an int: None, nothing copied; a malformed plan raises."""
    a, b = _random(2 * ALIGN, 5), _random(2 * ALIGN, 6)
    node.store(ALIGN, a, K1)
    node.store(4 * ALIGN, b, K2)
    node.idents.publish((PAGES - 1) * ALIGN, 2 * ALIGN, K2)  # a record past the arena
    view, records = node.arena.view, node.idents.mapping
    n = ALIGN // 2
    starts = [  # (block offset, start in it, key)
        (ALIGN, 0, K1), (4 * ALIGN, 100, K2), (ALIGN, ALIGN, K1), (ALIGN, 0, K2),
        (2 * ALIGN, 0, K1), (ALIGN + 8, 0, K1), (ALIGN, -1, K1), (ALIGN, 2 * ALIGN, K1),
        (ALIGN, 0, b"short"), ((PAGES - 1) * ALIGN, ALIGN, K2),
    ]  # fmt: skip
    outs = [np.zeros(n, np.uint8) for _ in starts]
    plan = [(blk + st, out, key, blk) for (blk, st, key), out in zip(starts, outs, strict=True)]
    one_by_one = [
        shm_copy.read_checked(np.zeros(n, np.uint8), view, records, blk, st, key, way)
        for blk, st, key in starts
    ]
    assert one_by_one == [1, 1, 1, 0, 0, 0, 0, 0, 0, -1]
    assert shm_copy.read_checked_many(plan, view, records, n, way) == one_by_one
    assert np.array_equal(outs[0], a[:n]) and np.array_equal(outs[1], b[100 : 100 + n])
    assert np.array_equal(outs[2], a[ALIGN : ALIGN + n]) and not outs[9].any()

    frozen = np.zeros(n, np.uint8)
    frozen.setflags(write=False)
    for dst in (np.zeros(n + 1, np.uint8), frozen, np.zeros(2 * n, np.uint8)[::2], b"\0" * n):
        fresh = np.zeros(n, np.uint8)
        batch = [(ALIGN, fresh, K1, ALIGN), (ALIGN, dst, K1, ALIGN)]
        assert shm_copy.read_checked_many(batch, view, records, n, way) is None
        assert not fresh.any()  # nothing copied, the good read before it included
    floaty = [(float(ALIGN), np.zeros(n, np.uint8), K1, ALIGN)]
    assert shm_copy.read_checked_many(floaty, view, records, n, way) is None
    assert shm_copy.read_checked_many([], view, records, n, way) == []
    with pytest.raises(TypeError):
        shm_copy.read_checked_many(tuple(plan), view, records, n, way)
    with pytest.raises(TypeError, match=r"plan\[0\] is not"):
        shm_copy.read_checked_many([(ALIGN, outs[0], K1)], view, records, n, way)


@needs_native
@pytest.mark.parametrize("way", [NUMPY, STREAM])
@pytest.mark.parametrize("parent", [None, P1])
def test_write_sealed_writes_the_record_the_node_reads(
    node: Node, way: int, parent: bytes | None
) -> None:
    data = _random(5 * ALIGN + 3, 2)
    writer = SealRecords(node.seals.path, node.arena.size, create=False)
    try:
        node.seals.clear(4 * ALIGN)
        args = (writer.mapping, 4 * ALIGN, 9, 1234, K1, parent, NODE_COMMITS, way)
        assert shm_copy.write_sealed(node.arena.view, data, *args) == 1
        assert np.array_equal(node.arena.view[4 * ALIGN : 4 * ALIGN + data.size], data)
        stamp = WriteStamp(9, 1234, 4 * ALIGN, data.size, K1, parent)
        assert node.seals.read(4 * ALIGN) == (stamp, True)
        assert node.seals.rung() and not node.seals.rung()  # the doorbell, once
        node.seals.clear(8 * ALIGN)
        args = (writer.mapping, 8 * ALIGN, 9, 1235, K2, parent, SEALED, way)
        assert shm_copy.write_sealed(node.arena.view, data, *args) == 1
        stamp = WriteStamp(9, 1235, 8 * ALIGN, data.size, K2, parent)
        assert node.seals.read(8 * ALIGN) == (stamp, False)
        assert not node.seals.rung()  # SEALED rings nothing
    finally:
        writer.close()


@needs_native
def test_write_sealed_refuses_what_has_no_record_and_touches_nothing(node: Node) -> None:
    data = np.full(ALIGN, 5, np.uint8)
    view, seals = node.arena.view, node.seals.mapping

    def write(offset: int, key: Any = K1, parent: Any = None, src: Any = data) -> int:
        return shm_copy.write_sealed(view, src, seals, offset, 1, 1, key, parent, NODE_COMMITS, 0)

    assert write(ALIGN + 8) == 0  # no block starts there
    assert write(ALIGN, key=K1[:15]) == 0 and write(ALIGN, parent=b"short") == 0
    assert write(ALIGN, key=None) == 0
    assert not view.any() and node.seals.read(ALIGN) is None and not node.seals.rung()
    assert write(-ALIGN) == -1 and write(PAGES * ALIGN) == -1  # outside the arena
    assert write((PAGES - 1) * ALIGN, src=np.ones(2 * ALIGN, np.uint8)) == -1
    assert not view.any()
    with pytest.raises(OverflowError):
        shm_copy.write_sealed(view, data, seals, ALIGN, -1, 1, K1, None, NODE_COMMITS, 0)
    with pytest.raises(BufferError):  # seal records that cannot be written
        shm_copy.write_sealed(view, data, b"\0" * 4096, ALIGN, 1, 1, K1, None, NODE_COMMITS, 0)


# -- ShmTransport on either path -------------------------------------------------------


def test_read_block_answers_alike_on_either_path(node: Node, path: str) -> None:
    data = _random(3 * ALIGN, 3)
    node.store(ALIGN, data, K1)
    reader = ShmTransport(node.info)
    try:
        out = np.zeros(2 * ALIGN, np.uint8)
        assert reader.read_block(ALIGN, ALIGN, out, K1)
        assert np.array_equal(out, data[ALIGN:])
        assert not reader.read_block(ALIGN, 0, out, K2)
        assert not reader.read_block(ALIGN, 2 * ALIGN, out, K1)  # past the block's end
        assert not reader.read_block(ALIGN + 1, 0, out, K1)
        assert not reader.read_block(-ALIGN, 0, out, K1)
        assert reader.bytes_read == out.size  # the bytes of the hit
        node.idents.publish((PAGES - 1) * ALIGN, 2 * ALIGN, K2)  # a record past the arena
        with pytest.raises(BufferSpecError):
            reader.read_block((PAGES - 1) * ALIGN, ALIGN, out[:ALIGN], K2)
    finally:
        reader.close()
    with pytest.raises(PoolClosedError):
        reader.read_block(ALIGN, 0, np.zeros(ALIGN, np.uint8), K1)


@pytest.mark.parametrize("way", [NUMPY, STREAM])
def test_read_blocks_answers_alike_on_either_path(
    node: Node, path: str, way: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch through ``read_blocks``: one native call for outputs of one size whose
    copy way is settled, else read by read; the same answers, bytes and errors, and
    ``bytes_read`` counts the hits."""
    monkeypatch.setattr(shm, "read_way", lambda n: way)  # settled, whatever was learned
    a, b = _random(2 * ALIGN, 7), _random(ALIGN, 8)
    node.store(ALIGN, a, K1)
    node.store(4 * ALIGN, b, K2)
    reader = ShmTransport(node.info)
    try:
        outs = [np.zeros(ALIGN, np.uint8) for _ in range(4)]
        plan = [
            (ALIGN, outs[0], K1, ALIGN),
            (4 * ALIGN, outs[1], K2, 4 * ALIGN),
            (2 * ALIGN, outs[2], K1, ALIGN),
            (4 * ALIGN, outs[3], K1, 4 * ALIGN),  # another block's key there
        ]
        assert reader.read_blocks(plan) == [True, True, True, False]
        assert np.array_equal(outs[0], a[:ALIGN]) and np.array_equal(outs[1], b)
        assert np.array_equal(outs[2], a[ALIGN:])
        assert reader.bytes_read == 3 * ALIGN
        mixed = [(ALIGN, np.zeros(10, np.uint8), K1, ALIGN), (4 * ALIGN, outs[1], K2, 4 * ALIGN)]
        assert reader.read_blocks(mixed) == [True, True]  # two sizes: read by read
        node.idents.publish((PAGES - 1) * ALIGN, 2 * ALIGN, K2)  # a record past the arena
        past = [(ALIGN, outs[0], K1, ALIGN), (PAGES * ALIGN, outs[1], K2, (PAGES - 1) * ALIGN)]
        with pytest.raises(BufferSpecError):
            reader.read_blocks(past)
    finally:
        reader.close()
    with pytest.raises(PoolClosedError):
        reader.read_blocks(plan)


def test_write_sealed_answers_alike_on_either_path(node: Node, path: str) -> None:
    data = _random(2 * ALIGN, 4)
    writer = ShmTransport(node.info)
    seals = SealRecords(node.seals.path, node.arena.size, create=False)
    try:
        node.seals.clear(2 * ALIGN)
        assert writer.write_sealed(data, 2 * ALIGN, seals, 3, 77, K1, P1)
        assert np.array_equal(node.arena.view[2 * ALIGN : 4 * ALIGN], data)
        assert node.seals.read(2 * ALIGN) == (WriteStamp(3, 77, 2 * ALIGN, data.size, K1, P1), True)
        assert node.seals.rung()
        assert not writer.write_sealed(data, 2 * ALIGN + 64, seals, 3, 78, K2, None)
        # the Python path copies before it finds no record; the native one checks first
        assert writer.bytes_written == data.size * (1 if path == "native" else 2)
        with pytest.raises(BufferSpecError):
            writer.write_sealed(data, (PAGES - 1) * ALIGN, seals, 3, 79, K2, None)
        with pytest.raises(BufferSpecError):
            writer.write_sealed(data, -ALIGN, seals, 3, 79, K2, None)
    finally:
        seals.close()
        writer.close()
    with pytest.raises(PoolClosedError):
        writer.write_sealed(data, 2 * ALIGN, node.seals, 3, 80, K2, None)


def test_a_node_that_does_not_commit_gets_a_plain_seal(path: str) -> None:
    plain = Node(node_commits=False)
    writer = ShmTransport(plain.info)
    try:
        data = np.full(ALIGN, 9, np.uint8)
        assert writer.write_sealed(data, 0, plain.seals, 1, 5, K1, None)
        assert plain.seals.read(0) == (WriteStamp(1, 5, 0, ALIGN, K1, None), False)
        assert not plain.seals.rung()
    finally:
        writer.close()
        plain.close()


def test_closing_while_another_thread_reads_never_unmaps_under_it(node: Node) -> None:
    """A transport closed while another thread's copy runs (the GIL released):
    the mapping stays until that copy ends, so it finishes or the next read
    says the transport is closed; nothing crashes."""
    size = 64 * ALIGN
    data = _random(size, 5)
    node.store(0, data, K1)
    for _ in range(20):
        reader = ShmTransport(node.info)
        out = np.empty(size, np.uint8)
        errors: list[BaseException] = []

        def read_on(
            reader: ShmTransport = reader,
            out: np.ndarray = out,
            errors: list[BaseException] = errors,
        ) -> None:
            try:
                while True:
                    if reader.read_block(0, 0, out, K1):
                        assert np.array_equal(out, data)
            except PoolClosedError:
                return
            except BaseException as exc:  # surfaced below
                errors.append(exc)

        thread = threading.Thread(target=read_on)
        thread.start()
        time.sleep(0.002)
        reader.close()
        thread.join(5)
        assert not thread.is_alive() and not errors


def test_the_extension_can_be_turned_off() -> None:
    code = "from kvpool.transport import shm, shm_copy; print(shm_copy.STATUS, shm.read_checked)"
    env = dict(os.environ, KVPOOL_SHM_COPY="0")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "checked in Python ($KVPOOL_SHM_COPY=0) None"

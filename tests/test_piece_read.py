"""An O_DIRECT read in pieces through native AIO (kvpool.storage.piece_read), and the
SSD tier's reads that hash each piece as it lands: exact bytes, pieces handed over in
order and whole, every refusal or short piece a False (the tier then reads the block
again the plain way), and nothing left in flight whatever interrupts the wait."""

from __future__ import annotations

import ctypes
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest
from poolhelpers import aligned, ssd_tier_holding

from kvpool.storage.aio_abi import IoEvent
from kvpool.storage.piece_read import (
    MAX_PIECES,
    MAX_READERS,
    PIECE_MIN,
    PIECED_MIN,
    PieceReader,
    PieceReaders,
    pieces_of,
)

MiB = 1 << 20


@pytest.fixture(autouse=True)
def _reads_in_pieces(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tiers made here read every large block in pieces, none learning which way
    pays (kvpool.storage.piece_choice; tests/test_piece_choice.py)."""
    monkeypatch.setenv("KVPOOL_SSD_READS", "pieces")


def _reader() -> PieceReader:
    reader = PieceReader.open()
    if reader is None:
        pytest.skip("native AIO is not available here")
    return reader


@contextmanager
def _reading(tmp_path: Any, data: np.ndarray) -> Iterator[tuple[int, PieceReader]]:
    """An O_DIRECT descriptor of a file holding ``data``, and a fresh reader; both
    closed afterwards."""
    path = str(tmp_path / "data.bin")
    with open(path, "wb") as f:
        f.write(data.tobytes())
    reader = _reader()
    try:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        except OSError:
            pytest.skip("no O_DIRECT on this filesystem")
        try:
            yield fd, reader
        finally:
            os.close(fd)
    finally:
        reader.close()


def test_pieces_cover_the_read_in_order_aligned_and_at_most_max_pieces() -> None:
    assert (MiB, MiB, 8) == (PIECED_MIN, PIECE_MIN, MAX_PIECES)
    assert pieces_of(4096) == [(0, 4096)]
    assert pieces_of(MiB - 4096) == [(0, MiB - 4096)]
    assert pieces_of(MiB) == [(0, MiB // 2), (MiB // 2, MiB)]  # two from PIECED_MIN
    assert pieces_of(2 * MiB) == [(0, MiB), (MiB, 2 * MiB)]
    assert pieces_of(4 * MiB) == [(i * MiB, (i + 1) * MiB) for i in range(4)]
    assert pieces_of(16 * MiB) == [(i * 2 * MiB, (i + 1) * 2 * MiB) for i in range(8)]
    assert pieces_of(64 * MiB) == [(i * 8 * MiB, (i + 1) * 8 * MiB) for i in range(8)]
    odd = 3 * MiB + 4096  # thirds rounded up to a page: the last piece is shorter
    step = MiB + 4096
    assert pieces_of(odd) == [(0, step), (step, 2 * step), (2 * step, odd)]


def test_a_pieced_read_lands_exact_and_hands_each_piece_over_once_in_order(
    tmp_path: Any,
) -> None:
    data = aligned(6 * MiB, 1)
    with _reading(tmp_path, data) as (fd, reader):
        out = aligned(4 * MiB, 0)
        seen: list[tuple[int, int]] = []
        at = [MiB]

        def each(lo: int, hi: int) -> None:  # a piece is whole when handed over
            assert np.array_equal(out[lo:hi], data[at[0] + lo : at[0] + hi])
            seen.append((lo, hi))

        assert reader.read(fd, out, MiB, each)
        assert seen == pieces_of(4 * MiB)
        assert np.array_equal(out, data[MiB : 5 * MiB])
        seen.clear()  # the context serves the next read too
        at[0] = 2 * MiB
        assert reader.read(fd, out, 2 * MiB, each) and seen == pieces_of(4 * MiB)


def test_a_misaligned_buffer_is_refused_with_nothing_handed_over(tmp_path: Any) -> None:
    data = aligned(4 * MiB, 2)
    with _reading(tmp_path, data) as (fd, reader):
        out = aligned(4 * MiB + 4096, 0)[1 : 1 + 4 * MiB]
        seen: list[tuple[int, int]] = []
        assert not reader.read(fd, out, 0, lambda lo, hi: seen.append((lo, hi)))
        assert seen == []
        good = aligned(4 * MiB, 0)  # nothing stayed in flight: the next read works
        assert reader.read(fd, good, 0, lambda lo, hi: None)
        assert np.array_equal(good, data)


def test_a_short_piece_stops_the_hand_over_and_answers_false(tmp_path: Any) -> None:
    data = aligned(3 * MiB, 3)  # the last piece of a 4 MiB read runs past the end
    with _reading(tmp_path, data) as (fd, reader):
        seen: list[tuple[int, int]] = []
        out = aligned(4 * MiB, 0)
        assert not reader.read(fd, out, 0, lambda lo, hi: seen.append((lo, hi)))
        pieces = pieces_of(4 * MiB)
        assert len(pieces) == 4 and seen == pieces[: len(seen)]  # in order, whole ones
        assert len(seen) < 4  # never the short one


def test_an_exception_from_each_is_raised_once_every_piece_landed(tmp_path: Any) -> None:
    data = aligned(4 * MiB, 4)
    with _reading(tmp_path, data) as (fd, reader):
        calls: list[int] = []

        def each(lo: int, hi: int) -> None:
            calls.append(lo)
            raise ValueError("hash failed")

        out = aligned(4 * MiB, 0)
        with pytest.raises(ValueError, match="hash failed"):
            reader.read(fd, out, 0, each)
        assert calls == [0]  # the hand-over stopped at the failure
        assert np.array_equal(out, data)  # and returned only once every piece landed
        assert reader.read(fd, out, 0, lambda lo, hi: None)  # nothing left in flight


class _InterruptedWait:
    """The real syscall; the first io_getevents delivers its completions and then a
    signal's exception lands before the caller saw the return value. Counts the
    waits: one too many would block forever on a completion already taken."""

    def __init__(self, reader: PieceReader) -> None:
        self.real, self.getevents = reader._syscall, 0
        self.number = reader._getevents.value

    def __call__(self, number: Any, *args: Any) -> int:
        if number.value != self.number:
            return int(self.real(number, *args))
        self.getevents += 1
        ctx, _, most, events, timeout = args
        got = int(self.real(number, ctx, most, most, events, timeout))  # all of them
        if self.getevents == 1:
            raise KeyboardInterrupt
        return got


def test_a_signal_after_completions_were_taken_loses_none_of_them(tmp_path: Any) -> None:
    data = aligned(4 * MiB, 5)
    with _reading(tmp_path, data) as (fd, reader):
        fake = _InterruptedWait(reader)
        reader._syscall = fake  # type: ignore[assignment]
        seen: list[tuple[int, int]] = []
        out = aligned(4 * MiB, 0)
        with pytest.raises(KeyboardInterrupt):
            reader.read(fd, out, 0, lambda lo, hi: seen.append((lo, hi)))
        assert fake.getevents == 1  # every completion counted from what the kernel wrote
        assert np.array_equal(out, data)
        assert seen == []  # nothing handed over once a signal's exception is pending


def test_a_reader_refuses_after_close_and_in_a_forked_child(tmp_path: Any) -> None:
    data = aligned(2 * MiB, 6)
    with _reading(tmp_path, data) as (fd, reader):
        out = aligned(2 * MiB, 0)
        pid = os.fork()
        if pid == 0:  # the child must not use its parent's context
            os._exit(0 if not reader.read(fd, out, 0, lambda lo, hi: None) else 1)
        _, status = os.waitpid(pid, 0)
        assert os.WEXITSTATUS(status) == 0
        reader.close()
        reader.close()  # idempotent
        assert not reader.read(fd, out, 0, lambda lo, hi: None)


def test_readers_lend_at_most_max_readers_and_reuse_returned_ones(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    opened: list[PieceReader] = []
    real_open = PieceReader.open.__func__  # type: ignore[attr-defined]

    def counting_open(cls: type[PieceReader]) -> PieceReader | None:
        reader = real_open(cls)
        if reader is not None:
            opened.append(reader)
        return reader

    monkeypatch.setattr(PieceReader, "open", classmethod(counting_open))
    readers = PieceReaders()
    lent = [readers._borrow() for _ in range(MAX_READERS + 1)]
    if lent[0] is None:
        pytest.skip("native AIO is not available here")
    assert all(r is not None for r in lent[:MAX_READERS]) and lent[-1] is None
    for r in lent[:MAX_READERS]:
        assert r is not None
        readers._give_back(r)
    assert readers._borrow() is lent[MAX_READERS - 1]  # reused, none opened
    assert len(opened) == MAX_READERS
    readers.close()
    assert all(not r._ctx.value for r in opened[:-1])  # idle ones destroyed at close
    readers._give_back(lent[MAX_READERS - 1])  # type: ignore[arg-type]
    assert not opened[-1]._ctx.value  # the lent one, once returned after close


def test_without_native_aio_readers_answer_false_and_open_no_more(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[int] = []

    def no_aio(cls: type[PieceReader]) -> None:
        calls.append(1)

    monkeypatch.setattr(PieceReader, "open", classmethod(no_aio))
    readers = PieceReaders()
    out = aligned(2 * MiB, 0)
    assert not readers.read(-1, out, 0, lambda lo, hi: None)
    assert not readers.read(-1, out, 0, lambda lo, hi: None)
    assert calls == [1]  # asked the kernel once


# -- the SSD tier's verified reads --------------------------------------------------


def test_large_tier_reads_go_in_pieces_and_read_back_exact(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    reads: list[int] = []
    real_read = PieceReader.read

    def counting(self: PieceReader, fd: int, out: np.ndarray, offset: int, each: Any) -> bool:
        reads.append(out.nbytes)
        return real_read(self, fd, out, offset, each)

    monkeypatch.setattr(PieceReader, "read", counting)
    sizes = [PIECED_MIN - 4096, PIECED_MIN, 5 * MiB + 7, 16 * MiB]
    tier, records, blocks = ssd_tier_holding(str(tmp_path / "tier"), sizes)
    try:
        for record, block in zip(records, blocks, strict=True):
            out = aligned(-(-block.nbytes // 4096) * 4096, 0)
            assert tier.read_into(record, out)
            assert np.array_equal(out[: block.nbytes], block)
        if PieceReader.open() is None:
            pytest.skip("native AIO is not available here: every read was synchronous")
        assert reads == [PIECED_MIN, 5 * MiB + 4096, 16 * MiB]  # from PIECED_MIN up
    finally:
        tier.close()


def test_a_corrupt_large_block_reads_as_a_miss_through_the_pieces(tmp_path: Any) -> None:
    tier, records, _ = ssd_tier_holding(str(tmp_path / "tier"), [8 * MiB])
    try:
        with open(tmp_path / "tier" / "data.bin", "r+b") as f:  # flip a byte, second half
            f.seek(records[0].offset + 6 * MiB)
            byte = f.read(1)
            f.seek(records[0].offset + 6 * MiB)
            f.write(bytes([byte[0] ^ 0xFF]))
        os.sync()
        out = aligned(8 * MiB, 0)
        assert not tier.read_into(records[0], out)
    finally:
        tier.close()


def test_a_refused_pieced_read_is_read_again_the_plain_way(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    halves: list[int] = []

    def refusing(self: PieceReaders, fd: int, out: np.ndarray, offset: int, each: Any) -> bool:
        each(0, out.nbytes // 2)  # a piece handed over, then the read refused
        halves.append(1)
        return False

    monkeypatch.setattr(PieceReaders, "read", refusing)
    tier, records, blocks = ssd_tier_holding(str(tmp_path / "tier"), [4 * MiB])
    try:
        out = aligned(4 * MiB, 0)
        assert tier.read_into(records[0], out) and np.array_equal(out, blocks[0])
        assert halves == [1]
    finally:
        tier.close()


@pytest.mark.parametrize(("start", "length"), [(0, 4 * MiB), (4096, MiB), (MiB, 2 * MiB)])
def test_a_hit_whose_pieced_read_was_refused_is_copied_on_again_from_the_plain_read(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, start: int, length: int
) -> None:
    """The first half was handed over (and copied on) before the read was refused:
    the plain read that follows copies the whole range again, from bytes it verified,
    also a range inside that first half."""

    def refusing(self: PieceReaders, fd: int, out: np.ndarray, offset: int, each: Any) -> bool:
        out[:] = 0x5A  # what the refused read left: not the block's bytes
        each(0, out.nbytes // 2)
        return False

    monkeypatch.setattr(PieceReaders, "read", refusing)
    tier, records, blocks = ssd_tier_holding(str(tmp_path / "tier"), [4 * MiB])
    try:
        dst = np.zeros(length, np.uint8)
        assert tier.read_copying(records[0], aligned(4 * MiB, 0), dst, start, length)
        assert np.array_equal(dst, blocks[0][start : start + length])
    finally:
        tier.close()


def test_a_device_error_in_a_piece_is_raised_after_both_landed(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = aligned(4 * MiB, 7)
    with _reading(tmp_path, data) as (fd, reader):
        real = reader._syscall
        getevents = reader._getevents.value

        def failing(number: Any, *args: Any) -> int:
            got = int(real(number, *args))
            if number.value == getevents and got > 0:
                ctypes.cast(args[3], ctypes.POINTER(IoEvent))[0].res = -5  # EIO
            return got

        reader._syscall = failing  # type: ignore[assignment]
        with pytest.raises(OSError) as info:
            reader.read(fd, aligned(4 * MiB, 0), 0, lambda lo, hi: None)
        assert info.value.errno == 5


# -- a pool's SSD hits: copied on to the caller's buffer piece by piece -------------


@pytest.mark.parametrize(
    ("offset", "length"),
    [(0, None), (MiB, 2 * MiB), (3 * MiB, 1 << 16), (5, 4096), (0, 4 * MiB + 7)],
)
def test_a_pool_reads_large_ssd_blocks_exact_through_the_pieces(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, offset: int, length: int | None
) -> None:
    """Whole blocks and ranges in either half or across both: the range is copied on
    to ``out`` as the halves land (the block promoted into DRAM meanwhile)."""
    from kvpool import Namespace, Pool, block_keys

    pieced: list[int] = []
    real_read = PieceReader.read

    def counting(self: PieceReader, fd: int, out: np.ndarray, at: int, each: Any) -> bool:
        done = real_read(self, fd, out, at, each)
        pieced.append(done)
        return done

    monkeypatch.setattr(PieceReader, "read", counting)
    size = 4 * MiB + 7
    blocks = [aligned(size + 1, 40 + i)[:size] for i in range(4)]
    keys = block_keys(np.arange(4), Namespace("pieces"), block_tokens=1)
    with Pool.embedded(dram_bytes=9 * MiB, ssd_path=str(tmp_path), ssd_bytes=64 * MiB) as pool:
        for key, block in zip(keys, blocks, strict=True):
            assert pool.put(key, block)
        assert pool.stats()["tiers"]["ssd"]["blocks"] >= 2  # the first ones went down
        want = size - offset if length is None else length
        out = np.full(want + 3, 0xAB, np.uint8)  # bigger than the range: the rest untouched
        assert pool.get_into(keys[0], out, offset=offset, length=length) == want
        assert np.array_equal(out[:want], blocks[0][offset : offset + want])
        assert (out[want:] == 0xAB).all()
        assert pool.stats()["promotions"] == 1
    if PieceReader.open() is not None:
        assert pieced == [True]

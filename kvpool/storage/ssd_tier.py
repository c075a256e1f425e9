"""SSD tier: block bytes in one preallocated data file, the index in LMDB.

Layout of ``ssd_path``: ``data.bin`` (``ssd_bytes`` reserved up front with
posix_fallocate, so the disk cannot fill up under us later), ``index.lmdb/``
(key -> offset, size, checksum, parent) and ``lock`` (flock: one pool per
directory).

Crash story (what an acknowledged ``store`` guarantees):

- Process crash (kill -9, OOM): every block whose ``store`` returned comes
  back after a restart, byte for byte. Its O_DIRECT write completed before
  the index record committed, and the record commit is a write into LMDB's
  shared file mapping (``writemap``), which lives in the kernel's page cache
  and outlives the process. A ``store`` cut short leaves no record (its bytes
  are unreachable and the extent is free again on restart). A record is
  deleted before its extent can be reused, so the index never names an
  extent that holds another block's bytes.
- Power loss / kernel crash: nothing is fsynced (``sync=False``), so the
  newest records may be lost and a block's bytes may be torn. The xxh3
  checksum stored with each record is verified on every read: such a block
  reads as a miss and is dropped, never as wrong bytes. The SSD tier is a
  cache, not a system of record.

``writemap`` makes a record commit ~1.4 us instead of ~11 us (no write()
of dirty pages per transaction) without changing the process-crash story.

Data moves with O_DIRECT when the buffer is page-aligned (arena slots always
are), bypassing the page cache as a real SSD tier must; other buffers use a
second, buffered descriptor. Filesystems without O_DIRECT (tmpfs) fall back
to buffered I/O. The O_DIRECT write is queued with Linux native AIO
(``kvpool.storage.direct_aio``) and the caller hashes the same bytes and
stages the record while it runs, so neither costs time beside the device
write; the record still commits only after the write completed. That holds
from ``_OVERLAP_BYTES`` up; below, where the writer can wait for small writes
awake (``spins``), a write is queued or synchronous (hash, then write) as
``kvpool.storage.wait_choice`` says (awake unless a recent spin ran out).
Where native AIO is unavailable every write is synchronous. Reads from
``PIECED_MIN`` go in pieces, each hashed (and copied on) as it lands
(``kvpool.storage.piece_read``), or whole, as each size class learned
(``kvpool.storage.piece_choice``); smaller ones are one synchronous ``preadv``.
"""

from __future__ import annotations

import errno
import fcntl
import os
from collections.abc import Callable, Iterator
from typing import Any

import lmdb
import numpy as np
import xxhash

from kvpool.bindings.buffers import Region, copy_region_out
from kvpool.errors import BlockTooLargeError, StorageError
from kvpool.eviction import EvictionPolicy
from kvpool.storage.allocator import ExtentAllocator
from kvpool.storage.direct_aio import SPIN_US, AioLost, DirectWriter
from kvpool.storage.direct_io import finish_direct, pread_full, pwrite_full, try_direct
from kvpool.storage.piece_choice import PieceChoice, way_from_env
from kvpool.storage.piece_read import PIECED_MIN, PieceReaders
from kvpool.storage.ssd_record import SsdRecord, checksum_of
from kvpool.storage.wait_choice import WaitChoice

_DIRECT_ALIGN = 4096
Landed = Callable[[int, int], None]  # (lo, hi): bytes of a block now in the buffer
_INITIAL_MAP_SIZE = 1 << 30
# Where the AIO writer cannot wait awake, the write is queued and hashed meanwhile
# from here up. Below it that overlap did not pay when the wait slept (256 KiB:
# 0.82-0.90x raw O_DIRECT with AIO against 0.90-0.95x synchronous; 64 KiB: 0.73
# against 0.80; issue 17): the sleep's cold wake-up cost more than the hash.
_OVERLAP_BYTES = 512 << 10


class SsdTier:
    """Blocks on disk; methods are called under the pool's lock except ``read_into``."""

    name = "ssd"

    def __init__(self, path: str, capacity: int, policy: EvictionPolicy) -> None:
        if capacity < _DIRECT_ALIGN:
            raise ValueError(f"ssd_bytes must be at least {_DIRECT_ALIGN}, got {capacity}")
        self.path = path
        self.policy = policy
        self.allocator = ExtentAllocator(capacity, _DIRECT_ALIGN)
        self.capacity = self.allocator.capacity
        self._fd_buffered: int | None = None
        self._fd_direct: int | None = None
        self._aio: DirectWriter | None = None  # opened on the first O_DIRECT write
        self._aio_tried = False
        self._readers = PieceReaders()  # AIO contexts of large reads, opened on use
        self.piece_choice = PieceChoice(way_from_env())  # large reads: pieces or whole
        self.wait_choice = WaitChoice()  # how small writes are waited for
        self._lock_fd: int | None = self._prepare_directory()
        try:
            self._fd_buffered, self._fd_direct = self._open_data_file()
            self._env = self._open_index()
        except BaseException:
            self._close_files()
            raise

    # -- public API -------------------------------------------------------

    def load_records(self) -> Iterator[tuple[bytes, SsdRecord]]:
        """Committed records from a previous run; reserves their extents.

        Records that overlap or fall outside the data file are deleted.
        """
        bad: list[bytes] = []
        with self._env.begin() as txn:
            for key, raw in txn.cursor():
                record = SsdRecord.decode(raw)
                try:
                    self.allocator.reserve(record.offset, record.size)
                except ValueError:
                    bad.append(bytes(key))
                    continue
                yield bytes(key), record
        if bad:
            with self._env.begin(write=True) as txn:
                for key in bad:
                    txn.delete(key)

    def fits(self, size: int) -> bool:
        return self.allocator.round_up(size) <= self.capacity

    def store(
        self, key: bytes, data: np.ndarray, size: int, parent: bytes | None
    ) -> SsdRecord | None:
        """Write ``data[:size]`` and commit its record; None when no extent is free.

        ``data`` may run past ``size`` (an arena slot owns its whole rounded
        extent): then the write can go out with O_DIRECT in one aligned piece.
        """
        offset = self.allocator.allocate(size)
        if offset is None:
            if not self.fits(size):
                raise BlockTooLargeError(
                    f"block of {size} bytes exceeds SSD tier of {self.capacity}"
                )
            return None
        try:
            return self._write_and_commit(key, data, size, offset, parent)
        except AioLost:
            raise  # the write may still land: the extent stays used, never reused
        except BaseException:
            self.allocator.free(offset)
            raise

    def read_into(self, record: SsdRecord, out: np.ndarray, landed: Landed | None = None) -> bool:
        """Read the block into ``out[:size]``; False if its checksum does not match.

        With O_DIRECT, from ``PIECED_MIN`` up, the read goes in pieces, each hashed
        as it lands (``kvpool.storage.piece_read``), or as one read, as the size's
        class settled (``kvpool.storage.piece_choice``); any piece the kernel refuses
        or cuts short sends the whole block down the plain path again.
        ``landed(lo, hi)``: bytes [lo, hi) of ``out`` are in, in order (pieces:
        unverified until this returns True; the plain path: once verified, 0 to
        size, also after pieces that stopped short)."""
        rounded = self.allocator.round_up(record.size)
        fd = self._fd_direct if out.nbytes >= rounded else None
        if fd is None:
            return self._read_plain(None, record, out, landed)
        whole = out[:rounded]
        if rounded < PIECED_MIN:
            return self._read_plain(fd, record, whole, landed)
        return self.piece_choice.run(
            rounded, lambda pieced: self._read_direct(fd, record, whole, landed, pieced)
        )

    def read_copying(
        self, record: SsdRecord, staging: np.ndarray, dst: Region, start: int, length: int
    ) -> bool:
        """``read_into(record, staging)``, and bytes [start, start+length) copied on
        to ``dst``: piece by piece as they land (while the rest still reads), else
        all at once after the read. On False ``dst`` holds no meaningful bytes."""
        end = start + length
        through = start  # dst holds the block's bytes [start, through)

        def copy_on(lo: int, hi: int) -> None:
            nonlocal through
            if lo == 0:  # the first piece, or the whole block read again
                through = start
            if lo <= through < hi and through < end:
                upto = min(hi, end)
                copy_region_out(dst[through - start : upto - start], staging[through:upto])
                through = upto

        return self.read_into(record, staging, copy_on)

    def write_wait(self) -> dict[str, Any]:
        """How O_DIRECT writes are waited for (for ``stats()``): through native AIO
        or not (None: no write yet), the spin budget for small ones (0: they sleep),
        how the spins ended, and where the choice sent small writes (wait_choice)."""
        aio = self._aio
        return {
            "aio": aio is not None if self._aio_tried else None,
            "spin_us": SPIN_US if aio is not None and aio.spins else 0,
            "spin_ready": aio.spin_ready if aio is not None else 0,
            "spin_timeouts": aio.spin_timeouts if aio is not None else 0,
            "awake_writes": self.wait_choice.awake_writes,
            "sync_writes": self.wait_choice.sync_writes,
        }

    def delete(self, key: bytes) -> None:
        """Drop the record (the caller frees the extent once no reader uses it)."""
        with self._env.begin(write=True) as txn:
            txn.delete(key)

    def free(self, offset: int) -> None:
        self.allocator.free(offset)

    def close(self) -> None:
        self._readers.close()
        if self._aio is not None:
            self._aio.close()
            self._aio = None
        self._env.close()
        self._close_files()

    # -- helpers ----------------------------------------------------------

    def _prepare_directory(self) -> int:
        try:
            os.makedirs(self.path, exist_ok=True)
            lock_fd = os.open(os.path.join(self.path, "lock"), os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as exc:
            raise StorageError(
                f"ssd_path {self.path!r} is not a writable directory: {exc}"
            ) from exc
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(lock_fd)
            raise StorageError(f"ssd_path {self.path!r} is in use by another pool") from None
        return lock_fd

    def _buffered(self) -> int:
        if self._fd_buffered is None:
            raise StorageError(f"the SSD tier at {self.path!r} is closed")
        return self._fd_buffered

    def _close_files(self) -> None:
        for fd in (self._fd_buffered, self._fd_direct, self._lock_fd):
            if fd is not None:
                os.close(fd)
        self._fd_buffered = self._fd_direct = self._lock_fd = None

    def _open_index(self) -> lmdb.Environment:
        try:
            return lmdb.open(
                os.path.join(self.path, "index.lmdb"),
                map_size=_INITIAL_MAP_SIZE,
                sync=False,  # see the crash story in the module docstring
                metasync=False,
                writemap=True,
            )
        except lmdb.Error as exc:
            raise StorageError(f"cannot open the SSD index at {self.path!r}: {exc}") from exc

    def _open_data_file(self) -> tuple[int, int | None]:
        data_path = os.path.join(self.path, "data.bin")
        try:
            fd = os.open(data_path, os.O_RDWR | os.O_CREAT, 0o600)
            if os.fstat(fd).st_size < self.capacity:
                os.posix_fallocate(fd, 0, self.capacity)
        except OSError as exc:
            if exc.errno == errno.ENOSPC:
                raise StorageError(
                    f"not enough free disk at {self.path!r} for ssd_bytes={self.capacity}"
                ) from exc
            raise StorageError(f"cannot prepare {data_path!r}: {exc}") from exc
        try:
            direct = os.open(data_path, os.O_RDWR | os.O_DIRECT)
        except OSError:
            direct = None  # e.g. tmpfs before Linux 6.6: buffered I/O only
        return fd, direct

    def _read_direct(
        self, fd: int, record: SsdRecord, whole: np.ndarray, landed: Landed | None, pieced: bool
    ) -> bool:
        """``read_into`` through O_DIRECT of the rounded extent into ``whole``."""
        if pieced:
            size, hasher, data = record.size, xxhash.xxh3_64(), whole.data

            def each(lo: int, hi: int) -> None:
                if lo < size:
                    hasher.update(data[lo : min(hi, size)])
                    if landed is not None:
                        landed(lo, min(hi, size))

            if self._readers.read(fd, whole, record.offset, each):
                return hasher.intdigest() == record.checksum
        return self._read_plain(fd, record, whole, landed)

    def _read_plain(
        self, fd: int | None, record: SsdRecord, out: np.ndarray, landed: Landed | None
    ) -> bool:
        """One synchronous read: with ``fd``, O_DIRECT of the rounded extent ``out``
        where the kernel takes the buffer; else buffered into ``out[:size]``."""
        size = record.size
        target = out[:size]
        if fd is None or not try_direct(pread_full, fd, out, record.offset):
            pread_full(self._buffered(), target, record.offset)
        valid = checksum_of(target) == record.checksum
        if valid and landed is not None:
            landed(0, size)
        return valid

    def _write_and_commit(
        self, key: bytes, data: np.ndarray, size: int, offset: int, parent: bytes | None
    ) -> SsdRecord:
        """Write the bytes, then commit the record that names them.

        The record is staged (an open write transaction holding it) before or
        while the bytes go out, so that all the CPU work runs while the CPU is
        warm and only the transaction's commit (~2 us) follows the device
        write. LMDB is copy-on-write: a staged, uncommitted record is invisible
        to every later reader, including a restart after a crash.
        """
        rounded = self.allocator.round_up(size)
        fd = self._fd_direct if data.nbytes >= rounded else None  # O_DIRECT if possible
        whole = data if data.nbytes == rounded else data[:rounded]  # what O_DIRECT moves
        body = whole if size == rounded else data[:size]  # what the record describes
        aio = self._writer() if fd is not None else None
        if size < _OVERLAP_BYTES and aio is not None and aio.spins:  # small: see wait_choice
            queue = self.wait_choice.awake(aio.spin_timeouts)
        else:
            queue = size >= _OVERLAP_BYTES
        try:
            if queue and aio is not None and fd is not None and aio.submit(fd, whole, offset):
                txn = None
                try:  # hash and stage while the write runs
                    record = SsdRecord(offset, size, checksum_of(body), parent)
                    txn = self._stage(key, record)
                finally:
                    try:  # never return (or raise) while the write still runs
                        moved = finish_direct(aio, fd, whole, offset)
                        if not moved:
                            pwrite_full(self._buffered(), body, offset)
                    except BaseException:
                        if txn is not None:
                            txn.abort()
                        raise
            else:
                record = SsdRecord(offset, size, checksum_of(body), parent)
                txn = self._stage(key, record)
                try:
                    moved = fd is not None and try_direct(pwrite_full, fd, whole, offset)
                    if not moved:
                        pwrite_full(self._buffered(), body, offset)
                except BaseException:
                    txn.abort()
                    raise
        except AioLost:
            raise  # a StorageError already; store() must not free the extent
        except OSError as exc:
            raise StorageError(f"SSD write failed at {self.path!r}: {exc}") from exc
        self._commit(txn, key, record)
        return record

    def _writer(self) -> DirectWriter | None:
        """The tier's AIO context, opened on first use (None where unavailable)."""
        if not self._aio_tried:
            self._aio_tried = True
            self._aio = DirectWriter.open()
        return self._aio

    def _commit(self, txn: lmdb.Transaction, key: bytes, record: SsdRecord) -> None:
        """Commit a staged record; a map that fills up at commit (the commit adds
        pages too) grows and the record is staged and committed again."""
        while True:
            try:
                txn.commit()
                return
            except lmdb.MapFullError:
                txn.abort()  # a failed commit already freed it; abort is a no-op then
                self._env.set_mapsize(self._env.info()["map_size"] * 2)
                txn = self._stage(key, record)
            except lmdb.Error as exc:
                raise StorageError(f"SSD index write failed at {self.path!r}: {exc}") from exc

    def _stage(self, key: bytes, record: SsdRecord) -> lmdb.Transaction:
        """An open write transaction holding ``key -> record``; the map grows if full."""
        while True:
            txn = self._env.begin(write=True)
            try:
                txn.put(key, record.encode())
                return txn
            except lmdb.MapFullError:
                txn.abort()
                self._env.set_mapsize(self._env.info()["map_size"] * 2)
            except lmdb.Error as exc:
                txn.abort()
                raise StorageError(f"SSD index write failed at {self.path!r}: {exc}") from exc
            except BaseException:
                txn.abort()
                raise

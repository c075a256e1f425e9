"""SSD tier: block bytes in one preallocated data file, the index in LMDB.

Layout of ``ssd_path``: ``data.bin`` (``ssd_bytes`` reserved up front with
posix_fallocate, so the disk cannot fill up under us later), ``index.lmdb/``
(key -> offset, size, checksum, parent) and ``lock`` (flock: one pool per
directory).

Crash safety: a block's bytes are written completely before its index record
commits, and a record is deleted before its extent can be reused. So after a
kill -9 the index names only fully written blocks; the xxh3 checksum stored
with each record is verified on every read and catches anything else (torn
writes after a power loss, bit rot): such a block reads as a miss and is
dropped.

Data moves with O_DIRECT when the buffer is page-aligned (arena slots always
are), bypassing the page cache as a real SSD tier must; other buffers use a
second, buffered descriptor. Filesystems without O_DIRECT (tmpfs) fall back
to buffered I/O.
"""

from __future__ import annotations

import errno
import fcntl
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass

import lmdb
import numpy as np
import xxhash

from kvpool.errors import BlockTooLargeError, StorageError
from kvpool.eviction import EvictionPolicy
from kvpool.storage.allocator import ExtentAllocator

_RECORD = struct.Struct("<QQQ")  # offset, size, checksum; optional 16-byte parent follows
_DIRECT_ALIGN = 4096
_INITIAL_MAP_SIZE = 1 << 30


@dataclass(frozen=True)
class SsdRecord:
    """Where a block lives in the data file and what its bytes hash to."""

    offset: int
    size: int
    checksum: int
    parent: bytes | None = None

    def encode(self) -> bytes:
        return _RECORD.pack(self.offset, self.size, self.checksum) + (self.parent or b"")

    @classmethod
    def decode(cls, raw: bytes) -> SsdRecord:
        offset, size, checksum = _RECORD.unpack_from(raw)
        parent = bytes(raw[_RECORD.size :]) or None
        return cls(offset, size, checksum, parent)


def checksum_of(data: np.ndarray) -> int:
    return xxhash.xxh3_64_intdigest(data.data)


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
        if not self.fits(size):
            raise BlockTooLargeError(f"block of {size} bytes exceeds SSD tier of {self.capacity}")
        offset = self.allocator.allocate(size)
        if offset is None:
            return None
        record = SsdRecord(offset, size, checksum_of(data[:size]), parent)
        try:
            self._write(data, size, offset)
            self._commit(key, record)
        except BaseException:
            self.allocator.free(offset)
            raise
        return record

    def read_into(self, record: SsdRecord, out: np.ndarray) -> bool:
        """Read the block into ``out[:size]``; False if its checksum does not match."""
        target = out[: record.size]
        rounded = self.allocator.round_up(record.size)
        if _aligned(out) and out.nbytes >= rounded and self._fd_direct is not None:
            _pread_full(self._fd_direct, out[:rounded], record.offset)
        else:
            _pread_full(self._buffered(), target, record.offset)
        return checksum_of(target) == record.checksum

    def delete(self, key: bytes) -> None:
        """Drop the record (the caller frees the extent once no reader uses it)."""
        with self._env.begin(write=True) as txn:
            txn.delete(key)

    def free(self, offset: int) -> None:
        self.allocator.free(offset)

    def close(self) -> None:
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
                sync=False,  # a crash may lose the newest records, never corrupt older ones
                metasync=False,
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

    def _write(self, data: np.ndarray, size: int, offset: int) -> None:
        rounded = self.allocator.round_up(size)
        try:
            if self._fd_direct is not None and _aligned(data) and data.nbytes >= rounded:
                _pwrite_full(self._fd_direct, data[:rounded], offset)
            else:
                _pwrite_full(self._buffered(), data[:size], offset)
        except OSError as exc:
            raise StorageError(f"SSD write failed at {self.path!r}: {exc}") from exc

    def _commit(self, key: bytes, record: SsdRecord) -> None:
        while True:
            try:
                with self._env.begin(write=True) as txn:
                    txn.put(key, record.encode())
                return
            except lmdb.MapFullError:
                self._env.set_mapsize(self._env.info()["map_size"] * 2)
            except lmdb.Error as exc:
                raise StorageError(f"SSD index write failed at {self.path!r}: {exc}") from exc


def _aligned(array: np.ndarray) -> bool:
    return array.ctypes.data % _DIRECT_ALIGN == 0


def _pwrite_full(fd: int, data: np.ndarray, offset: int) -> None:
    view = data.data.cast("B")
    while view:
        written = os.pwrite(fd, view, offset)
        view, offset = view[written:], offset + written


def _pread_full(fd: int, out: np.ndarray, offset: int) -> None:
    view = out.data.cast("B")
    while view:
        got = os.preadv(fd, [view], offset)
        if got == 0:
            raise StorageError(f"unexpected end of SSD data file at offset {offset}")
        view, offset = view[got:], offset + got

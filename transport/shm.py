"""Same-host data path: map the node's shared-memory arena and copy once.

The node's DRAM arena is a file under /dev/shm (``RegionInfo.shm_name``).
A client on the same host (``host_identity()`` equal) maps it read-write with
``mmap`` and moves bytes with one copy (for host buffers ``copy_into``:
streaming stores for large blocks, kvpool.bindings.stream_copy; torch
``copy_`` for CUDA buffers): no socket, no server thread.

CUDA: the first copy between the mapping and a GPU buffer registers the
whole mapping with CUDA (``cudaHostRegister``, ``kvpool.storage.page_lock``),
so that copy and every later one is a DMA transfer instead of a staged
pageable copy. It is lazy so that a client moving only host buffers never
creates a CUDA context; ``page_lock_status`` (in ``PeerTransports.stats()``)
reports the outcome, or that no GPU copy has happened yet.

Checked reads (``read_block``): the node publishes each block's identity
beside the arena (kvpool.transport.shm_ident); a read names its block (key,
block offset) and copies only while the record names that block, checking
it again after the copy: a reader with an outdated lease (the range now
holds another block, or is being rewritten) gets ``False`` (a miss), never
another block's bytes. A node without identity records (an older release)
is read unchecked (``checked`` is False). A checked read of a plain host
buffer, and a put's copy with its seal record (``write_sealed``), run as one
native call each (kvpool.transport.shm_copy) once their size's copy way is
settled; the Python path answers alike.

Invariants: the mapping is exactly ``RegionInfo.size`` bytes (a file of
another size is refused, so a stale or foreign file is never used); every
range is checked against it before copying; ``close`` unregisters the
mapping from CUDA and drops our views before unmapping.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
from typing import Any

import numpy as np

from kvpool.bindings.buffers import (
    as_region,
    copy_region,
    copy_region_out,
    plain_host,
    region_is_device,
    region_nbytes,
)
from kvpool.bindings.copy_choice import LEARN
from kvpool.bindings.stream_copy import copy_into, copy_out, put_way, read_way
from kvpool.errors import PoolClosedError, TransportUnavailableError
from kvpool.storage.page_lock import PageLock, page_lock
from kvpool.transport.base import RegionInfo, Transport, check_range, host_identity
from kvpool.transport.fencing import WriteStamp
from kvpool.transport.shm_copy import read_checked, read_checked_many, write_sealed
from kvpool.transport.shm_ident import BlockIdents, ident_name
from kvpool.transport.shm_seal import SealRecords

SHM_DIR = "/dev/shm"


def shm_path(name: str) -> str:
    if not name or "/" in name or name in (".", ".."):
        raise TransportUnavailableError(f"bad shared-memory name {name!r}")
    return os.path.join(SHM_DIR, name)


def shm_reachable(info: RegionInfo) -> bool:
    """True when ``info``'s arena can be mapped from this process."""
    if not info.shm_name or info.host_id != host_identity():
        return False
    try:
        return os.stat(shm_path(info.shm_name)).st_size == info.size
    except (OSError, TransportUnavailableError):
        return False


class ShmTransport(Transport):
    name = "shm"

    def __init__(self, info: RegionInfo, cancel: threading.Event | None = None) -> None:
        """``cancel``: once set, the populate of the mapping stops (the transport still
        works, its untouched pages fault in on first use; ``PeerTransports.close``
        sets it so that a close does not wait for a build's whole populate)."""
        super().__init__(info)
        path = shm_path(info.shm_name)
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError as exc:
            raise TransportUnavailableError(f"cannot open {path}: {exc}") from exc
        try:
            size = os.fstat(fd).st_size
            if size != info.size:
                raise TransportUnavailableError(
                    f"{path} is {size} B, node {info.node_id} advertises {info.size} B"
                )
            self._mmap: mmap.mmap | None = mmap.mmap(fd, size) if size else None
        finally:
            os.close(fd)
        if self._mmap is not None:
            _populate(self._mmap, size, cancel)
        self._arena: np.ndarray | None = (
            np.frombuffer(self._mmap, dtype=np.uint8)
            if self._mmap is not None
            else np.empty(0, np.uint8)
        )
        self._lock = threading.Lock()
        self._page_lock: PageLock | None = None  # set by the first GPU copy
        self._idents: BlockIdents | None = None
        with contextlib.suppress(OSError, ValueError):  # absent: a node that publishes none
            self._idents = BlockIdents(shm_path(ident_name(info.shm_name)), info.size, create=False)

    @property
    def checked(self) -> bool:
        """Whether reads verify their block (the node publishes identities)."""
        return self._idents is not None

    def read_block(self, block_offset: int, start: int, out: Any, key: bytes) -> bool:
        """Bytes [start, start + len(out)) of block ``key`` at ``block_offset`` into
        ``out``; False (``out`` holds no meaningful bytes) if the range does not hold
        that block, whole, for the whole copy."""
        idents = self._idents
        if idents is None:
            self.read_into(block_offset + start, out)
            return True
        try:
            if plain_host(out, writable=True):  # fast path, as in read_into
                length = out.nbytes
                way, records, arena = read_way(length), idents.mapping, self._mmap
                if (  # one native call (kvpool.transport.shm_copy) once the way is settled
                    read_checked is not None
                    and way != LEARN
                    and records is not None
                    and arena is not None
                ):
                    got = read_checked(out, arena, records, block_offset, start, key, way)
                    if got == 1:
                        self.bytes_read += length
                        return True
                    if got < 0:
                        self._span(block_offset + start, length)  # raises the usual error
                    return False
                seq = idents.check_then(key, block_offset, start, length)
                if seq < 0:
                    return False
                copy_out(out, self._span(block_offset + start, length))
                self.bytes_read += length
                return idents.still(block_offset, seq)
            seq = idents.check_then(key, block_offset, start, region_nbytes(as_region(out)))
            if seq < 0:
                return False
            self.read_into(block_offset + start, out)
            return idents.still(block_offset, seq)
        except ValueError as exc:  # a mapping unmapped under us: closed meanwhile?
            self._raise_if_closed(exc)
            raise

    def read_blocks(self, plan: list[tuple[int, Any, bytes, int]]) -> list[bool]:
        """``read_block`` for each (offset, out, key, block offset), as TCP's
        ``read_blocks`` takes them: a batch in one native call where it can be
        (``_read_native``), else read by read."""
        found = self._read_native(plan) if len(plan) > 1 else None
        if found is not None:
            return found
        return [self.read_block(b, offset - b, out, key) for offset, out, key, b in plan]

    def _read_native(self, plan: list[tuple[int, Any, bytes, int]]) -> list[bool] | None:
        """A batch of outputs of one size, writable contiguous host memory, whose copy
        way is settled, in one native call (no Python per read: a cached batch of 256 x
        64 B, 1.0 -> 0.6 us per block, session 41); None, nothing copied, for any other."""
        many, idents, arena, first = read_checked_many, self._idents, self._mmap, plan[0][1]
        if many is None or idents is None or arena is None or type(first) is not np.ndarray:
            return None
        length = first.nbytes
        way, records = read_way(length), idents.mapping
        if way == LEARN or records is None:
            return None
        try:
            got = many(plan, arena, records, length, way)
        except ValueError as exc:  # a mapping unmapped under us: closed meanwhile?
            self._raise_if_closed(exc)
            raise
        if got is None:
            return None
        if -1 in got:  # outside the arena: the usual error (nothing was copied)
            self._span(plan[got.index(-1)][0], length)
        self.bytes_read += length * got.count(1)
        return [ok == 1 for ok in got]

    def _raise_if_closed(self, exc: ValueError) -> None:
        """``PoolClosedError`` (caused by ``exc``) when a copy out of the mapping failed
        because the transport was closed meanwhile (``close`` clears ``_arena`` first,
        then unmaps); else nothing: the caller re-raises ``exc``."""
        if self._arena is None:
            raise PoolClosedError("shared-memory transport is closed") from exc

    @property
    def page_lock_status(self) -> str:
        lock = self._page_lock
        return "not yet: no GPU buffer copied" if lock is None else lock.status

    def _lock_pages(self) -> None:
        """Register the mapping with CUDA once, before the first GPU copy."""
        with self._lock:
            if self._page_lock is None and self._arena is not None and self._arena.size:
                self._page_lock = page_lock(self._arena.ctypes.data, self._arena.size)

    def write_sealed(
        self,
        data: np.ndarray,
        offset: int,
        seals: SealRecords,
        epoch: int,
        alloc_id: int,
        key: bytes,
        parent: bytes | None,
    ) -> bool:
        """A same-host put of a whole block: ``write(offset, data)`` (``data`` a plain
        host array, ``buffers.plain_host``), then its record in ``seals`` asking the
        node to commit it when the node does (``seals.node_commits``), as
        ``seals.write`` does. False: ``offset`` has no record (the copy may not have
        happened either). In one native call once the copy way of its size is
        settled (kvpool.transport.shm_copy)."""
        size = data.nbytes
        way, records, arena = put_way(size), seals.mapping, self._mmap  # None once closed
        if write_sealed is None or way == LEARN or records is None or arena is None:
            self.write(offset, data)
            stamp = WriteStamp(epoch, alloc_id, offset, size, key, parent)
            return seals.write(stamp, node_commits=True)
        mark = seals.commit_mark
        got = write_sealed(arena, data, records, offset, epoch, alloc_id, key, parent, mark, way)
        if got == 1:
            self.bytes_written += size
            return True
        if got < 0:
            self._span(offset, size)  # raises the usual error
        return False

    def _span(self, offset: int, length: int) -> np.ndarray:
        arena = self._arena
        if arena is None:
            raise PoolClosedError("shared-memory transport is closed")
        end = offset + length
        if offset < 0 or length < 0 or end > arena.size:  # the arena is info.size bytes
            check_range(offset, length, self.info.size)  # raises the usual error
        return arena[offset:end]

    def read_into(self, offset: int, out: Any) -> None:
        if plain_host(out, writable=True):  # fast path: one copy, nothing else
            copy_out(out, self._span(offset, out.nbytes))
            self.bytes_read += out.nbytes
            return
        dst = as_region(out, writable=True, what="output buffer")
        if region_is_device(dst) and self._page_lock is None:
            self._lock_pages()
        copy_region_out(dst, self._span(offset, region_nbytes(dst)))
        self.bytes_read += region_nbytes(dst)

    def write(self, offset: int, data: Any) -> None:
        if plain_host(data):
            copy_into(self._span(offset, data.nbytes), data)
            self.bytes_written += data.nbytes
            return
        src = as_region(data, what="data")
        if region_is_device(src) and self._page_lock is None:
            self._lock_pages()
        copy_region(self._span(offset, region_nbytes(src)), src)
        self.bytes_written += region_nbytes(src)

    def close(self) -> None:
        with self._lock:
            self._arena = None
            if self._idents is not None:
                self._idents.close()
                self._idents = None
            if self._page_lock is not None:
                self._page_lock.release()  # before unmapping: CUDA must not keep the pages
            if self._mmap is not None:
                # BufferError: a view is still alive somewhere; the GC unmaps it later.
                with contextlib.suppress(BufferError):
                    self._mmap.close()
                self._mmap = None


_MADV_POPULATE_WRITE = 23  # Linux >= 5.14; absent from Python 3.11's mmap module
POPULATE_MAX = 4 << 30  # bigger mappings keep first-touch faults (connect stays quick)
POPULATE_STEP = 64 << 20  # one madvise call: ~5 ms here, what a cancel may wait for


def _populate(region: mmap.mmap, size: int, cancel: threading.Event | None) -> None:
    """Fill this process's page tables for the mapping now, so no put or get pays
    first-touch faults later: 256 per MiB of 4 KiB pages; a fresh 16 MiB range
    copied in 10-22 ms against 1.4-5.5 ms warm (2026-12-01, under load). The node
    pre-faulted the arena's pages, so this allocates no memory besides the page
    tables (2 MiB per GiB mapped); it costs ~0.5 ms per MiB mapped under load,
    once, at connect -- hence only up to ``POPULATE_MAX``. Older kernels: skipped.
    In steps of ``POPULATE_STEP``, until ``cancel`` is set."""
    if size > POPULATE_MAX:
        return
    with contextlib.suppress(OSError, AttributeError):
        region.madvise(mmap.MADV_HUGEPAGE)
    for start in range(0, size, POPULATE_STEP):
        if cancel is not None and cancel.is_set():
            return
        try:
            region.madvise(_MADV_POPULATE_WRITE, start, min(POPULATE_STEP, size - start))
        except OSError:
            return

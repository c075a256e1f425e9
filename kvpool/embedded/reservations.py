"""The embedded pool's write path: reserve -> copy -> commit (or abort).

Writes are two-phase: space is allocated under the table's lock, the bytes
are copied outside it, and the block becomes visible by a commit under the
lock again. ``put`` is the same path without a writer handle (two trips
through the lock around one copy); ``reserve`` hands a writer to the caller,
who fills it piecewise (``kvpool.api.BlockWriter``).

Invariants:
- until commit a key is invisible to every reader and to ``exists``/
  ``prefix_match``, and a second ``reserve``/``put`` of it answers None/False;
- a commit or abort waits for the writer's copies in flight, so no byte lands
  in space that was given back; an aborted or failed copy frees its space;
- nothing is committed once the pool is closed (``PoolClosedError``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvpool.bindings.buffers import Region, copy_region, region_is_device, region_nbytes
from kvpool.bindings.stream_copy import copies_plainly
from kvpool.embedded.blocks import BlockTable
from kvpool.embedded.handles import EmbeddedBlockWriter
from kvpool.errors import KVPoolError, PoolClosedError
from kvpool.storage.memory_tier import MemoryTier

#: Host puts up to this size whose copy is numpy's (``copies_plainly``: every size
#: below 64 KiB; above, where this machine's copies of the size class timed numpy's
#: faster than streaming) copy by memoryview slice assignment inside the one lock
#: section that places and commits them. That copy holds the GIL, so no other thread
#: of the process could run during it anyway: holding the pool's lock as well costs no
#: concurrency, and saves the second lock section, the in-flight bookkeeping and the
#: ndarray slice (embedded 64 KiB put 4.94 -> 4.20 us, issue 17 session 19). The bound keeps
#: such a GIL hold under ~15 us. Larger puts, and those that stream (GIL released),
#: copy outside the lock: ``copy_region`` between two sections.
LOCKED_COPY_MAX = 256 << 10
_NDARRAY = np.ndarray  # a global, not a module attribute load, on the hot path


class Reservations:
    """Blocks reserved in a ``BlockTable`` and not committed yet."""

    def __init__(self, blocks: BlockTable) -> None:
        self._blocks = blocks
        # keys being written: their writer, or None for a plain put's copy
        self._writing: dict[bytes, EmbeddedBlockWriter | None] = {}

    def put(self, key: bytes, src: Region, parent: bytes | None) -> bool:
        """Reserve, copy, commit; False if ``key`` is stored, being written, or not
        admitted by the tier's policy.

        The whole-block fast path, no writer handle: a small host block whose copy
        is numpy's is placed, copied and committed in one lock section
        (``LOCKED_COPY_MAX``); any other takes two sections (reserve, then commit)
        around its copy, the key sitting in ``_writing`` (as None) meanwhile, so a
        concurrent put or reserve of it is refused exactly as for a reserved
        writer, and the copy counting in ``active`` so ``close`` waits for it.
        """
        host = type(src) is _NDARRAY
        size = src.nbytes if host else region_nbytes(src)
        blocks = self._blocks
        mutex = blocks.mutex
        # acquire/release rather than ``with``: ~0.2 us less per lock section
        # (``with`` builds bound __enter__/__exit__ methods on every entry).
        # The common case runs inline (no _place / make_room / copy_ended
        # frames: ~0.1 us each, where a 64 KiB copy is ~3 us); the rules are
        # exactly theirs.
        tier: MemoryTier | None
        mutex.acquire()
        try:
            if host:  # _place for a host block: DRAM
                if blocks.closed:
                    blocks.check_open()  # raises
                if key in blocks.entries or key in self._writing:
                    return False
                tier = blocks.tiers.dram
                if not tier.policy.admit(key):
                    blocks.stats.not_admitted += 1
                    return False
            else:
                tier = self._place(key, region_is_device(src))
                if tier is None:
                    return False
            offset = tier.allocator.allocate(size) if size else None  # room without eviction
            if offset is None:
                offset = blocks.make_room(tier, size)
            if host and size <= LOCKED_COPY_MAX and copies_plainly(size):
                try:
                    tier.host_bytes[offset : offset + size] = src  # type: ignore[index]
                except BaseException:
                    tier.free(offset)
                    raise
                blocks.insert(key, tier, offset, size, parent)
                return True
            self._writing[key] = None
            blocks.active += 1
        finally:
            mutex.release()
        copied = closed = False
        try:
            copy_region(tier.buffer[offset : offset + size], src)  # tier.region, inlined
            copied = True
        finally:
            mutex.acquire()
            try:
                del self._writing[key]
                blocks.active -= 1  # blocks.copy_ended(), inlined
                if blocks.waiting:
                    blocks.lock.notify_all()
                closed = blocks.closed
                if not copied or closed:
                    tier.free(offset)
                else:
                    blocks.insert(key, tier, offset, size, parent)
            finally:
                mutex.release()
        if closed:
            raise PoolClosedError("the pool was closed before this block was committed")
        return True

    def _place(self, key: bytes, device: bool) -> MemoryTier | None:
        """The tier a new block of ``key`` goes to, or None when ``key`` is stored,
        being written or not admitted (caller holds the lock)."""
        blocks = self._blocks
        if blocks.closed:
            blocks.check_open()  # raises
        if key in blocks.entries or key in self._writing:
            return None
        tiers = blocks.tiers
        tier = tiers.gpu if device and tiers.gpu is not None else tiers.dram
        if not tier.policy.admit(key):
            blocks.stats.not_admitted += 1
            return None
        return tier

    def reserve(
        self, key: bytes, size: int, parent: bytes | None, device: bool
    ) -> EmbeddedBlockWriter | None:
        """Space for ``key`` in the GPU tier (``device`` and one exists) or DRAM."""
        blocks = self._blocks
        with blocks.mutex:
            tier = self._place(key, device)
            if tier is None:
                return None
            offset = blocks.make_room(tier, size)
            writer = EmbeddedBlockWriter(
                key, tier, offset, size, parent, write_range=self._write, finish=self._finish
            )
            self._writing[key] = writer
            return writer

    def reserve_batch(
        self,
        keys: Sequence[bytes],
        sizes: Sequence[int],
        parents: Sequence[bytes | None],
        device: bool,
    ) -> list[EmbeddedBlockWriter | None]:
        """``reserve`` of each item; a batch that fails part-way (no room) aborts
        the blocks it reserved before it raises, so it leaves no reservation."""
        writers: list[EmbeddedBlockWriter | None] = []
        try:
            for key, size, parent in zip(keys, sizes, parents, strict=True):
                writers.append(self.reserve(key, size, parent, device))
        except BaseException:
            for writer in writers:
                if writer is not None:
                    self._finish(writer, commit=False)
            raise
        return writers

    def _write(self, writer: EmbeddedBlockWriter, offset: int, src: Region) -> None:
        blocks = self._blocks
        with blocks.mutex:
            blocks.check_open()
            if writer.done:
                raise KVPoolError("this block writer is already committed or aborted")
            writer.copies += 1
            blocks.active += 1
        try:
            copy_region(writer.tier.region(writer.offset + offset, region_nbytes(src)), src)
        finally:
            with blocks.mutex:
                writer.copies -= 1
                blocks.copy_ended()

    def _finish(self, writer: EmbeddedBlockWriter, commit: bool) -> None:
        """Make a reserved block visible (commit) or give its space back (abort)."""
        blocks = self._blocks
        with blocks.mutex:
            blocks.wait_until(lambda: writer.copies == 0)
            if writer.done:
                if commit:
                    raise KVPoolError("this block writer is already committed or aborted")
                return
            writer.done = True
            del self._writing[writer.key]
            if not commit:
                writer.tier.free(writer.offset)
                return
            if blocks.closed:
                raise PoolClosedError("the pool was closed before this block was committed")
            blocks.insert(writer.key, writer.tier, writer.offset, writer.size, writer.parent)

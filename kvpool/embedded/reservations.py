"""The embedded pool's write path: reserve -> copy -> commit (or abort).

Writes are two-phase: space is allocated under the table's lock, the bytes
are copied outside it, and the block becomes visible by a commit under the
lock again. ``put`` is the same path with the writer never leaving this
module (two trips through the lock); ``reserve`` hands the writer to the
caller, who fills it piecewise (``kvpool.api.BlockWriter``).

Invariants:
- until commit a key is invisible to every reader and to ``exists``/
  ``prefix_match``, and a second ``reserve``/``put`` of it answers None/False;
- a commit or abort waits for the writer's copies in flight, so no byte lands
  in space that was given back; an aborted or failed copy frees its space;
- nothing is committed once the pool is closed (``PoolClosedError``).
"""

from __future__ import annotations

from kvpool.bindings.buffers import Region, copy_region, region_is_device, region_nbytes
from kvpool.embedded.blocks import BlockTable
from kvpool.embedded.handles import EmbeddedBlockWriter
from kvpool.errors import KVPoolError, PoolClosedError


class Reservations:
    """Blocks reserved in a ``BlockTable`` and not committed yet."""

    def __init__(self, blocks: BlockTable) -> None:
        self._blocks = blocks
        self._writing: dict[bytes, EmbeddedBlockWriter] = {}

    def put(self, key: bytes, src: Region, parent: bytes | None) -> bool:
        """Reserve (already counted as copying), copy, commit; False if ``key`` is
        stored, being written, or not admitted by the tier's policy."""
        writer = self.reserve(key, region_nbytes(src), parent, region_is_device(src), True)
        if writer is None:
            return False
        copied = False
        try:
            copy_region(writer.tier.region(writer.offset, writer.size), src)
            copied = True
        finally:
            self._finish(writer, commit=copied, copying=True)
        return True

    def reserve(
        self, key: bytes, size: int, parent: bytes | None, device: bool, copying: bool = False
    ) -> EmbeddedBlockWriter | None:
        """Space for ``key`` in the GPU tier (``device`` and one exists) or DRAM.

        ``copying``: the caller copies into it at once (counted as active now)."""
        blocks = self._blocks
        with blocks.lock:
            blocks.check_open()
            tiers = blocks.tiers
            tier = tiers.gpu if device and tiers.gpu is not None else tiers.dram
            if key in blocks.entries or key in self._writing:
                return None
            if not tier.policy.admit(key):
                blocks.stats.not_admitted += 1
                return None
            offset = blocks.make_room(tier, size)
            writer = EmbeddedBlockWriter(
                key, tier, offset, size, parent, write_range=self._write, finish=self._finish
            )
            self._writing[key] = writer
            if copying:
                writer.copies += 1
                blocks.active += 1
            return writer

    def _write(self, writer: EmbeddedBlockWriter, offset: int, src: Region) -> None:
        blocks = self._blocks
        with blocks.lock:
            blocks.check_open()
            if writer.done:
                raise KVPoolError("this block writer is already committed or aborted")
            writer.copies += 1
            blocks.active += 1
        try:
            copy_region(writer.tier.region(writer.offset + offset, region_nbytes(src)), src)
        finally:
            with blocks.lock:
                writer.copies -= 1
                blocks.copy_ended()

    def _finish(self, writer: EmbeddedBlockWriter, commit: bool, copying: bool = False) -> None:
        """Make a reserved block visible (commit) or give its space back (abort).

        ``copying``: the caller's own copy (counted by ``reserve``) just ended.
        """
        blocks = self._blocks
        with blocks.lock:
            if copying:
                writer.copies -= 1
                blocks.copy_ended()
            blocks.lock.wait_for(lambda: writer.copies == 0)
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

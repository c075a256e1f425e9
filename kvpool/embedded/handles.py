"""Handles the embedded pool gives out: a reserved block being written, a lease.

Both derive from the store contract (``kvpool.api.BlockWriter`` / ``Lease``)
and hold no reference to the pool itself: the pool hands them the callbacks
that move bytes, commit and unpin, so this module does not import the pool
(no cycle) and reaches into nothing. The pool's lock guards every field a
callback touches (``copies``, ``done``, the entries' pins).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvpool.api import BlockWriter, Lease
from kvpool.bindings.buffers import Region
from kvpool.embedded.blocks import Entry
from kvpool.storage.memory_tier import MemoryTier


class EmbeddedBlockWriter(BlockWriter):
    """A block reserved in an embedded pool's memory tier, at ``tier``/``offset``.

    ``write_range(writer, offset, src)`` copies into the reservation and
    ``finish(writer, commit)`` commits or aborts it; both are the pool's.
    """

    def __init__(
        self,
        key: bytes,
        tier: MemoryTier,
        offset: int,
        size: int,
        parent: bytes | None,
        *,
        write_range: Callable[[EmbeddedBlockWriter, int, Region], None],
        finish: Callable[[EmbeddedBlockWriter, bool], None],
    ) -> None:
        self.key, self.tier, self.offset, self.size, self.parent = key, tier, offset, size, parent
        self.copies = 0  # copies in flight (under the pool's lock)
        self.done = False
        self._write_range, self._finish = write_range, finish

    def _write(self, offset: int, src: Region) -> None:
        self._write_range(self, offset, src)

    def commit(self) -> None:
        self._finish(self, True)

    def abort(self) -> None:
        self._finish(self, False)


class EmbeddedLease(Lease):
    """Entries pinned by ``Pool.lease``; ``unpin(entries)`` is the pool's."""

    def __init__(
        self,
        keys: Sequence[bytes],
        entries: Sequence[Entry],
        unpin: Callable[[Sequence[Entry]], None],
    ) -> None:
        self.keys = list(keys)
        self._entries = list(entries)
        self._unpin = unpin

    def release(self) -> None:
        entries, self._entries = self._entries, []
        if entries:
            self._unpin(entries)

"""Handles a pool gives out: a reserved block being written, a lease on stored blocks.

Both only call back into their pool; the pool's lock guards all state.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from kvpool.bindings.buffers import Region, as_region, region_nbytes
from kvpool.errors import BufferSpecError

if TYPE_CHECKING:
    from kvpool.embedded.pool import Pool, _Entry
    from kvpool.storage.memory_tier import MemoryTier


class PiecewiseWriter:
    """A reserved block, invisible until ``commit``: fill its bytes in any order.

    Used by ``reserve`` callers that produce a block piecewise (the layer
    writer writes one layer's range at a time). Leaving the ``with`` block
    commits; an exception inside it aborts, so a failed producer never leaves
    a half-written block visible. Subclasses move the bytes and commit.
    """

    size: int

    def write(self, offset: int, data: Any) -> None:
        """Copy ``data`` into bytes [offset, offset + len(data)) of the block."""
        src = as_region(data, what="data")
        end = offset + region_nbytes(src)
        if offset < 0 or end > self.size:
            raise BufferSpecError(f"write of [{offset}, {end}) is outside the block of {self.size}")
        self._write(offset, src)

    def _write(self, offset: int, src: Region) -> None:
        raise NotImplementedError

    def commit(self) -> None:
        raise NotImplementedError

    def abort(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> PiecewiseWriter:
        return self

    def __exit__(self, exc_type: object, *rest: object) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.abort()


class BlockWriter(PiecewiseWriter):
    """A block reserved in an embedded pool's memory tier."""

    def __init__(
        self, pool: Pool, key: bytes, tier: MemoryTier, offset: int, size: int, parent: bytes | None
    ) -> None:
        self._pool = pool
        self.key, self.tier, self.offset, self.size, self.parent = key, tier, offset, size, parent
        self.copies = 0  # copies in flight (under the pool's lock)
        self.done = False

    def _write(self, offset: int, src: Region) -> None:
        self._pool._write_reserved(self, offset, src)

    def commit(self) -> None:
        self._pool._finish(self, commit=True)

    def abort(self) -> None:
        self._pool._finish(self, commit=False)


class Lease:
    """Blocks pinned by ``Pool.lease``: safe to read piecewise until ``release``.

    Releasing twice is harmless; leaving the ``with`` block releases.
    """

    def __init__(self, pool: Pool, pinned: Sequence[tuple[bytes, _Entry]]) -> None:
        self._pool = pool
        self.keys = [key for key, _ in pinned]
        self._entries = [entry for _, entry in pinned]

    def release(self) -> None:
        entries, self._entries = self._entries, []
        if entries:
            self._pool._release(entries)

    def __len__(self) -> int:
        return len(self.keys)

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

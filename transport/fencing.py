"""Write stamps: the (epoch, allocation) identity every data-path write carries.

The master hands out ranges of a node's region; a client then writes bytes
there directly. Timing alone cannot keep a slow writer out of a range the
master has since given to another block (its allocation expired, or a new
master term started), so every write names the allocation it fills with a
``WriteStamp``, and the node checks it under its lock (a ``WriteFence``,
implemented by kvpool.cluster.block_table) before a byte lands:

- stamps are ordered by (epoch, allocation id): both only grow, so a newer
  allocation of a range always compares higher than an older one;
- a node refuses a stamp from another epoch than its master's, and a stamp
  older than one it already saw on an overlapping range (``STALE``);
- a newer stamp waits for older writes still in flight on its range before
  it takes it (``BUSY`` when they do not finish within the fence's bound).

The stamp also carries the block's key and parent: once a node acknowledged
a final (or sealed) write it knows which block the range holds, so a put
acknowledged to its caller survives a master crash (the node re-registers
it).

Reads name their block too (``IDENT``: key, block offset): the node serves
the bytes only if that block still holds the range, and holds it while they
are sent, so a reader with an outdated lease gets a miss, never another
block's bytes (TCP; a same-host reader copies from shared memory unchecked).

Wire form: ``STAMP`` (65 bytes) and ``IDENT`` (24 bytes), used by
kvpool.transport.tcp_wire's stamped and checked-read ops.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable
from typing import Any, NamedTuple, Protocol

#: epoch, allocation id, block offset, block size, key, parent, has-parent flag
STAMP = struct.Struct("!QQQQ16s16sB")
#: what a checked read names: the block's key and its offset in the region
IDENT = struct.Struct("!16sQ")
_NO_PARENT = bytes(16)

FENCE_OK, FENCE_STALE, FENCE_BUSY = 0, 1, 2


class WriteStamp(NamedTuple):
    """Which allocation (of which master term) a write fills, and for which block.
    A named tuple, not a frozen dataclass: every put builds one and its node
    unpacks it, in ~0.3 us against ~0.7 (x2-3 on a cold CPU, after the payload's
    megabyte left the caches; issue 17, session 43)."""

    epoch: int
    alloc_id: int
    offset: int  # the whole block's range in the region: [offset, offset + size)
    size: int
    key: bytes
    parent: bytes | None = None

    @property
    def order(self) -> tuple[int, int]:
        """Newer allocations compare higher (epochs and allocation ids only grow)."""
        return (self.epoch, self.alloc_id)

    def same_allocation(self, other: WriteStamp) -> bool:
        """Both name the same allocation (a claim taken ahead, before the key was
        known, is sealed with the block's key and parent)."""
        return self[:4] == other[:4]

    def covers(self, offset: int, length: int) -> bool:
        return self.offset <= offset and offset + length <= self.offset + self.size

    def pack(self) -> bytes:
        parent = self.parent
        return STAMP.pack(*self[:5], parent or _NO_PARENT, parent is not None)

    @classmethod
    def unpack(cls, raw: bytes | bytearray | memoryview) -> WriteStamp:
        epoch, alloc_id, offset, size, key, parent, has_parent = STAMP.unpack(raw)
        return cls(epoch, alloc_id, offset, size, bytes(key), bytes(parent) if has_parent else None)


class WriteFence(Protocol):
    """What a data server asks before and after it lets a stamped write land.

    ``owner`` identifies the connection: claims it still holds when it goes
    away are released (``owner_gone``), so a dead writer never blocks a range.
    """

    def claim(self, stamp: WriteStamp, owner: object) -> int:
        """FENCE_OK (the range is this stamp's; one write in flight), STALE or BUSY.
        A claim taken ahead (placeholder key) sent again for a range its allocation
        still holds claimed renews its shared-memory seal deadline, and adds no write
        in flight while one is held (kvpool.cluster.sealed_claims)."""
        ...

    def finish(
        self, stamp: WriteStamp, owner: object, *, ok: bool, seal: bool, any_owner: bool = False
    ) -> int:
        """End ``owner``'s write in flight (any connection's with ``any_owner``); with
        ``ok`` and ``seal`` the block is whole. FENCE_OK, or STALE when the range
        was taken meanwhile."""
        ...

    def begin_read(self, key: bytes, block_offset: int, offset: int, length: int) -> Any:
        """Hold block ``key`` at ``block_offset`` for a read of the range, or None
        if the range holds another block now."""
        ...

    def end_read(self, held: Any) -> None: ...

    def begin_reads(self, reads: Iterable[tuple[bytes, int, int, int]]) -> list[Any]:
        """``begin_read`` of each (key, block offset, offset, length) under one lock (a
        pipelined batch): per read, what to hand to ``end_reads``, or None."""
        ...

    def end_reads(self, held: Iterable[Any]) -> None:
        """``end_read`` of each (``begin_reads``' answers, None left out)."""
        ...

    def owner_gone(self, owner: object) -> None:
        """The connection closed: end every write it still had in flight."""
        ...


class CommitDesk(Protocol):
    """Where a data server hands the blocks whose writers asked the node to commit
    them (``OP_WRITE_COMMIT``) and asks how those commits went (``OP_COMMITS``);
    implemented by the node's commit thread (kvpool.cluster.node_commits)."""

    def owe(self, stamp: WriteStamp) -> None:
        """The block ``stamp`` names was just sealed by its final write, whose writer
        asked for the commit: owe it one. Called before the write is acknowledged."""
        ...

    def outcomes(self, ids: list[tuple[int, int]], wait_s: float) -> bytes:
        """One state byte per (allocation id, block offset) (tcp_wire ``COMMITS``); an
        answer given is forgotten. A commit still owed is hurried along, and waited
        for up to ``wait_s`` (the desk bounds it)."""
        ...

"""Seals in shared memory: a same-host put made whole without the node's SEAL round trip.

A same-host writer copies a block into the node's arena under a claim (the
node's write fence, kvpool.cluster.client.fenced); today it then asks the
node to ``SEAL`` the block over TCP, because a put may be acknowledged only
once its node knows the block's key (an acknowledged put outlives a master
crash: the node lists it when it re-registers). This file lets the writer
tell the node through shared memory instead, bounded by a deadline both
processes read from the same clock (CLOCK_MONOTONIC, one per host).

Protocol (``HOLD``/``MARGIN`` are in the file's header, written by the node):

- A claim taken ahead for a grant (placeholder key, kvpool.cluster.client.claims)
  holds until ``D = Tn + hold`` where ``Tn`` is when the node granted it: the
  node does not abort the claim (a new master term) before ``D + margin``
  unless it was sealed or released. The writer read the clock at ``T0 <= Tn``
  before sending the claim and uses ``T0 + hold <= D``: no wire change.
- The node zeroes the record's ``sealed`` word under its table lock before it
  answers the claim. The writer copies the block, writes the record's fields,
  then ``sealed`` last, then reads the clock: only if ``now < T0 + hold - margin``
  is the put acknowledged on the record alone; else it sends the TCP ``SEAL``
  and the node's answer decides (the record is then merely early news).
- The node adopts a record (block WRITTEN with the record's key and parent,
  exactly as a ``SEAL`` would) when ``sealed`` is set and epoch, allocation,
  offset and size name its claimed, not aborted entry. Before it aborts a
  claim at a new term it reads the record; a claim neither sealed nor past
  ``D + margin`` is waited for (at most ``hold + margin``). An aborted entry is
  never adopted later.

Why the bytes are safe without the deadline: an aborted claim's range is not
given to another writer while the claim is held (kvpool.cluster.block_table),
so the deadline only makes the *seal decision* agree on both sides.

Memory ordering: x86-64 TSO. The writer's stores land in order (fields, then
``sealed``); the node loads ``sealed`` first, then the fields. TSO lets the
writer's clock read pass its own ``sealed`` store still in the store buffer;
the buffer drains in far less than ``margin``, so a record the writer counted
as "before D" is visible to a node reading after ``D + margin``. Weakly
ordered CPUs (ARM) would need fences: untested.

Layout (native byte order): a 64-byte header (magic, hold ns, margin ns),
then one ``RECORD`` per ``ALIGN``-byte granule of the arena: sealed u64,
epoch u64, alloc id u64, size u64, has parent u64, key 16 B, parent 16 B.
"""

from __future__ import annotations

import struct
import time
from dataclasses import dataclass

from kvpool.transport.fencing import WriteStamp
from kvpool.transport.shm_side_file import SideFile

ALIGN = 4096
HEADER = struct.Struct("=QQQ")
HEADER_BYTES = 64
RECORD = struct.Struct("=QQQQQ16s16s")
_FIELDS = struct.Struct("=QQQQ16s16s")  # all but ``sealed``
MAGIC = 0x6B7670736C303031  # "kvpsl001"
#: How long a claim taken ahead may be sealed through shared memory (ns).
DEFAULT_HOLD_NS = 500_000_000
#: Slack for store-buffer drain and the node's read after the deadline (ns).
DEFAULT_MARGIN_NS = 10_000_000


def seal_name(arena_name: str) -> str:
    """The seal file's shared-memory name for the arena ``arena_name``."""
    return f"{arena_name}.seal"


def seal_bytes(arena_size: int) -> int:
    return HEADER_BYTES + max(1, -(-arena_size // ALIGN)) * RECORD.size


@dataclass(frozen=True)
class Deadline:
    """When a claim taken ahead stops being sealable in shared memory."""

    hold_ns: int
    margin_ns: int

    def writer_in_time(self, claimed_at_ns: int, now_ns: int) -> bool:
        """The writer's test after writing its record (``claimed_at_ns``: read
        before the claim was sent)."""
        return now_ns < claimed_at_ns + self.hold_ns - self.margin_ns

    def node_may_abort(self, granted_at_ns: int, now_ns: int) -> bool:
        """The node's test before aborting an unsealed claim granted then."""
        return now_ns >= granted_at_ns + self.hold_ns + self.margin_ns


class SealRecords(SideFile):
    """The seal records of one arena, mapped from a /dev/shm file.

    The node creates it (``create=True``; ``close`` unlinks it) and zeroes a
    record when it grants a claim; same-host writers map it read-write and
    write the record of a block they copied.
    """

    def __init__(
        self,
        path: str,
        arena_size: int,
        *,
        create: bool,
        hold_ns: int = DEFAULT_HOLD_NS,
        margin_ns: int = DEFAULT_MARGIN_NS,
    ) -> None:
        size = seal_bytes(arena_size)
        what = f"the seal file of a {arena_size} B arena"
        super().__init__(path, size, create=create, writable=True, what=what)
        assert self._mmap is not None
        if create:
            HEADER.pack_into(self._mmap, 0, MAGIC, hold_ns, margin_ns)
        magic, hold, margin = HEADER.unpack_from(self._mmap, 0)
        if magic != MAGIC:
            self.close()
            raise ValueError(f"{path} has no seal header")
        self.deadline = Deadline(hold, margin)
        self._records = (size - HEADER_BYTES) // RECORD.size

    # -- the node (under its table's lock) ----------------------------------------------

    def clear(self, offset: int) -> None:
        """Before a claim at ``offset`` is granted: no seal recorded there."""
        word = self._word(offset)
        if word is not None and self._words is not None:
            self._words[word] = 0

    def read(self, offset: int) -> WriteStamp | None:
        """The stamp sealed at ``offset`` (None: not sealed)."""
        word = self._word(offset)
        words, mm = self._words, self._mmap
        if word is None or words is None or mm is None or not words[word]:
            return None  # ``sealed`` first: the fields read next are the record's
        epoch, alloc_id, size, has_parent, key, parent = _FIELDS.unpack_from(mm, word * 8 + 8)
        return WriteStamp(epoch, alloc_id, offset, size, key, parent if has_parent else None)

    # -- the writer ---------------------------------------------------------------------

    def write(self, stamp: WriteStamp) -> bool:
        """Record ``stamp``'s block as whole (its bytes are in place); False if
        its offset has no record."""
        word = self._word(stamp.offset)
        words, mm = self._words, self._mmap
        if word is None or words is None or mm is None or len(stamp.key) != 16:
            return False
        parent = stamp.parent or bytes(16)
        _FIELDS.pack_into(
            mm,
            word * 8 + 8,
            stamp.epoch,
            stamp.alloc_id,
            stamp.size,
            1 if stamp.parent is not None else 0,
            stamp.key,
            parent,
        )
        words[word] = 1  # last: the node reads this word before the fields
        return True

    def _word(self, offset: int) -> int | None:
        if offset < 0 or offset % ALIGN:
            return None
        slot = offset // ALIGN
        if slot >= self._records:
            return None
        return (HEADER_BYTES + slot * RECORD.size) // 8


def now_ns() -> int:
    """CLOCK_MONOTONIC in ns: the one clock every process on the host shares."""
    return time.monotonic_ns()

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

Commits by the node (issue 17): a writer may seal with ``NODE_COMMITS``
instead of ``SEALED``, asking the node to send the block's master ``COMMIT``
for it (kvpool.cluster.node_commits), so that a same-host put sends nothing
at all. Only a node whose header has ``FLAG_NODE_COMMITS`` does so. After
sealing, the writer rings the doorbell (a header word the node clears, then
takes its table lock -- a full fence on x86 -- before it reads records, so a
ring is never lost; the node's commit thread sleeps on it as a futex and a ring
wakes it: kvpool.transport.shm_doorbell). The node answers in the record's word:
``VISIBLE`` (committed, or found stored: the key holds a block) or
``NOT_COMMITTED`` (the master knew no such grant: the writer settles it as
a refused pipelined commit). The writer reads that answer only while the
record still names its allocation (``outcome``); a record reused for a
later claim is no answer, and the writer looks the key up instead.

Layout (native byte order): a 128-byte header (magic, hold ns, margin ns,
flags; the doorbell's words at byte 64, their own cache line: doorbell,
sleeping, polled), then one
``RECORD`` per ``ALIGN``-byte granule of the arena: sealed u64, epoch u64,
alloc id u64, size u64, has parent u64, key 16 B, parent 16 B.
"""

from __future__ import annotations

import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvpool.transport import shm_doorbell
from kvpool.transport.fencing import WriteStamp
from kvpool.transport.shm_doorbell import DOORBELL_WORD, POLLED_WORD
from kvpool.transport.shm_side_file import SideFile

ALIGN = 4096
HEADER = struct.Struct("=QQQQ")
HEADER_BYTES = 128
RECORD = struct.Struct("=QQQQQ16s16s")
_FIELDS = struct.Struct("=QQQQ16s16s")  # all but ``sealed``
_EPOCH_WORD, _ALLOC_WORD = 1, 2  # the record's term and alloc id, in words from ``sealed``
MAGIC = 0x6B7670736C303033  # "kvpsl003": the doorbell wakes a sleeping node
FLAG_NODE_COMMITS = 1  # the node commits records sealed with NODE_COMMITS
# The record's ``sealed`` word: written 0 by the node (claim granted), 1 or 2 by
# the writer, then 3 or 4 by the node (only after a 2).
SEALED, NODE_COMMITS, VISIBLE, NOT_COMMITTED = 1, 2, 3, 4
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
        node_commits: bool = False,
    ) -> None:
        size = seal_bytes(arena_size)
        what = f"the seal file of a {arena_size} B arena"
        super().__init__(path, size, create=create, writable=True, what=what)
        assert self._mmap is not None
        if create:
            flags = FLAG_NODE_COMMITS if node_commits else 0
            HEADER.pack_into(self._mmap, 0, MAGIC, hold_ns, margin_ns, flags)
        magic, hold, margin, flags = HEADER.unpack_from(self._mmap, 0)
        if magic != MAGIC:
            self.close()
            raise ValueError(f"{path} has no seal header")
        self.deadline = Deadline(hold, margin)
        #: the node commits the blocks sealed with ``NODE_COMMITS`` (writers may ask)
        self.node_commits = bool(flags & FLAG_NODE_COMMITS)
        #: the ``sealed`` word of a writer that asks the node to commit its block:
        #: ``NODE_COMMITS`` where the node does (and the doorbell is rung), else ``SEALED``
        self.commit_mark = NODE_COMMITS if self.node_commits else SEALED
        words = self._words
        if not create and self.node_commits and not shm_doorbell.AVAILABLE and words is not None:
            words[POLLED_WORD] = 1  # this writer's rings wake no one: the node polls
        self._records = (size - HEADER_BYTES) // RECORD.size
        # Every record's ``sealed`` word, for the node's poll of many records at once.
        self._sealed: np.ndarray | None = np.ndarray(
            (self._records,), np.uint64, self._mmap, HEADER_BYTES, (RECORD.size,)
        )

    def close(self) -> None:
        self._sealed = None  # its export of the mapping first
        super().close()

    # -- the node (under its table's lock) ----------------------------------------------

    def clear(self, offset: int) -> bool:
        """Before a claim at ``offset`` is granted: no seal recorded there (False:
        ``offset`` has no record)."""
        word = self._word(offset)
        if word is None or self._words is None:
            return False
        self._words[word] = 0
        return True

    def read(self, offset: int) -> tuple[WriteStamp, bool] | None:
        """The stamp sealed at ``offset`` and whether its writer asked the node to
        commit it (None: not sealed)."""
        word = self._word(offset)
        words, mm = self._words, self._mmap
        if word is None or words is None or mm is None:
            return None
        sealed = words[word]  # ``sealed`` first: the fields read next are the record's
        if sealed not in (SEALED, NODE_COMMITS):
            return None
        epoch, alloc_id, size, has_parent, key, parent = _FIELDS.unpack_from(mm, word * 8 + 8)
        stamp = WriteStamp(epoch, alloc_id, offset, size, key, parent if has_parent else None)
        return stamp, sealed == NODE_COMMITS

    def sealed_at(self, offsets: Sequence[int]) -> list[int]:
        """Those of ``offsets`` (records the node may adopt) sealed now: one
        vectorised read of their ``sealed`` words."""
        sealed = self._sealed
        if sealed is None or not offsets:
            return []
        words = sealed[np.fromiter(offsets, np.int64, len(offsets)) // ALIGN]
        hits = np.flatnonzero((words == SEALED) | (words == NODE_COMMITS))
        return [offsets[i] for i in hits.tolist()]

    def rung(self) -> int:
        """Who rang since the last call (``shm_doorbell.WRITER`` or ``HURRY``; 0: no one),
        then cleared. The caller must take a lock (a full fence) before it reads records,
        so no ring is lost."""
        words = self._words
        if words is None or not (bell := words[DOORBELL_WORD]):
            return 0
        words[DOORBELL_WORD] = 0
        return int(bell)

    @property
    def rings_wake(self) -> bool:
        """Whether writers' rings wake a ``wait_ring`` (else the node polls: no futex in
        this process, or a writer that cannot ring one attached)."""
        words = self._words
        return shm_doorbell.AVAILABLE and words is not None and not words[POLLED_WORD]

    def wait_ring(self, timeout_s: float) -> None:
        """The node's commit thread sleeps at most ``timeout_s`` until a writer rings or
        a ``hurry`` (at once if a ring is pending: ``shm_doorbell.wait``). Only where
        ``rings_wake``."""
        mapping = self._mmap
        if mapping is not None:
            shm_doorbell.wait(mapping, timeout_s)

    def hurry(self) -> None:
        """Make the waiting commit thread look now (the node's own threads)."""
        mapping = self._mmap
        if shm_doorbell.AVAILABLE and mapping is not None:
            shm_doorbell.ring(mapping, shm_doorbell.HURRY, force=True)

    def answer(self, offset: int, alloc_id: int, epoch: int, state: int) -> None:
        """``VISIBLE`` or ``NOT_COMMITTED`` for the block of allocation ``alloc_id``
        of term ``epoch`` whose writer asked the node to commit it. A record reused
        since is left alone: by another allocation, or by the same allocation id in
        another term (ids are unique within a term; across terms only as likely as
        two random 52-bit bases meeting, so the term is checked too)."""
        word, words = self._word(offset), self._words
        if word is None or words is None:
            return
        if words[word + _ALLOC_WORD] != alloc_id or words[word + _EPOCH_WORD] != epoch:
            return
        if words[word] == NODE_COMMITS:
            words[word] = state

    # -- the writer ---------------------------------------------------------------------

    def write(self, stamp: WriteStamp, node_commits: bool = False) -> bool:
        """Record ``stamp``'s block as whole (its bytes are in place); False if
        its offset has no record. ``node_commits``: ask the node to commit it
        (only if the header says it does), and ring the doorbell."""
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
        mark = self.commit_mark if node_commits else SEALED
        words[word] = mark  # last: the node reads this word before the fields
        if mark == NODE_COMMITS:
            if shm_doorbell.AVAILABLE:
                shm_doorbell.ring(mm)  # and wakes a sleeping node
            else:
                words[DOORBELL_WORD] = shm_doorbell.WRITER
        return True

    def outcome(self, offset: int, alloc_id: int) -> int | None:
        """The ``sealed`` word of the record at ``offset`` while it still names
        allocation ``alloc_id`` (None: reused for another claim, or no record)."""
        word, words = self._word(offset), self._words
        if word is None or words is None:
            return None
        state = words[word]
        return state if words[word + _ALLOC_WORD] == alloc_id else None

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

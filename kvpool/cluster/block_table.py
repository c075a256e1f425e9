"""A storage node's table of its region: which block holds which range, and the write fence.

Every range a client writes is named by a ``WriteStamp`` (epoch, allocation id, block range,
key, parent; kvpool.transport.fencing). The table keeps one entry per block range, never two
overlapping, each in one of three states:

- ``CLAIMED``: a write is being made (the bytes are not complete);
- ``WRITTEN``: a final or sealed write (or an SSD load) completed: the node knows the key and
  the bytes are whole, so the block is reported at the next registration even if the master that
  allocated it crashed before it heard of it;
- ``COMMITTED``: the master told the node (heartbeat event) that the block is visible, or the
  node re-registered it with a master (a master refusing it has the node drop it: ``freed``).

Invariants (all under one lock):
- the table accepts claims only for its master's epoch (``new_term`` sets it; before the first
  registration, and while re-registering, every claim is stale);
- a claim older than an overlapping entry is refused (``FENCE_STALE``); a newer one waits until
  the overlapped entries have no write in flight, then replaces them (``FENCE_BUSY`` after
  ``claim_wait`` seconds), so a slow or resumed writer can never put bytes into a range a newer
  allocation owns;
- when a new term starts, entries not yet written are aborted: their writes end ``STALE`` and
  the entry goes once nothing is in flight there;
- heartbeat ``commit`` and ``free`` events name the allocation that filled the range and touch
  only that allocation's entry: after a remove and a re-put of the same key into the same range,
  a late commit or free of the old block never marks or drops the new one (0: unknown, matched
  by range and key, as events of blocks re-registered with this master are);
- a heartbeat ``commit`` marks an entry the table holds, never creates one (SSD loads insert theirs:
  ``promoted``): a later load's ``take_over`` (an RPC) can overtake the commit of the block loaded
  before, which must not come back over the new bytes;
- a heartbeat ``free`` drops only a ``COMMITTED`` entry: an entry written for a newer allocation
  of the same range (its commit event comes later in the ordered stream) is kept; or a
  ``WRITTEN`` one it names by its own allocation id (an SSD load the master no longer wants);
- same-host readers and the node's native TCP reads check the identity records (kvpool.transport.
  shm_ident): a block's is published once it is whole (WRITTEN or COMMITTED) and retracted when its
  entry goes or another starts there, before a claim letting new bytes in is granted; a claim or
  load retracts first, then looks for native reads in flight (kvpool.cluster.outside_reads);
- shared-memory seals (kvpool.transport.shm_seal): a claim taken ahead (placeholder key) has its
  record cleared before it is granted, its deadline restarted when sent again (``renewed``); a
  record naming it (claimed, not aborted) is adopted as a ``SEAL`` would be, and a new term aborts
  it only once past its deadline + margin (waits); a block whose record asks for the node's
  commit is owed it once (sealed_claims), as is one whose final TCP write asked for it (``owe``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

from kvpool.cluster.block_entry import (
    CLAIMED,
    COMMITTED,
    NO_KEY,
    WRITTEN,
    EntriesByOffset,
    Entry,
    Waits,
)
from kvpool.cluster.outside_reads import OutsideReads
from kvpool.cluster.sealed_claims import SealedClaims
from kvpool.cluster.unconfirmed import Unconfirmed
from kvpool.cluster.write_holders import WriteHolders
from kvpool.transport.fencing import FENCE_BUSY, FENCE_OK, FENCE_STALE, WriteStamp
from kvpool.transport.shm_ident import BlockIdents
from kvpool.transport.shm_seal import SealRecords, now_ns
from kvpool.transport.tcp_read_gate import ReadGate

DEFAULT_CLAIM_WAIT = 2.0  # seconds a newer claim waits for older writes in flight


class BlockTable:
    """The node's blocks by range and the fence every stamped write passes."""

    def __init__(
        self,
        checksum: Callable[[int, int], int],
        claim_wait: float = DEFAULT_CLAIM_WAIT,
        idents: BlockIdents | None = None,
        seals: SealRecords | None = None,
        clock: Callable[[], int] = now_ns,
        read_gate: ReadGate | None = None,
    ) -> None:
        self._checksum = checksum  # (offset, size) -> xxh3_64 of those arena bytes
        self._outside = OutsideReads(idents, read_gate)  # reads without this table's lock
        self._claims = None if seals is None else SealedClaims(seals, clock)  # same-host seals
        self.claim_wait = claim_wait
        self.epoch = 0  # the term served now (0: none, every claim is stale)
        self.highest = 0  # the highest term ever served (a lower master is stale)
        self._waits = Waits()  # reads take its plain lock; end_read notifies only if waited on
        self._lock = self._waits.lock  # waits and notifies go through ``_waits`` (counted)
        self._entries = EntriesByOffset()
        self._holders = WriteHolders()  # writes in flight by connection
        self._unconfirmed = Unconfirmed()  # sealed, not (yet) confirmed committed

    # -- the fence (kvpool.transport.fencing.WriteFence) ------------------------------

    def claim(self, stamp: WriteStamp, owner: object) -> int:
        deadline = time.monotonic() + self.claim_wait
        with self._lock:
            while True:
                if stamp.epoch != self.epoch:
                    return FENCE_STALE
                entry = self._entries.get(stamp.offset)
                if entry is not None and entry.stamp.same_allocation(stamp):
                    if entry.aborted or entry.state != CLAIMED:
                        return FENCE_STALE  # written blocks are immutable
                    if self._claims is None or not self._claims.renewed(entry, stamp):
                        self._holders.hold(entry, owner)  # (renewed while held: held once)
                    return FENCE_OK
                overlapped = self._entries.overlapping(stamp.offset, stamp.size)
                for other in overlapped:
                    self._adopt_sealed(other)
                if any(o.stamp.order >= stamp.order for o in overlapped):
                    return FENCE_STALE
                self._outside.retract(overlapped)  # first: see kvpool.cluster.outside_reads
                if not self._outside.held(overlapped):
                    for other in overlapped:
                        self._remove(other)
                    entry = Entry(stamp, CLAIMED)
                    self._insert(entry)
                    if self._claims is not None and stamp.key == NO_KEY:
                        self._claims.granted(entry)  # before the claim is answered
                    self._holders.hold(entry, owner)
                    return FENCE_OK
                left = deadline - time.monotonic()
                if left <= 0:
                    return FENCE_BUSY
                self._waits.wait(self._outside.wait_s(left))

    def finish(
        self, stamp: WriteStamp, owner: object, *, ok: bool, seal: bool, any_owner: bool = False
    ) -> int:
        """``any_owner``: an explicit seal or release may end a claim another
        connection of the same writer made (claims are made on pooled connections)."""
        with self._lock:
            entry = self._entries.get(stamp.offset)
            mine = entry is not None and entry.stamp.same_allocation(stamp)
            if mine and ok and seal and entry is not None and not entry.aborted:
                self._seal(entry, stamp)
                return FENCE_OK
            if mine:
                assert entry is not None
                self._unhold(entry, self._holders.holder(entry, owner) if any_owner else owner)
                if not entry.aborted:
                    return FENCE_OK
            return FENCE_STALE

    def owner_gone(self, owner: object) -> None:
        with self._lock:
            for entry in self._holders.gone(owner):
                self._settle(entry)
            self._waits.notify_all()

    def begin_read(self, key: bytes, block_offset: int, offset: int, length: int) -> Entry | None:
        """The whole block ``key`` at ``block_offset`` covering the range, held (no newer claim
        takes it) until ``end_read``; None if the range holds something else (an old lease)."""
        with self._lock:
            return self._begin_read(key, block_offset, offset, length)

    def begin_reads(self, reads: Iterable[tuple[bytes, int, int, int]]) -> list[Entry | None]:
        """``begin_read`` of each (key, block offset, offset, length), in order, under one
        lock: a pipelined batch of reads."""
        with self._lock:
            begin = self._begin_read
            return [begin(key, block, offset, length) for key, block, offset, length in reads]

    def end_read(self, entry: Entry) -> None:
        self.end_reads((entry,))

    def end_reads(self, held: Iterable[Entry]) -> None:
        """The reads of these entries (``begin_read(s)``' answers, None left out) ended."""
        with self._lock:
            for entry in held:
                entry.inflight -= 1
                if entry.aborted:
                    self._settle(entry)
            if self._waits.waiting:  # (Waits.notify_all, inline: the node's read path)
                self._waits.cond.notify_all()

    waiting = property(lambda self: self._waits.waiting, doc="threads waiting in the table now")

    # -- terms, registration, heartbeat events -----------------------------------------

    def suspend(self) -> None:
        """Before (re-)registering: take no writes and abort those not yet complete,
        so the listing sent next holds every block a write was acknowledged for
        (no write can complete between the listing and the new term)."""
        self.new_term(0)

    def new_term(self, epoch: int) -> None:
        """Serve master term ``epoch`` (0: none): abort every write not yet complete."""
        with self._lock:
            self.epoch = epoch  # first: no claim is granted from here on
            self.highest = max(self.highest, epoch)
            while self._claims is not None:  # shm-sealable claims: adopted or past deadline
                left = self._claims.abort_wait(self._adopt_all())
                if left <= 0:
                    break
                self._waits.wait(left)
            for entry in list(self._entries.values()):
                if entry.state == CLAIMED:
                    entry.aborted = True
                    self._settle(entry)
            self._waits.notify_all()

    def listing(self) -> list[list[Any]]:
        """Every whole block, checksummed (changed bytes left out), confirmed ones first."""
        with self._lock:
            report = []
            whole = [e for e in self._adopt_all() if e.state != CLAIMED and not e.aborted]
            for entry in sorted(whole, key=lambda e: e.state != COMMITTED):
                actual = self._checksum(entry.stamp.offset, entry.stamp.size)
                if entry.checksum and actual != entry.checksum:
                    self._remove(entry)
                    continue
                entry.checksum = actual
                report.append(entry.wire())
                self._entries.set_state(entry, COMMITTED)
            return report

    def committed(
        self, key: bytes, offset: int, size: int, parent: bytes | None, alloc_id: int = 0
    ) -> Entry | None:
        """The master made ``key`` (allocation ``alloc_id`` of this term; 0: unknown)
        visible at ``offset``: the entry to checksum, or None when the table holds no
        entry of that allocation there (freed, taken over, or another block's now)."""
        with self._lock:
            if (entry := self._entries.get(offset)) is None:
                return None  # never recreated: see the invariants above
            s = entry.stamp
            named = entry.named_by(alloc_id, self.epoch) and s.key == key
            if not ((entry.is_allocation(alloc_id, self.epoch) or named) and s.size == size):
                return None  # another (newer) allocation of the range holds it now
            if self._adopt_sealed(entry):
                self._entries.set_state(entry, COMMITTED)
                return entry
            if entry.state == CLAIMED and not entry.aborted:
                # Committed before its seal arrived (seal and commit run in parallel;
                # the master commits only once the bytes are in place): whole now.
                entry.stamp = s._replace(key=key, parent=parent)
                self._outside.publish(entry)
            self._entries.set_state(entry, COMMITTED)
            return entry

    def promoted(
        self, key: bytes, offset: int, size: int, parent: bytes | None, alloc_id: int
    ) -> Entry | None:
        """The node loaded ``key`` from SSD into allocation ``alloc_id``'s range (after
        ``take_over``): whole and readable now, ``WRITTEN`` until the master's commit
        (a late free of the range's previous block keeps it); None if a newer entry
        overlaps it."""
        with self._lock:
            if self._entries.overlapping(offset, size):
                return None
            entry = Entry(WriteStamp(self.epoch, alloc_id, offset, size, key, parent), WRITTEN)
            self._insert(entry)
            self._outside.publish(entry)
            return entry

    def freed(self, offset: int, alloc_id: int = 0) -> None:
        """The master freed the block of allocation ``alloc_id`` (0: unknown) at ``offset``;
        one still read (a lease ran out mid-read) serves and lists no more, gone after."""
        with self._lock:
            entry = self._entries.get(offset)
            if entry is None:
                return
            epoch = self.epoch
            if (entry.state == COMMITTED and entry.named_by(alloc_id, epoch)) or (
                entry.state == WRITTEN and entry.is_allocation(alloc_id, epoch)  # an unwanted load
            ):
                entry.aborted = True  # end_reads removes it once no read is in flight
                self._outside.retract([entry])
                self._settle(entry)
                self._waits.notify_all()

    def take_over(self, offset: int, size: int) -> None:
        """The node itself is about to write [offset, offset + size) (an SSD load into a
        range the master chose): whatever the table still holds there is gone (its late
        free may not have arrived). No new read or write of it starts; those in flight
        there are waited for (at most ``claim_wait``, as a newer claim waits), so a reader
        is not sent a mix of old and loaded bytes; then the entries go, and a stale
        writer's seal there is refused."""
        deadline = time.monotonic() + self.claim_wait
        with self._lock:
            overlapped = self._entries.overlapping(offset, size)
            for entry in overlapped:
                entry.aborted = True
            self._outside.retract(overlapped)
            while self._outside.held(overlapped):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._waits.wait(self._outside.wait_s(left))
            for entry in overlapped:
                self._remove(entry)
            self._waits.notify_all()

    def set_checksum(self, entry: Entry) -> int:
        entry.checksum = self._checksum(entry.stamp.offset, entry.stamp.size)
        return entry.checksum

    def used_bytes(self) -> tuple[int, int]:
        """(bytes held in whole blocks, their number): O(claims taken ahead), not O(blocks)."""
        with self._lock:
            self._adopt_open()
            return self._entries.whole_bytes, self._entries.whole_count

    def state_of(self, offset: int) -> str | None:
        with self._lock:
            return None if (entry := self._entries.get(offset)) is None else entry.state

    def unconfirmed(self, age: float) -> list[Entry]:
        """Blocks still ``WRITTEN`` ``age`` s after their seal (no commit event came: their
        writer may be gone), each once (kvpool.cluster.unconfirmed)."""
        with self._lock:
            return self._unconfirmed.due(age, self._entries)

    def owe(self, stamp: WriteStamp) -> bool:
        """The final TCP write of ``stamp`` asked the node to commit the block it sealed: owed
        once (False: not whole under that allocation now, or the node takes no such asks)."""
        with self._lock:
            entry = self._entries.get(stamp.offset)
            return entry is not None and self._claims is not None and self._claims.owe(entry, stamp)

    def seal_work(self, wake: Callable[[], object] | None, claims_ring: bool = False) -> bool:
        """``SealedClaims.pending`` (``claims_ring``: writers' rings wake the node), and
        ``wake()`` (under the lock) as such work appears."""
        with self._lock:
            if self._claims is not None:
                self._claims.wake, self._claims.claims_ring = wake, claims_ring
            return self._claims is not None and self._claims.pending()

    def adopt_owed(self) -> list[Entry]:
        """Adopt the sealed claims taken ahead; the blocks owed the node's commit, once each."""
        with self._lock:
            self._adopt_open()
            return [] if self._claims is None else self._claims.take_owed()

    # -- helpers (under the lock) -------------------------------------------------------

    def _seal(self, entry: Entry, stamp: WriteStamp) -> None:
        """Whole: no write of it in flight (a claim taken ahead ends too); key named."""
        self._holders.sealed(entry)
        was = entry.state  # COMMITTED: the commit event overtook this seal
        entry.stamp = stamp
        self._entries.set_state(entry, COMMITTED if was == COMMITTED else WRITTEN)
        if was == CLAIMED:
            self._unconfirmed.sealed(entry, self._entries)
            self._outside.publish(entry)
            if self._claims is not None:
                self._claims.sealed(entry)
        self._waits.notify_all()

    def _adopt_sealed(self, entry: Entry) -> bool:
        """Adopt ``entry``'s seal record if its writer sealed it in shared memory."""
        if self._claims is None or self._entries.get(entry.stamp.offset) is not entry:
            return False
        found = self._claims.find(entry)
        if found is not None:
            self._seal(entry, found)
        return found is not None

    def _adopt_open(self) -> None:
        """Adopt the records sealed for claims taken ahead (O(such claims))."""
        for entry in [] if self._claims is None else self._claims.sealed_open():
            self._adopt_sealed(entry)

    def _adopt_all(self) -> list[Entry]:
        """Every entry, after adopting the shared-memory seals written so far."""
        self._adopt_open()  # only claims taken ahead have records (sealed_claims)
        return list(self._entries.values())

    def _begin_read(self, key: bytes, block_offset: int, offset: int, length: int) -> Entry | None:
        entry = self._entries.get(block_offset)
        if entry is not None and entry.state == CLAIMED:  # sealed in shared memory, not adopted?
            self._adopt_sealed(entry)
        if entry is None or not entry.serves(key, offset, length):
            return None
        entry.inflight += 1
        return entry

    def _unhold(self, entry: Entry, owner: object) -> None:
        if self._holders.release(entry, owner):
            self._settle(entry)
            self._waits.notify_all()

    def _settle(self, entry: Entry) -> None:  # (a native read's hold: the next writer does)
        ours = entry.aborted and self._entries.get(entry.stamp.offset) is entry
        if ours and not self._outside.held([entry]):
            self._remove(entry)

    def _insert(self, entry: Entry) -> None:
        self._entries.add(entry)
        self._outside.retract([entry])  # not readable until published

    def _remove(self, entry: Entry) -> None:
        if self._entries.discard(entry):
            self._outside.retract([entry])
            if self._claims is not None:
                self._claims.gone(entry)

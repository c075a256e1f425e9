"""The node's side of seals in shared memory (kvpool.transport.shm_seal), for its block table.

A claim taken ahead for a grant (placeholder key) may be sealed by its
same-host writer in the seal record of its range instead of a ``SEAL`` over
TCP, and the writer may ask the node to commit the block to the master for
it (kvpool.cluster.node_commits), so that a same-host put sends nothing.
``SealedClaims`` keeps what the block table (kvpool.cluster.block_table)
needs for that; every method runs under the table's lock.

Invariants:
- ``open`` holds, by offset, the claims taken ahead that are still claimed:
  the only records a poll must read, so a poll costs O(claims taken ahead),
  not O(blocks). An entry leaves it when sealed or removed from the table;
- an entry is owed a commit at most once: when it goes from claimed to
  whole (adopted from its record, or sealed over TCP) and its record, naming
  its allocation, asks for one (``NODE_COMMITS``); or when its final TCP write
  asked for one (``owe``: its data server calls it once, right after the seal).
  ``take_owed`` hands the owed entries over in the order they were owed;
- ``wake`` (when set) is called as a commit becomes owed, or a claim is taken
  ahead unless ``claims_ring`` (their writers ring the node's doorbell, which
  wakes it: kvpool.transport.shm_doorbell): the node's commit thread sets it
  before it stops polling (nothing to poll for) and clears it when it wakes, so a
  busy node pays no call per put.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from kvpool.cluster.block_entry import CLAIMED, NO_KEY, Entry
from kvpool.transport.fencing import WriteStamp
from kvpool.transport.shm_seal import SealRecords


class SealedClaims:
    """Claims sealable in shared memory, and the blocks owed a commit by the node."""

    def __init__(self, records: SealRecords, clock: Callable[[], int]) -> None:
        self.records = records
        self._clock = clock  # CLOCK_MONOTONIC ns (injected by unit tests)
        self.open: dict[int, Entry] = {}
        self._owed: list[Entry] = []
        self.wake: Callable[[], object] | None = None
        self.claims_ring = False  # open claims' writers ring the node awake: no poll

    def pending(self) -> bool:
        """A commit is owed, or a claim taken ahead is open and its writer's ring would
        not wake the node (``claims_ring`` False): the commit thread polls."""
        return bool(self._owed or (self.open and not self.claims_ring))

    def granted(self, entry: Entry) -> None:
        """A claim taken ahead is about to be answered: no seal recorded in its
        range yet, and its deadline starts now."""
        offset = entry.stamp.offset
        entry.granted_ns = self._clock()
        if self.records.clear(offset):
            self.open[offset] = entry
            if self.wake is not None and not self.claims_ring:
                self.wake()

    def renewed(self, entry: Entry, stamp: WriteStamp) -> bool:
        """Its writer claimed ``entry`` ahead again with ``stamp`` (the placeholder key:
        its stock held the grant past half its deadline, kvpool.cluster.client.sealed_put):
        if it is open (claimed, no record adopted), its deadline starts again now. Whether
        it is held already: then the renewal adds no write in flight (one release still
        ends it); False for any other claim of the allocation (a put's own). Safe: a later
        ``granted_ns`` only delays a new term's abort of the claim, and the writer's
        test uses its own clock read before it sent the renewal (as for a first
        claim); a record sealed before the renewal is adopted as any other."""
        if stamp.key != NO_KEY or self.open.get(entry.stamp.offset) is not entry:
            return False
        entry.granted_ns = self._clock()
        return entry.inflight > 0

    def find(self, entry: Entry) -> WriteStamp | None:
        """The stamp its writer sealed in ``entry``'s record (a claim taken ahead,
        still claimed, not aborted: the caller checks it is the table's entry)."""
        if not entry.granted_ns or entry.state != CLAIMED or entry.aborted:
            return None
        found = self.records.read(entry.stamp.offset)
        if found is None or not found[0].same_allocation(entry.stamp):
            return None
        return found[0]

    def sealed(self, entry: Entry) -> None:
        """``entry`` went from claimed to whole: owed a commit if its record asks."""
        self.gone(entry)
        found = self.records.read(entry.stamp.offset) if entry.granted_ns else None
        if found is not None and found[1] and found[0].same_allocation(entry.stamp):
            self._owe(entry)

    def owe(self, entry: Entry, stamp: WriteStamp) -> bool:
        """``entry``'s final TCP write (``stamp``) asked for the node's commit: owed it
        if the entry is that allocation's and whole (False: replaced or aborted since)."""
        if entry.state == CLAIMED or entry.aborted or not entry.stamp.same_allocation(stamp):
            return False
        self._owe(entry)
        return True

    def _owe(self, entry: Entry) -> None:
        self._owed.append(entry)
        if self.wake is not None:
            self.wake()

    def gone(self, entry: Entry) -> None:
        if self.open.get(entry.stamp.offset) is entry:
            del self.open[entry.stamp.offset]

    def sealed_open(self) -> list[Entry]:
        """The claims taken ahead whose record is sealed now (to adopt)."""
        return [self.open[o] for o in self.records.sealed_at(list(self.open))]

    def take_owed(self) -> list[Entry]:
        owed, self._owed = self._owed, []
        return owed

    def abort_wait(self, entries: Iterable[Entry]) -> float:
        """Seconds a new term must wait before it may abort the unsealed claims
        taken ahead among ``entries`` (0: none is within its deadline + margin)."""
        d, now = self.records.deadline, self._clock()
        waiting = [
            e.granted_ns
            for e in entries
            if e.granted_ns and e.state == CLAIMED and not e.aborted
            if not d.node_may_abort(e.granted_ns, now)
        ]
        if not waiting:
            return 0.0
        return (min(waiting) + d.hold_ns + d.margin_ns - now) / 1e9 + 0.001

"""The reads of a node's blocks that run outside its block table's lock, and what holds them.

Two readers copy a block's bytes without taking the table's lock (kvpool.cluster.block_table):
a same-host client, straight out of the node's arena mapping (kvpool.transport.shm), and the
node's own data server serving a checked TCP read in one native call (the read gate,
kvpool.transport.tcp_read_gate). Both go by the block's identity record
(kvpool.transport.shm_ident), which the table publishes here once the block is whole and
retracts when its entry goes or a newer one starts there.

They differ in how a newer write is kept off the bytes they copy. A same-host reader checks the
record again after its copy (a seqlock: a changed record makes the copy a miss), so retracting
before a claim is granted is enough. A native TCP read has sent its bytes when it ends, so it
holds the block instead: the gate counts the reads of each block start in flight, and the table
counts them with its entries' own holds (``held``). The order that makes this safe: a writer
(a claim, an SSD load) retracts the records of the entries it overlaps *before* it asks
``held``, while a native read checks the record and raises its count in one call holding the
GIL. So the writer sees the read, or the read sees the retraction. A native read's end notifies
nobody: a writer waiting on one looks again every ``GATE_POLL_S`` (``wait_s``).

Every method runs under the table's lock.
"""

from __future__ import annotations

from kvpool.cluster.block_entry import Entry
from kvpool.transport.shm_ident import BlockIdents
from kvpool.transport.tcp_read_gate import ReadGate

GATE_POLL_S = 0.001  # how often a writer looks again at a native read in flight


class OutsideReads:
    """The identity records a table publishes, and the native reads that hold its blocks."""

    def __init__(self, idents: BlockIdents | None, gate: ReadGate | None) -> None:
        if gate is not None and idents is None:
            raise ValueError("a read gate checks the identity records: give them too")
        self._idents = idents  # None: no record published, no reader outside the lock
        self._gate = gate

    def publish(self, entry: Entry) -> None:
        """``entry``'s block is whole: readable outside the lock from now on."""
        if self._idents is not None:
            stamp = entry.stamp
            self._idents.publish(stamp.offset, stamp.size, stamp.key)

    def retract(self, entries: list[Entry]) -> None:
        """No read of these entries' blocks starts outside the lock from now on."""
        idents = self._idents
        if idents is not None:
            for entry in entries:
                idents.retract(entry.stamp.offset)

    def held(self, entries: list[Entry]) -> bool:
        """A read or write is in flight in one of these entries: one the table holds, or a
        native read (ask after ``retract``: see the module's docstring)."""
        gate = self._gate
        return any(e.inflight > 0 for e in entries) or (
            gate is not None and gate.reading(e.stamp.offset for e in entries)
        )

    def wait_s(self, left: float) -> float:
        """How long a writer waits for a notify before it looks again (``left``: what
        its deadline allows)."""
        return left if self._gate is None else min(left, GATE_POLL_S)

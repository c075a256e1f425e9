"""Which way a small SSD write goes: queued through AIO and waited for awake, or a
plain synchronous ``pwrite``. Awake, unless a recent spin ran out of budget.

Why (issue 17, bench/RESULTS.md "Session 16"): on these VMs the disk is served
by the hypervisor, at times on the host CPU that runs this vCPU. Then a vCPU
that stays busy after the write was queued (hashing, staging the record,
spinning on the completion ring) keeps the host from serving the write until
it preempts the vCPU, while a ``pwrite`` halts the vCPU at once and the write
is served right away. Measured on one machine, 64 KiB stores against a raw
``O_DIRECT`` pwrite, rounds of 256: waiting awake 0.97-1.09x most of the time
and 0.51-0.53x in phases with 21-23% CPU steal, where 10% of its spins ran out
of their 200 us (against 0-3 in 1536 otherwise); the synchronous store
0.71-0.83x in both. A spin that runs out is the sign of such a phase that the
writer sees for free.

Rule: after a spin ran out, the next ``BACKOFF_WRITES`` small writes are
synchronous; then waiting awake is tried again. A quiet phase thus loses at
most ``BACKOFF_WRITES`` synchronous writes per (rare) timeout; a contended one
spends most writes synchronous. A choice that raced the two modes on measured
store times was tried first and dropped: an awake write measured right after
synchronous ones runs cold, so its samples undersold it and 38-47% of writes
went synchronous in quiet phases (0.81-0.97x instead of 0.97-1.09x).

Not thread-safe: the SSD tier calls it under the pool's lock.
"""

from __future__ import annotations

from dataclasses import dataclass

BACKOFF_WRITES = 64


@dataclass
class WaitChoice:
    """Whether the next small write is waited for awake, and how many went each way."""

    timeouts_seen: int = 0  # the writer's count of spins that ran out, when last asked
    sync_left: int = 0  # small writes still to go synchronously after a timeout
    awake_writes: int = 0
    sync_writes: int = 0

    def awake(self, spin_timeouts: int) -> bool:
        """Whether the small write about to go out is queued and waited for awake;
        ``spin_timeouts``: the writer's count of spins that ran out so far (one more
        than last time starts the ``BACKOFF_WRITES``, this write included)."""
        if spin_timeouts != self.timeouts_seen:
            self.timeouts_seen = spin_timeouts
            self.sync_left = BACKOFF_WRITES
        if self.sync_left:
            self.sync_left -= 1
            self.sync_writes += 1
            return False
        self.awake_writes += 1
        return True

"""Client-side cache of read leases: repeated reads of a block skip the master.

Blocks are immutable and named by a hash of their whole prefix, so once a
client holds a lease on a block (the master will not free or reuse its
range), it can read it again without asking where it is. The cache keeps
each lease for ``hold_s`` seconds after it was granted, or while a caller
holds it explicitly (``pin``), and within ``max_bytes`` of leased blocks;
then it hands the lease back, with how often each block was read meanwhile
so the master's hot-block accounting sees every read.

Safety rests on three bounds: the master's lease TTL is longer than
``hold_s``; a restarted master waits a grace period longer than ``hold_s``
before it allocates anything (so no range named in a pre-restart lease is
reused while a client may still read it); and a client forgets a key it
removes itself. Another client's ``remove`` becomes visible here after at
most ``hold_s`` (the bytes read meanwhile are the block's correct bytes).

Hot blocks stay leased: ``renewable`` names the keys read under a lease that
ends soon, and the client's janitor re-leases them all in one round trip
before the hold ends (kvpool.cluster.client.reads ``renew_hot``), so a reader
that keeps revisiting its blocks never waits for the master on its read path.
A renewal is a fresh grant from the master, so every lease still serves for
at most ``hold_s`` after the master last said the block was there: the
``remove`` bound above is unchanged.
"""

from __future__ import annotations

import time
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvpool.config import env_seconds

# Overridable per process (0 turns the cache off: every read asks the master).
DEFAULT_HOLD_S = env_seconds("KVPOOL_LEASE_CACHE_S", 1.0)
DEFAULT_MAX_BYTES = 1 << 30


@dataclass
class CachedLease:
    lease_id: int
    keys: list[bytes]
    nbytes: int
    deadline: float  # hand it back after this (unless pinned)
    expires: float  # the master's lease ends about here: never read past it
    pins: int = 0  # explicit holders (RemoteLease objects) still using it
    reads: Counter[bytes] = field(default_factory=Counter)
    for_read: bool = False  # taken by a read of all its keys (counted by the master)


class LeaseCache:
    """key -> (placements, size) for blocks under a live lease; not thread-safe."""

    def __init__(self, hold_s: float = DEFAULT_HOLD_S, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.hold_s, self.max_bytes = hold_s, max_bytes
        self._blocks: dict[bytes, tuple[Any, int, CachedLease]] = {}
        self._leases: OrderedDict[int, CachedLease] = OrderedDict()  # oldest first
        self._bytes = 0
        self.superseded: list[CachedLease] = []  # set by add(): older leases now idle

    def add(
        self,
        lease_id: int,
        blocks: Sequence[tuple[bytes, Any, int]],
        ttl: float,
        pins: int,
        for_read: bool = False,
    ) -> CachedLease:
        """Remember a fresh lease (master TTL ``ttl``) over (key, placements, size) blocks,
        held by ``pins`` users until they ``unpin``; ``for_read``: a read of every one
        of them took it (so each was read once: ``renewable`` counts that)."""
        now = time.monotonic()
        lease = CachedLease(
            lease_id,
            [k for k, _, _ in blocks],
            sum(s for _, _, s in blocks),
            now + self.hold_s,
            now + 0.9 * ttl,
            pins=pins,
            for_read=for_read,
        )
        older = {id(f[2]): f[2] for k, _, _ in blocks if (f := self._blocks.get(k)) is not None}
        for key, placements, size in blocks:
            self._blocks[key] = (placements, size, lease)  # the newest lease wins
        self._leases[lease_id] = lease
        self._bytes += lease.nbytes
        self.superseded = [self._drop(old) for old in older.values() if self._idle(old)]
        return lease

    def lookup(self, key: bytes, count: bool = True) -> tuple[Any, int, CachedLease] | None:
        """Placements, size and lease of a leased block; None if not (safely) cached."""
        found = self._blocks.get(key)
        if found is None:
            return None
        lease = found[2]
        now = time.monotonic()
        if now > lease.expires or (lease.pins == 0 and now > lease.deadline):
            return None
        if count:
            lease.reads[key] += 1
        return found

    def pin_many(self, keys: Sequence[bytes]) -> dict[bytes, tuple[Any, int, CachedLease]]:
        """``lookup`` of each distinct key, its lease pinned once per key found (the
        caller unpins once per entry returned: a key twice in ``keys`` is one entry,
        one pin); one clock read for the whole batch."""
        now, blocks = time.monotonic(), self._blocks
        found: dict[bytes, tuple[Any, int, CachedLease]] = {}
        for key in keys:
            hit = blocks.get(key)
            if hit is None or key in found:
                continue
            lease = hit[2]
            if now > lease.expires or (lease.pins == 0 and now > lease.deadline):
                continue
            lease.reads[key] += 1
            lease.pins += 1
            found[key] = hit
        return found

    def pin_all(self, keys: Sequence[bytes]) -> list[tuple[Any, int, CachedLease]] | None:
        """Each key's (placements, size, lease), its lease pinned once per position (a
        key named twice is pinned twice), or None -- nothing left pinned -- when any
        key is not (safely) cached: a batch of cache hits in one pass, no dict. Reads
        are not counted: the caller's ``unpin_read`` counts those that happened."""
        now, blocks, hits = time.monotonic(), self._blocks, []
        for key in keys:
            hit = blocks.get(key)
            if hit is None:
                break
            lease = hit[2]
            if now > lease.expires or (lease.pins == 0 and now > lease.deadline):
                break
            lease.pins += 1
            hits.append(hit)
        else:
            return hits
        for hit in hits:
            hit[2].pins -= 1
        return None

    def unpin_read(self, keys: Sequence[bytes], hits: list[tuple[Any, int, CachedLease]]) -> None:
        """Undo ``pin_all(keys)``, each position counted as one read of its key."""
        for key, (_, _, lease) in zip(keys, hits, strict=True):
            lease.pins -= 1
            lease.reads[key] += 1

    def renewable(self, within: float) -> list[bytes]:
        """Keys to re-lease now: read under a lease that is still held but ends within
        ``within`` seconds, and still served by it (oldest leases first). The read that
        took a lease counts: a block read once per hold, which never hits the cache,
        is renewed all the same (else each of its reads would wait for the master)."""
        now = time.monotonic()
        horizon, keys = now + within, []
        for lease in self._leases.values():  # oldest (earliest deadline) first
            if lease.deadline > horizon:
                break  # this one and every later one end later
            read = lease.keys if lease.for_read else lease.reads
            if not read or now > lease.deadline or now > lease.expires:
                continue  # cold, or already due: the next read leases it again
            blocks = self._blocks
            keys += [k for k in read if (f := blocks.get(k)) is not None and f[2] is lease]
        return keys

    def unpin(self, lease: CachedLease) -> None:
        lease.pins -= 1

    def unpin_all(self, leases: list[CachedLease]) -> None:
        """``unpin`` each (a lease named twice is unpinned twice)."""
        for lease in leases:
            lease.pins -= 1

    def forget(self, key: bytes) -> list[CachedLease]:
        """Stop serving ``key`` (this client removed it); returns every unpinned lease
        that holds it, dropped whole (its other keys are leased again when next
        read), so the caller hands them back at once: a removed block's range is
        freed only when its last lease ends, and a renewal may have put it in a
        lease shared with many hot blocks."""
        if self._blocks.pop(key, None) is None:
            return []
        holding = [lease for lease in self._leases.values() if not lease.pins and key in lease.keys]
        return [self._drop(lease) for lease in holding]

    def _idle(self, lease: CachedLease) -> bool:
        """Unpinned, still held, and serving no key (newer leases or forgets took them)."""
        if lease.pins or lease.lease_id not in self._leases:
            return False
        return not any((f := self._blocks.get(k)) is not None and f[2] is lease for k in lease.keys)

    def due(self, everything: bool = False, unpinned: bool = False) -> list[CachedLease]:
        """Leases to hand back now: expired and unpinned, oldest first, plus the
        oldest unpinned ones past ``max_bytes``; with ``unpinned`` every unpinned
        one (memory is short), with ``everything`` all of them (closing)."""
        now, out, excess = time.monotonic(), [], self._bytes - self.max_bytes
        for lease in self._leases.values():  # oldest (earliest deadline) first
            if lease.pins and not everything:
                continue
            if not (everything or unpinned or excess > 0 or now > lease.deadline):
                break  # this one and every later one are younger, and within bounds
            out.append(lease)
            excess -= lease.nbytes
        return [self._drop(lease) for lease in out]

    def _drop(self, lease: CachedLease) -> CachedLease:
        del self._leases[lease.lease_id]
        self._bytes -= lease.nbytes
        for key in lease.keys:
            found = self._blocks.get(key)
            if found is not None and found[2] is lease:
                del self._blocks[key]
        return lease

"""Which data connection holds which block's writes in flight, for the node's block table.

A stamped write is held by the connection that claimed it (its *owner*) from
the claim until its seal or release, so a connection that goes away releases
exactly the writes it still held (``gone``): a dead writer never blocks a
range. ``WriteHolders`` keeps that count per owner and entry for
kvpool.cluster.block_table, which calls it under its lock.

Invariants: an entry's ``inflight`` counts its reads in flight plus the writes
held here; ``hold`` and a successful ``release`` change both by one, ``gone``
and ``sealed`` drop an owner's (every owner's) holds of it at once, and no
owner keeps an entry with a zero count.
"""

from __future__ import annotations

from collections import Counter, defaultdict

from kvpool.cluster.block_entry import Entry


class WriteHolders:
    """Writes in flight by owner (a connection) and entry; not thread-safe."""

    def __init__(self) -> None:
        self._by_owner: defaultdict[object, Counter[Entry]] = defaultdict(Counter)

    def hold(self, entry: Entry, owner: object) -> None:
        entry.inflight += 1
        self._by_owner[owner][entry] += 1  # (a defaultdict: no Counter built per claim)

    def release(self, entry: Entry, owner: object) -> bool:
        """End one of ``owner``'s writes of ``entry``; False if it held none."""
        held = self._by_owner.get(owner)
        if held is None or held[entry] <= 0:
            return False
        held[entry] -= 1
        if not held[entry]:
            del held[entry]
        entry.inflight -= 1
        return True

    def holder(self, entry: Entry, owner: object) -> object:
        """``owner`` if it holds a write of ``entry``, else another owner that does
        (claims are made on pooled connections: a seal may come on another), else
        ``owner``."""
        if (self._by_owner.get(owner) or Counter())[entry]:
            return owner
        return next((o for o, held in self._by_owner.items() if held.get(entry)), owner)

    def gone(self, owner: object) -> list[Entry]:
        """``owner`` went away: its writes end; the entries they held."""
        held = self._by_owner.pop(owner, None) or Counter()
        for entry, n in held.items():
            entry.inflight -= n
        return list(held)

    def sealed(self, entry: Entry) -> None:
        """``entry`` is whole: no write of it is in flight any more (whoever held one)."""
        for held in self._by_owner.values():
            held.pop(entry, None)
        entry.inflight = 0

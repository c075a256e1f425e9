"""Which data connection holds which block's writes in flight, for the node's block table.

A stamped write is held by the connection that claimed it (its *owner*) from
the claim until its seal or release, so a connection that goes away releases
exactly the writes it still held (``gone``): a dead writer never blocks a
range. ``WriteHolders`` keeps that count per owner and entry for
kvpool.cluster.block_table, which calls it under its lock.

Invariants: an entry's ``inflight`` counts its reads in flight plus the writes
held here; ``hold`` and a successful ``release`` change both by one, ``gone``
and ``sealed`` drop an owner's (every owner's) holds of it at once, and no
owner keeps an entry with a zero count. ``_owners`` names, per entry, exactly
the owners that hold a write of it, so a seal and a look-up for another owner's
hold cost the entry's holders, not every connection the node has (a seal
walked them all: with a TCP grant's claim taken ahead on one pooled connection
and its write on another, every seal has two; a node with many clients has
hundreds of connections).
"""

from __future__ import annotations

from collections import Counter, defaultdict

from kvpool.cluster.block_entry import Entry


class WriteHolders:
    """Writes in flight by owner (a connection) and entry; not thread-safe."""

    def __init__(self) -> None:
        self._by_owner: defaultdict[object, Counter[Entry]] = defaultdict(Counter)
        self._owners: dict[Entry, set[object]] = {}  # who holds each entry's writes

    def hold(self, entry: Entry, owner: object) -> None:
        entry.inflight += 1
        self._by_owner[owner][entry] += 1  # (a defaultdict: no Counter built per claim)
        owners = self._owners.get(entry)
        if owners is None:
            self._owners[entry] = {owner}
        else:
            owners.add(owner)

    def release(self, entry: Entry, owner: object) -> bool:
        """End one of ``owner``'s writes of ``entry``; False if it held none."""
        held = self._by_owner.get(owner)
        if held is None or held[entry] <= 0:
            return False
        held[entry] -= 1
        if not held[entry]:
            del held[entry]
            self._drop(entry, owner)
        entry.inflight -= 1
        return True

    def holder(self, entry: Entry, owner: object) -> object:
        """``owner`` if it holds a write of ``entry``, else another owner that does
        (claims are made on pooled connections: a seal may come on another), else
        ``owner``."""
        owners = self._owners.get(entry)
        if not owners or owner in owners:
            return owner
        return next(iter(owners))

    def gone(self, owner: object) -> list[Entry]:
        """``owner`` went away: its writes end; the entries they held."""
        held = self._by_owner.pop(owner, None) or Counter()
        for entry, n in held.items():
            entry.inflight -= n
            self._drop(entry, owner)
        return list(held)

    def sealed(self, entry: Entry) -> None:
        """``entry`` is whole: no write of it is in flight any more (whoever held one)."""
        for owner in self._owners.pop(entry, ()):
            self._by_owner[owner].pop(entry, None)
        entry.inflight = 0

    def check(self) -> None:
        """Raise AssertionError unless ``_owners`` names exactly the holders (tests)."""
        held = {(e, o) for o, counts in self._by_owner.items() for e, n in counts.items() if n}
        assert held == {(e, o) for e, owners in self._owners.items() for o in owners}
        assert all(self._owners.values())

    def _drop(self, entry: Entry, owner: object) -> None:
        """``owner`` holds no write of ``entry`` any more."""
        owners = self._owners.get(entry)
        if owners is not None:
            owners.discard(owner)
            if not owners:
                del self._owners[entry]

"""Offline Belady oracle (furthest next use) — for evaluation only.

Belady's MIN evicts the block whose next use lies furthest in the future;
with bypass it also refuses to store a block whose next use is further than
every resident block's (or that is never used again). It needs the whole
future, so it is built from the request sequence itself and told which
request is being served (``advance(i)``); the pool never uses it.

Ties on next use break towards the deeper block (its position in its
prompt): every request that uses a block also uses its parent, so a parent's
next use is never later than its child's, and with this tie-break the
oracle never evicts a parent before its children — its cache stays
prefix-closed, as a prefix-hit cache should.

Invariants (beyond the base class's):
- after ``advance(i)``, the next use of a key is the first request index
  ``> i`` whose blocks contain it (``NEVER`` if none);
- ``victim`` returns the evictable key with the largest (next use, depth);
- with ``capacity`` set, ``admit(key)`` is False when the key is never used
  again, or the tier is full and the key's (next use, depth) is not smaller
  than the worst resident key's.
Cost: O(log n) per hook (a heap with lazy deletion).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from kvpool.eviction.base import Evictable, EvictionPolicy, Key, always_evictable


class BeladyPolicy(EvictionPolicy):
    """Furthest-next-use eviction with bypass, from a known request sequence."""

    name = "belady"

    def __init__(self, requests: Sequence[Sequence[Key]], capacity: int | None = None) -> None:
        self.capacity = capacity
        self.never = len(requests)  # "next use" of a key not used again
        self._uses: dict[Key, list[int]] = {}
        self._ptr: dict[Key, int] = {}
        self._depth: dict[Key, int] = {}
        for i, keys in enumerate(requests):
            for depth, key in enumerate(keys):
                uses = self._uses.get(key)
                if uses is None:
                    self._uses[key] = [i]
                    self._ptr[key] = 0
                    self._depth[key] = depth
                elif uses[-1] != i:
                    uses.append(i)
        self._now = -1
        self._next: dict[Key, int] = {}  # tracked key -> next use when last touched
        self._heap: list[tuple[int, int, Key]] = []  # (-next use, -depth, key)

    def advance(self, request_index: int) -> None:
        """The simulator is now serving request ``request_index`` (non-decreasing)."""
        if request_index < self._now:
            raise ValueError("Belady time only moves forward")
        self._now = request_index

    def next_use(self, key: Key) -> int:
        """First request index after the current one that uses ``key``."""
        uses = self._uses.get(key)
        if uses is None:
            return self.never
        p = self._ptr[key]
        while p < len(uses) and uses[p] <= self._now:
            p += 1
        self._ptr[key] = p
        return uses[p] if p < len(uses) else self.never

    def _depth_of(self, key: Key) -> int:
        return self._depth.get(key, 0)

    def _clean_top(self) -> None:
        heap, nxt = self._heap, self._next
        while heap and nxt.get(heap[0][2]) != -heap[0][0]:
            heapq.heappop(heap)

    def admit(self, key: Key) -> bool:
        n = self.next_use(key)
        if n >= self.never:
            return False
        if self.capacity is None or len(self._next) < self.capacity:
            return True
        self._clean_top()
        if not self._heap:
            return True
        worst_next, worst_depth, _ = self._heap[0]
        return (n, self._depth_of(key)) < (-worst_next, -worst_depth)

    def _touch(self, key: Key) -> None:
        n = self.next_use(key)
        self._next[key] = n
        heapq.heappush(self._heap, (-n, -self._depth_of(key), key))

    def on_insert(self, key: Key, parent: Key | None = None) -> None:
        self._touch(key)

    def on_access(self, key: Key) -> None:
        if key in self._next:
            self._touch(key)

    def on_remove(self, key: Key) -> None:
        self._next.pop(key, None)

    def victim(self, evictable: Evictable = always_evictable) -> Key | None:
        heap, nxt = self._heap, self._next
        skipped: list[tuple[int, int, Key]] = []
        found: Key | None = None
        while heap:
            entry = heapq.heappop(heap)
            key = entry[2]
            if nxt.get(key) != -entry[0]:
                continue
            if not evictable(key):
                skipped.append(entry)
                continue
            found = key
            break
        for entry in skipped:
            heapq.heappush(heap, entry)
        if found is not None:
            del nxt[found]
        return found

    def __len__(self) -> int:
        return len(self._next)

    def __contains__(self, key: object) -> bool:
        return key in self._next

"""Aged LFU: evict the least frequently used key, with counts that fade.

Counts are small saturating counters (0..``max_count``). Every
``aging_factor * len(self)`` hooks (at least ``min_period``) all counts are
halved, so popularity that is no longer being refreshed fades: a key hit 15
times long ago ends up below a key inserted a moment ago.

Invariants (beyond the base class's):
- a new key starts at count 1; a hit adds 1 up to ``max_count``; aging maps
  count c to c // 2 (so untouched keys sink to 0, below fresh keys);
- ``victim`` returns an evictable key of the lowest count; among keys of
  equal count, the one that reached that count (or was aged into it)
  first.

Implementation: one insertion-ordered bucket per count, filled lazily. A hit
only bumps the key's counter (O(1)); the key stays in the bucket of the
count it had when placed. ``victim`` scans the lowest non-empty bucket and
moves keys whose counter has grown to the end of their current count's
bucket (each hit pays for at most one such move). Aging rebuilds the
buckets, O(n) once per Θ(n) hooks. So every hook is O(1) amortised.
"""

from __future__ import annotations

from collections import OrderedDict

from kvpool.eviction.base import Evictable, EvictionPolicy, Key, always_evictable

_COUNT, _BUCKET = 0, 1


class LFUPolicy(EvictionPolicy):
    """Frequency buckets with lazy promotion and periodic halving."""

    name = "lfu"

    def __init__(self, max_count: int = 15, aging_factor: float = 8.0, min_period: int = 1024):
        if max_count < 1:
            raise ValueError("max_count must be >= 1")
        self.max_count = max_count
        self.aging_factor = aging_factor
        self.min_period = min_period
        self._buckets: list[OrderedDict[Key, None]] = [OrderedDict() for _ in range(max_count + 1)]
        self._nodes: dict[Key, list[int]] = {}  # key -> [count, bucket it sits in]
        self._ops = 0
        self._period = min_period

    def _age(self) -> None:
        """Halve every count; rebuild the buckets (lower buckets first)."""
        new: list[OrderedDict[Key, None]] = [OrderedDict() for _ in range(self.max_count + 1)]
        nodes = self._nodes
        for bucket in self._buckets:
            for key in bucket:
                node = nodes[key]
                node[_COUNT] >>= 1
                node[_BUCKET] = node[_COUNT]
                new[node[_COUNT]][key] = None
        self._buckets = new
        self._ops = 0
        self._period = max(self.min_period, int(self.aging_factor * len(nodes)))

    def on_insert(self, key: Key, parent: Key | None = None) -> None:
        node = self._nodes.get(key)
        if node is not None:
            del self._buckets[node[_BUCKET]][key]
        self._nodes[key] = [1, 1]
        self._buckets[1][key] = None
        self._ops += 1
        if self._ops >= self._period:
            self._age()

    def on_access(self, key: Key) -> None:
        node = self._nodes.get(key)
        if node is None:
            return
        if node[_COUNT] < self.max_count:
            node[_COUNT] += 1
        self._ops += 1
        if self._ops >= self._period:
            self._age()

    def on_remove(self, key: Key) -> None:
        node = self._nodes.pop(key, None)
        if node is not None:
            del self._buckets[node[_BUCKET]][key]

    def victim(self, evictable: Evictable = always_evictable) -> Key | None:
        nodes, buckets = self._nodes, self._buckets
        for b, bucket in enumerate(buckets):
            skipped: list[Key] = []
            found: Key | None = None
            while bucket:
                key = bucket.popitem(last=False)[0]
                node = nodes[key]
                c = node[_COUNT]
                if c > b:  # hit since it was placed: to the end of its count's bucket
                    node[_BUCKET] = c
                    buckets[c][key] = None
                elif evictable(key):
                    found = key
                    break
                else:
                    skipped.append(key)
            for key in reversed(skipped):  # pinned keys keep their place at the front
                bucket[key] = None
                bucket.move_to_end(key, last=False)
            if found is not None:
                del nodes[found]
                return found
        return None

    def count(self, key: Key) -> int | None:
        """The key's current (aged) count, or None if untracked."""
        node = self._nodes.get(key)
        return None if node is None else node[_COUNT]

    def __len__(self) -> int:
        return len(self._nodes)

    def __contains__(self, key: object) -> bool:
        return key in self._nodes

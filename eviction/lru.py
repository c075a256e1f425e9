"""Least recently used: evict the key whose last insert or hit is oldest."""

from __future__ import annotations

from collections import OrderedDict

from kvpool.eviction.base import Evictable, EvictionPolicy, Key, always_evictable


class LRUPolicy(EvictionPolicy):
    """Recency order in an OrderedDict: oldest first, O(1) per hook."""

    name = "lru"

    def __init__(self) -> None:
        self._order: OrderedDict[Key, None] = OrderedDict()

    def on_insert(self, key: Key, parent: Key | None = None) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def on_access(self, key: Key) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def on_remove(self, key: Key) -> None:
        self._order.pop(key, None)

    def victim(self, evictable: Evictable = always_evictable) -> Key | None:
        for key in self._order:
            if evictable(key):
                del self._order[key]
                return key
        return None

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: object) -> bool:
        return key in self._order

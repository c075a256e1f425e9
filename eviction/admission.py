"""Admission filter: admit a block only on its second sight (a doorkeeper).

Most blocks are never reused; caching them pushes out blocks that would be.
``AdmitOnSecondSight`` wraps any policy: ``admit(key)`` answers False the
first time a key is offered and remembers it in a bounded FIFO history; a
second offer while the key is still remembered answers True (and forgets
it). Every other hook is delegated to the wrapped policy, so the wrapper
keeps the wrapped policy's invariants and eviction order.

Naming: ``make_policy("<base>+admit2")`` wraps policy ``<base>`` (e.g.
``"lru+admit2"``, ``"leaf+admit2"``).

How a tier uses it: call ``admit(key)`` once each time a block that is not
resident would be stored (a miss followed by a store); store the block and
call ``on_insert`` only if it returns True. Do not call ``admit`` for hits.

Invariants: the history holds at most ``max(min_history, history_ratio *
len(self))`` keys, oldest forgotten first; ``admit`` is True only if the
wrapped policy's ``admit`` is True and the key was offered before within the
history window.
Cost: O(1) amortised per call.
"""

from __future__ import annotations

from collections import OrderedDict

from kvpool.eviction.base import Evictable, EvictionPolicy, Key, always_evictable


class AdmitOnSecondSight(EvictionPolicy):
    """Doorkeeper wrapper: first sight is refused, second sight admitted."""

    def __init__(
        self, inner: EvictionPolicy, history_ratio: float = 2.0, min_history: int = 1024
    ) -> None:
        self.inner = inner
        self.name = f"{inner.name}+admit2"
        self.history_ratio = history_ratio
        self.min_history = min_history
        self._seen: OrderedDict[Key, None] = OrderedDict()

    def admit(self, key: Key) -> bool:
        if not self.inner.admit(key):
            return False
        seen = self._seen
        if key in seen:
            del seen[key]
            return True
        seen[key] = None
        limit = max(self.min_history, int(self.history_ratio * len(self.inner)))
        while len(seen) > limit:
            seen.popitem(last=False)
        return False

    def on_insert(self, key: Key, parent: Key | None = None) -> None:
        self._seen.pop(key, None)
        self.inner.on_insert(key, parent)

    def on_access(self, key: Key) -> None:
        self.inner.on_access(key)

    def on_remove(self, key: Key) -> None:
        self.inner.on_remove(key)

    def victim(self, evictable: Evictable = always_evictable) -> Key | None:
        return self.inner.victim(evictable)

    def __len__(self) -> int:
        return len(self.inner)

    def __contains__(self, key: object) -> bool:
        return key in self.inner

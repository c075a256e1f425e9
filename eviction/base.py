"""The one interface every eviction policy implements.

A policy tracks the keys resident in one tier and answers a single question,
``victim()``: which tracked key should leave next. It never touches data; the
tier calls the hooks below under its own lock, so policies need no locking.

Invariants every policy keeps:
- a key is tracked from ``on_insert`` until ``victim`` returns it or
  ``on_remove`` is called for it, and never twice;
- ``victim`` only returns keys for which ``evictable(key)`` is true (keys
  being read are pinned by the tier) and stops tracking the key it returns;
- bookkeeping is O(1) or O(log n) per hook (amortised).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

Key = bytes
Evictable = Callable[[Key], bool]


def always_evictable(_key: Key) -> bool:
    return True


class EvictionPolicy(ABC):
    """Base class: subclasses set ``name`` and implement the four hooks."""

    name: str = ""

    def admit(self, key: Key) -> bool:
        """Admission filter: False means "do not cache this block at all".

        The default admits everything; filters (e.g. admit on second sight)
        override it.
        """
        return True

    @abstractmethod
    def on_insert(self, key: Key, parent: Key | None = None) -> None:
        """``key`` became resident; ``parent`` is the previous block of its prefix."""

    @abstractmethod
    def on_access(self, key: Key) -> None:
        """A resident ``key`` was read (a hit)."""

    @abstractmethod
    def on_remove(self, key: Key) -> None:
        """``key`` left the tier for another reason than ``victim`` (explicit remove)."""

    @abstractmethod
    def victim(self, evictable: Evictable = always_evictable) -> Key | None:
        """Pick, untrack and return the next key to evict; None if none qualifies."""

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __contains__(self, key: object) -> bool: ...

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

How a tier drives a policy:
- a block that is not resident and would be stored: ask ``admit(key)`` once;
  if False, do not store it (and call nothing else); if True, make room with
  ``victim(evictable)`` as needed, then ``on_insert(key, parent)`` on commit,
  where ``parent`` is the key of the previous block of the same prompt (None
  for a prompt's first block) — prefix-aware policies need it;
- a hit (the block is read from this tier): ``on_access(key)``; a prefix
  match should touch its blocks in prompt order;
- a block dropped for any other reason: ``on_remove(key)``.
The parent relation given to ``on_insert`` must be acyclic, as it is for
chained block keys.
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

        Called once per would-be insertion of a non-resident block, never for
        hits. The default admits everything; filters (e.g. admit on second
        sight, ``"<policy>+admit2"``) override it and may remember the key.
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

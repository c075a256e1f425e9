"""Eviction policies behind one interface (installed as ``kvpool.eviction``).

``make_policy(name)`` builds a policy by name; the pool and the cache
simulator take policies only through it.
"""

from __future__ import annotations

from collections.abc import Callable

from kvpool.eviction.base import EvictionPolicy
from kvpool.eviction.lru import LRUPolicy

POLICIES: dict[str, Callable[[], EvictionPolicy]] = {
    "lru": LRUPolicy,
}


def make_policy(name: str) -> EvictionPolicy:
    """A fresh policy instance for ``name``; ValueError names the known ones."""
    try:
        factory = POLICIES[name]
    except KeyError:
        raise ValueError(
            f"unknown eviction policy {name!r}; known: {', '.join(sorted(POLICIES))}"
        ) from None
    return factory()


__all__ = ["POLICIES", "EvictionPolicy", "LRUPolicy", "make_policy"]

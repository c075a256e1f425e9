"""Eviction policies behind one interface (installed as ``kvpool.eviction``).

``make_policy(name)`` builds a policy by name; the pool and the cache
simulator take policies only through it.

Names:
- ``lru``: least recently used;
- ``lfu``: aged LFU (saturating counts, halved periodically);
- ``s3fifo``: S3-FIFO (small / main / ghost FIFO queues);
- ``leaf``: prefix-aware LRU over leaves only (never evicts a block while a
  block extending its prefix is kept);
- ``leaf-s3``: ``leaf`` with S3-FIFO's filter: leaf-first LRU in a
  probation segment (new blocks) and a protected one (blocks hit since);
- ``<base>+admit2``: any of the above behind an admit-on-second-sight filter
  (e.g. ``lru+admit2``, ``leaf+admit2``);
- ``belady``: the offline oracle, for evaluation only; it needs the future
  (``make_policy("belady", requests=..., capacity=...)``) and is not in
  ``ONLINE_POLICIES``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvpool.eviction.admission import AdmitOnSecondSight
from kvpool.eviction.base import EvictionPolicy
from kvpool.eviction.belady import BeladyPolicy
from kvpool.eviction.leaf import LeafPolicy
from kvpool.eviction.leaf_s3 import LeafS3Policy
from kvpool.eviction.lfu import LFUPolicy
from kvpool.eviction.lru import LRUPolicy
from kvpool.eviction.s3fifo import S3FIFOPolicy

ADMIT_SUFFIX = "+admit2"

_BASE: dict[str, Callable[..., EvictionPolicy]] = {
    "lru": LRUPolicy,
    "lfu": LFUPolicy,
    "s3fifo": S3FIFOPolicy,
    "leaf": LeafPolicy,
    "leaf-s3": LeafS3Policy,
}


def _admit2(base: str) -> Callable[..., EvictionPolicy]:
    def factory(**options: Any) -> EvictionPolicy:
        return AdmitOnSecondSight(_BASE[base](**options))

    return factory


#: Every policy by name. Online policies take keyword options of their class;
#: "belady" needs ``requests`` (the future) and optionally ``capacity``.
POLICIES: dict[str, Callable[..., EvictionPolicy]] = {
    **_BASE,
    **{f"{base}{ADMIT_SUFFIX}": _admit2(base) for base in _BASE},
    "belady": BeladyPolicy,
}

#: Names the pool can run (everything except offline oracles), in listing order.
ONLINE_POLICIES: tuple[str, ...] = tuple(name for name in POLICIES if name != "belady")


def make_policy(name: str, **options: Any) -> EvictionPolicy:
    """A fresh policy instance for ``name``; ValueError names the known ones."""
    try:
        factory = POLICIES[name]
    except KeyError:
        raise ValueError(
            f"unknown eviction policy {name!r}; known: {', '.join(POLICIES)}"
        ) from None
    if name == "belady" and "requests" not in options:
        raise ValueError(
            "'belady' is an offline oracle for evaluation: it needs the future, "
            "make_policy('belady', requests=[[key, ...], ...], capacity=N)"
        )
    return factory(**options)


__all__ = [
    "ADMIT_SUFFIX",
    "ONLINE_POLICIES",
    "POLICIES",
    "AdmitOnSecondSight",
    "BeladyPolicy",
    "EvictionPolicy",
    "LFUPolicy",
    "LRUPolicy",
    "LeafPolicy",
    "LeafS3Policy",
    "S3FIFOPolicy",
    "make_policy",
]

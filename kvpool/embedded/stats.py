"""Counters a pool keeps; ``snapshot`` turns them into the dict ``Pool.stats()`` returns."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvpool.bindings import stream_copy
from kvpool.storage.memory_tier import DramTier
from kvpool.storage.ssd_tier import SsdTier

TIER_NAMES = ("gpu", "dram", "ssd")


def _per_tier() -> dict[str, int]:
    return dict.fromkeys(TIER_NAMES, 0)


@dataclass
class PoolStats:
    """Plain counters, mutated under the pool's lock."""

    puts: int = 0
    bytes_written: int = 0
    hits: int = 0
    misses: int = 0
    bytes_read: int = 0
    removes: int = 0
    promotions: int = 0
    not_admitted: int = 0
    corrupt_dropped: int = 0
    ssd_errors: int = 0
    # Per-tier counts in exact dicts holding every tier name: ``d[name] += 1`` on
    # a plain dict is ~45 ns, on a Counter (a dict subclass) ~110 ns, once per put
    # and per get.
    tier_hits: dict[str, int] = field(default_factory=_per_tier)
    tier_puts: dict[str, int] = field(default_factory=_per_tier)
    tier_evictions: dict[str, int] = field(default_factory=_per_tier)
    tier_demotions: dict[str, int] = field(default_factory=_per_tier)

    def count_eviction(self, tier: str) -> None:
        self.tier_evictions[tier] += 1

    def count_demotion(self, tier: str) -> None:
        self.tier_demotions[tier] += 1

    def snapshot(self, tiers: list[Any], blocks: int, policy: str) -> dict[str, Any]:
        lookups = self.hits + self.misses
        return {
            "mode": "embedded",
            "transport": "local",
            "policy": policy,
            "blocks": blocks,
            "puts": self.puts,
            "bytes_written": self.bytes_written,
            "hits": self.hits,
            "misses": self.misses,
            "hit_ratio": self.hits / lookups if lookups else 0.0,
            "bytes_read": self.bytes_read,
            "removes": self.removes,
            "promotions": self.promotions,
            "not_admitted": self.not_admitted,
            "corrupt_dropped": self.corrupt_dropped,
            "ssd_errors": self.ssd_errors,
            "tiers": {tier.name: self._tier_snapshot(tier) for tier in tiers},
        }

    def _tier_snapshot(self, tier: Any) -> dict[str, Any]:
        snap = {
            "capacity_bytes": tier.capacity,
            "used_bytes": tier.allocator.used_bytes,
            "blocks": len(tier.policy),
            "puts": self.tier_puts[tier.name],
            "hits": self.tier_hits[tier.name],
            "evictions": self.tier_evictions[tier.name],
            "demotions": self.tier_demotions[tier.name],
        }
        if isinstance(tier, DramTier):
            snap["page_lock"] = tier.page_lock  # "registered", or why the arena is pageable
            snap["copy"] = stream_copy.status()  # streaming stores for large blocks, or why not
        elif isinstance(tier, SsdTier):
            snap["write_wait"] = tier.write_wait()  # small writes waited for awake, or asleep
            snap["read_ways"] = tier.piece_choice.describe()  # large reads: pieces or whole
        return snap

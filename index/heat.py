"""Read heat: an exponentially decayed read count per block, and the replication rule.

``heat`` halves every ``half_life_s`` without reads and grows by one per
read, so it approximates reads per half-life. A block whose heat reaches
``hot_reads`` gets one more replica (up to ``max_replicas``); a block whose
extra replicas exist but whose heat fell below ``cool_reads`` loses them.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ReplicationConfig:
    hot_reads: float = 8.0
    cool_reads: float = 2.0
    half_life_s: float = 10.0
    max_replicas: int = 3
    enabled: bool = True


def decayed(heat: float, since: float, now: float, half_life_s: float) -> float:
    """``heat`` measured at ``since``, as seen at ``now``."""
    if now <= since:
        return heat
    return heat * 0.5 ** ((now - since) / half_life_s)

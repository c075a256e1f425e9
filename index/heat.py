"""Read heat: an exponentially decayed read count per block, and the replication rule.

``heat`` halves every ``half_life_s`` without reads and grows by one per
read, so it approximates reads per half-life. A block whose heat reaches
``hot_reads`` gets one more replica (up to ``max_replicas``); a block whose
extra replicas exist but whose heat fell below ``cool_reads`` loses them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class ReplicationConfig:
    """The replication rule's settings. Invariant (checked here, so the master never
    runs with a rule that flaps): ``0 <= cool_reads < hot_reads``, all finite -- a
    block that earned a replica keeps it until its heat falls clearly below what
    earned it; ``half_life_s`` > 0; ``max_replicas`` >= 1."""

    hot_reads: float = 8.0
    cool_reads: float = 2.0
    half_life_s: float = 10.0
    max_replicas: int = 3
    enabled: bool = True

    def __post_init__(self) -> None:
        if not (0.0 <= self.cool_reads < self.hot_reads < math.inf):  # also refuses nan
            raise ValueError(
                "replication needs 0 <= cool reads < hot reads (finite), got "
                f"cool {self.cool_reads!r}, hot {self.hot_reads!r}"
            )
        if not 0.0 < self.half_life_s < math.inf:
            raise ValueError(f"the read-heat half-life must be > 0 s, got {self.half_life_s!r}")
        if self.max_replicas < 1:
            raise ValueError(f"max_replicas must be >= 1, got {self.max_replicas!r}")


def decayed(heat: float, since: float, now: float, half_life_s: float) -> float:
    """``heat`` measured at ``since``, as seen at ``now``."""
    if now <= since:
        return heat
    return heat * 0.5 ** ((now - since) / half_life_s)

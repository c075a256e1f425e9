"""What a node must learn about its own region, as typed events.

The catalog decides placement; the node holding the bytes only hears about
it afterwards, through heartbeat replies. Each node's events are queued in
the order the catalog made the changes and handed out, oldest first, by
``BlockCatalog.drain_events`` (exactly once each). Replaying them in order
tells the node which of its ranges hold which committed block, so it can
re-register those blocks after a master restart.

Invariants:
- a ``RangeFreed`` only ever follows the ``BlockCommitted`` (or restored
  block) that filled the range; a range is never reused before its free is
  queued, so a node replaying in order never forgets a live block;
- each ``BlockCommitted`` / ``RangeFreed`` names the allocation that filled
  the range (0: unknown, a re-registered block): a node applies it only to
  that allocation's entry, so a late event about a block that was removed
  and re-put into the same range (same key, same offset) never touches the
  newer block (kvpool.cluster.block_table);
- events carry no wire format: the master turns them into the heartbeat
  payload in one place (kvpool.cluster.master.nodes.event_wire).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BlockCommitted:
    """``key`` is now visible, its bytes at ``offset`` (``size`` bytes) on the node."""

    key: bytes
    offset: int
    size: int
    parent: bytes | None
    alloc_id: int = 0  # the allocation that filled the range (0: unknown)


@dataclass(frozen=True)
class RangeFreed:
    """The block at ``offset`` is gone from the node's DRAM: its range may be reused."""

    offset: int
    alloc_id: int = 0  # the allocation whose block is gone (0: unknown)


@dataclass(frozen=True)
class SsdCopyDropped:
    """The node's SSD copy of ``key`` is no longer wanted (removed or demoted extra)."""

    key: bytes


NodeEvent = BlockCommitted | RangeFreed | SsdCopyDropped

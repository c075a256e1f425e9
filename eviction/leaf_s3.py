"""Prefix-aware S3-FIFO: leaf-first LRU in a probation and a protected segment.

``leaf`` alone treats a one-off document's blocks like a live conversation's.
This policy adds S3-FIFO's filter (Yang et al., SOSP 2023) on top of the
leaf rule:
- a new block enters *probation*; a block that is hit moves to *protected*
  (its reuse is proven); a block that was evicted from probation recently
  (remembered by key in a bounded ghost FIFO) enters protected directly;
- when room is needed and probation holds at least ``small_ratio`` of the
  tracked blocks (or protected has no evictable leaf), the least recently
  used probation *leaf* is evicted (and remembered in the ghost); otherwise
  the least recently used protected *leaf* is evicted;
- as in ``leaf``, only leaves are ever evicted: a block stays while any
  tracked block names it as parent.

So documents read once drain out of probation quickly, while the proven
prefix of a conversation (everything but its newest blocks) waits in
protected for the next turn, and is unwound from the tail.

Invariants (beyond the base class's):
- every tracked key is in exactly one segment; probation + protected =
  tracked; the ghost holds only untracked keys, at most ``max(1,
  ghost_ratio * len(protected))`` of them;
- ``victim`` only returns keys no tracked key names as parent (acyclic
  parent relation assumed, as chained keys are);
- within a segment, the evicted leaf is the least recently used one.
Cost: as ``leaf`` (``LeafForest`` with two segments): O(1) per hit, O(1)
plus O(log h) per insert and victim, h = blocks waiting to be re-ordered.
"""

from __future__ import annotations

from collections import OrderedDict

from kvpool.eviction.base import Evictable, Key, always_evictable
from kvpool.eviction.leaf import _IN_HEAP, _IN_ORDER, ForestPolicy, LeafForest

PROBATION, PROTECTED = 0, 1


class LeafS3Policy(ForestPolicy):
    """Leaf-only LRU in two segments (probation / protected) plus a ghost FIFO."""

    name = "leaf-s3"

    def __init__(self, small_ratio: float = 0.1, ghost_ratio: float = 1.0) -> None:
        if not 0.0 < small_ratio < 1.0:
            raise ValueError("small_ratio must be in (0, 1)")
        self.small_ratio = small_ratio
        self.ghost_ratio = ghost_ratio
        self._forest = LeafForest(2)
        self._ghost: OrderedDict[Key, None] = OrderedDict()

    def on_insert(self, key: Key, parent: Key | None = None) -> None:
        forest = self._forest
        node = forest.nodes.get(key)
        if node is not None:
            forest.touch(key, node, node.seg)
            return
        seg = PROBATION
        if key in self._ghost:
            del self._ghost[key]
            seg = PROTECTED
        forest.insert(key, parent, seg)

    def on_access(self, key: Key) -> None:
        forest = self._forest
        node = forest.nodes.get(key)
        if node is None:
            return
        if node.seg == PROTECTED:  # the common case, inlined
            forest.tick += 1
            node.tick = forest.tick
            where = node.where
            if where == _IN_ORDER:
                forest.order[PROTECTED].move_to_end(key)
            elif where == _IN_HEAP:
                node.where = _IN_ORDER
                forest.order[PROTECTED][key] = None
        else:
            forest.touch(key, node, PROTECTED)

    def victim(self, evictable: Evictable = always_evictable) -> Key | None:
        forest = self._forest
        sizes = forest.sizes
        first = PROBATION
        if sizes[PROBATION] < self.small_ratio * len(forest.nodes) and sizes[PROTECTED]:
            first = PROTECTED
        for seg in (first, 1 - first):
            key = forest.lru_leaf(seg, evictable)
            if key is not None:
                if seg == PROBATION:
                    ghost = self._ghost
                    ghost[key] = None
                    limit = max(1, int(self.ghost_ratio * sizes[PROTECTED]))
                    while len(ghost) > limit:
                        ghost.popitem(last=False)
                return key
        return None

    def segment(self, key: Key) -> str | None:
        """'probation', 'protected', 'ghost' or None (for tests)."""
        node = self._forest.nodes.get(key)
        if node is not None:
            return ("probation", "protected")[node.seg]
        return "ghost" if key in self._ghost else None

"""Prefix-aware "leaf first" eviction: never evict a block whose extension is kept.

A block's key chains over its whole prefix, so a kept block is useless once
its parent is gone (a prefix match stops at the first miss). This policy
therefore only ever evicts *leaves*: tracked keys that no tracked key names
as its parent (``on_insert(key, parent)``). Among the evictable leaves it
evicts the least recently used (insert or hit). An internal block becomes a
leaf again when its last tracked child leaves, and then competes with its
own last-use time — so a popular system prompt shared by many sessions
outlives the sessions' tails, and an idle conversation is unwound from its
tail towards its root.

Invariants (beyond the base class's):
- ``children(k)`` equals the number of tracked keys whose declared parent is
  ``k``, counted even while ``k`` itself is untracked, so a parent inserted
  after its children (e.g. after an admission filter dropped it) still
  knows them; the parent relation must be acyclic, as chained keys are;
- ``victim`` only returns keys with ``children(k) == 0``: it never evicts a
  block while a block extending its prefix is tracked. Keys removed with
  ``on_remove`` may leave children behind (explicit removes are obeyed);
- among evictable leaves, ``victim`` returns the one whose last insert or
  hit is oldest (exactly).

Implementation (``LeafForest``): leaves live in an insertion-ordered dict
kept in last-use order (a hit moves a leaf to the end, O(1)); a block that
becomes a leaf again when its last child leaves is out of order there, so it
waits in a small heap keyed by its last use instead (until its next hit
moves it to the ordered dict). The victim is the older of the two fronts.
In the usual unwinding of an idle chain the re-leafed parent is the next
victim, so the heap stays small. Hits are O(1); inserts and victims O(1)
plus O(log h) for the heap of re-leafed blocks.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict

from kvpool.eviction.base import Evictable, EvictionPolicy, Key, always_evictable

# where a key waits: in its segment's ordered dict, in its heap, or nowhere (internal)
_IN_ORDER, _IN_HEAP, _INTERNAL = 0, 1, 2


class Node:
    """Per-key state of a tracked block."""

    __slots__ = ("kids", "parent", "seg", "tick", "where")

    def __init__(self, tick: int, parent: Key | None, where: int, kids: int, seg: int) -> None:
        self.tick = tick
        self.parent = parent
        self.where = where
        self.kids = kids
        self.seg = seg


class LeafForest:
    """The prefix forest with leaves in per-segment last-use order.

    Segments let subclasses keep several independent LRU orders of leaves
    (``leaf-s3`` uses probation and protected); ``LeafPolicy`` uses one.
    """

    def __init__(self, segments: int = 1) -> None:
        self.nodes: dict[Key, Node] = {}
        self.orphans: dict[Key, int] = {}  # untracked key -> tracked children (> 0)
        self.order: list[OrderedDict[Key, None]] = [OrderedDict() for _ in range(segments)]
        self.heaps: list[list[tuple[int, Key]]] = [[] for _ in range(segments)]
        self.sizes = [0] * segments
        self.tick = 0

    def insert(self, key: Key, parent: Key | None, seg: int) -> None:
        """Track a new key (caller checks it is untracked) in segment ``seg``."""
        if parent == key:
            parent = None
        self.tick += 1
        kids = self.orphans.pop(key, 0)
        node = Node(self.tick, parent, _INTERNAL if kids else _IN_ORDER, kids, seg)
        self.nodes[key] = node
        self.sizes[seg] += 1
        if not kids:
            self.order[seg][key] = None
        if parent is not None:
            pnode = self.nodes.get(parent)
            if pnode is None:
                self.orphans[parent] = self.orphans.get(parent, 0) + 1
            else:
                pnode.kids += 1
                where = pnode.where
                if where == _IN_ORDER:
                    del self.order[pnode.seg][parent]
                pnode.where = _INTERNAL  # a heap entry, if any, goes stale

    def touch(self, key: Key, node: Node, seg: int) -> None:
        """A use of tracked ``key``: stamp it, move it to segment ``seg``'s end."""
        self.tick += 1
        node.tick = self.tick
        old = node.seg
        if old != seg:
            self.sizes[old] -= 1
            self.sizes[seg] += 1
            node.seg = seg
        where = node.where
        if where == _IN_ORDER:
            if old == seg:
                self.order[seg].move_to_end(key)
            else:
                del self.order[old][key]
                self.order[seg][key] = None
        elif where == _IN_HEAP:
            node.where = _IN_ORDER
            self.order[seg][key] = None

    def untrack(self, key: Key) -> Node:
        node = self.nodes.pop(key)
        self.sizes[node.seg] -= 1
        if node.where == _IN_ORDER:
            self.order[node.seg].pop(key, None)
        if node.kids:
            self.orphans[key] = node.kids
        parent = node.parent
        if parent is not None:
            pnode = self.nodes.get(parent)
            if pnode is None:
                n = self.orphans[parent] - 1
                if n:
                    self.orphans[parent] = n
                else:
                    del self.orphans[parent]
            else:
                pnode.kids -= 1
                if not pnode.kids:  # a leaf again, out of last-use order
                    pnode.where = _IN_HEAP
                    heap = self.heaps[pnode.seg]
                    heapq.heappush(heap, (pnode.tick, parent))
                    if len(heap) > 2 * len(self.nodes) + 64:
                        self._compact(pnode.seg)
        return node

    def _compact(self, seg: int) -> None:
        nodes = self.nodes
        live = []
        for t, k in self.heaps[seg]:
            node = nodes.get(k)
            if node is not None and node.where == _IN_HEAP and node.tick == t:
                live.append((t, k))
        heapq.heapify(live)
        self.heaps[seg] = live

    def lru_leaf(self, seg: int, evictable: Evictable) -> Key | None:
        """Untrack and return the least recently used evictable leaf of ``seg``."""
        order, heap, nodes = self.order[seg], self.heaps[seg], self.nodes
        while heap:  # drop stale heap entries from the top
            t, k = heap[0]
            node = nodes.get(k)
            if node is not None and node.where == _IN_HEAP and node.tick == t:
                break
            heapq.heappop(heap)
        if evictable is always_evictable:  # fast path: nothing pinned
            if heap and (not order or heap[0][0] < nodes[next(iter(order))].tick):
                key = heapq.heappop(heap)[1]
            elif order:
                key = order.popitem(last=False)[0]
                nodes[key].where = _INTERNAL  # already out of the ordered dict
            else:
                return None
            self.untrack(key)
            return key
        skipped: list[tuple[int, Key]] = []
        found: Key | None = None
        it = iter(order)
        front = next(it, None)
        while True:
            while heap:
                t, k = heap[0]
                node = nodes.get(k)
                if node is not None and node.where == _IN_HEAP and node.tick == t:
                    break
                heapq.heappop(heap)
            if front is None and not heap:
                break
            if heap and (front is None or heap[0][0] < nodes[front].tick):
                entry = heapq.heappop(heap)
                if evictable(entry[1]):
                    found = entry[1]
                    break
                skipped.append(entry)
            else:
                assert front is not None
                if evictable(front):
                    found = front
                    break
                front = next(it, None)
        for entry in skipped:
            heapq.heappush(heap, entry)
        if found is not None:
            self.untrack(found)
        return found

    def children(self, key: Key) -> int:
        node = self.nodes.get(key)
        return node.kids if node is not None else self.orphans.get(key, 0)


class ForestPolicy(EvictionPolicy):
    """What every policy kept in a ``LeafForest`` shares (``leaf``, ``leaf-s3``)."""

    _forest: LeafForest

    def on_remove(self, key: Key) -> None:
        if key in self._forest.nodes:
            self._forest.untrack(key)

    def children(self, key: Key) -> int:
        """Number of tracked keys that name ``key`` as their parent."""
        return self._forest.children(key)

    def __len__(self) -> int:
        return len(self._forest.nodes)

    def __contains__(self, key: object) -> bool:
        return key in self._forest.nodes


class LeafPolicy(ForestPolicy):
    """LRU over the leaves of the prefix forest."""

    name = "leaf"

    def __init__(self) -> None:
        self._forest = LeafForest(1)

    def on_insert(self, key: Key, parent: Key | None = None) -> None:
        node = self._forest.nodes.get(key)
        if node is not None:
            self._forest.touch(key, node, 0)
        else:
            self._forest.insert(key, parent, 0)

    def on_access(self, key: Key) -> None:
        forest = self._forest
        node = forest.nodes.get(key)
        if node is None:
            return
        forest.tick += 1
        node.tick = forest.tick
        where = node.where
        if where == _IN_ORDER:
            forest.order[0].move_to_end(key)
        elif where == _IN_HEAP:
            node.where = _IN_ORDER
            forest.order[0][key] = None

    def victim(self, evictable: Evictable = always_evictable) -> Key | None:
        return self._forest.lru_leaf(0, evictable)

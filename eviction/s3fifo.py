"""S3-FIFO (Yang et al., SOSP 2023): small, main and ghost FIFO queues.

New keys enter the small queue S (about ``small_ratio`` of the tracked keys),
unless the ghost queue G remembers them from a recent eviction out of S, in
which case they go straight to the main queue M. Hits only bump a 2-bit
counter (no reordering). When room is needed:
- if S holds at least ``small_ratio`` of the tracked keys (or M is empty),
  S's oldest key is examined: if it was hit since it entered S it moves to
  M (counter reset), otherwise it is evicted and remembered in G — so
  one-hit wonders leave quickly, before anything in M;
- otherwise M's oldest key is examined: with a non-zero counter it is
  re-queued at M's tail with the counter decremented, else it is evicted.
G is a FIFO of keys only, bounded by the size of M.

The policy is not told the capacity: "S is full" is judged against the
number of tracked keys, which equals the capacity whenever the tier is full
(the only time ``victim`` is called).

Invariants (beyond the base class's): every tracked key is in exactly one
of S and M; G holds only untracked keys; counters stay in 0..3.
Cost: O(1) amortised per hook (each key moves S→M at most once per stay and
is re-queued in M at most 3 times per hit).
"""

from __future__ import annotations

from collections import OrderedDict

from kvpool.eviction.base import Evictable, EvictionPolicy, Key, always_evictable

_MAX_FREQ = 3


class S3FIFOPolicy(EvictionPolicy):
    """Small/main/ghost FIFOs with a saturating 2-bit hit counter per key."""

    name = "s3fifo"

    def __init__(self, small_ratio: float = 0.1, ghost_ratio: float = 1.0) -> None:
        if not 0.0 < small_ratio < 1.0:
            raise ValueError("small_ratio must be in (0, 1)")
        self.small_ratio = small_ratio
        self.ghost_ratio = ghost_ratio
        self._small: OrderedDict[Key, None] = OrderedDict()
        self._main: OrderedDict[Key, None] = OrderedDict()
        self._ghost: OrderedDict[Key, None] = OrderedDict()
        self._freq: dict[Key, int] = {}

    def on_insert(self, key: Key, parent: Key | None = None) -> None:
        if key in self._freq:
            self._small.pop(key, None)
            self._main.pop(key, None)
        self._freq[key] = 0
        if key in self._ghost:
            del self._ghost[key]
            self._main[key] = None
        else:
            self._small[key] = None

    def on_access(self, key: Key) -> None:
        f = self._freq.get(key)
        if f is not None and f < _MAX_FREQ:
            self._freq[key] = f + 1

    def on_remove(self, key: Key) -> None:
        if self._freq.pop(key, None) is not None:
            self._small.pop(key, None)
            self._main.pop(key, None)

    def _remember(self, key: Key) -> None:
        ghost = self._ghost
        ghost[key] = None
        limit = max(1, int(self.ghost_ratio * len(self._main)))
        while len(ghost) > limit:
            ghost.popitem(last=False)

    def victim(self, evictable: Evictable = always_evictable) -> Key | None:
        small, main, freq = self._small, self._main, self._freq
        # Pinned keys go to the back of their queue and are counted; once a
        # whole queue was skipped it is not examined again in this call. Each
        # other pass evicts, moves a key S→M (once per key) or decrements a
        # counter (at most 3 per key), so the loop ends.
        small_skips = main_skips = 0
        while True:
            small_open = small_skips < len(small)
            main_open = main_skips < len(main)
            if small_open and (len(small) >= self.small_ratio * len(freq) or not main_open):
                key, _ = small.popitem(last=False)
                if freq[key] > 0:
                    freq[key] = 0
                    main[key] = None
                elif not evictable(key):
                    small[key] = None
                    small_skips += 1
                else:
                    del freq[key]
                    self._remember(key)
                    return key
            elif main_open:
                key, _ = main.popitem(last=False)
                f = freq[key]
                if f > 0:
                    freq[key] = f - 1
                    main[key] = None
                elif not evictable(key):
                    main[key] = None
                    main_skips += 1
                else:
                    del freq[key]
                    return key
            else:
                return None

    def queue_of(self, key: Key) -> str | None:
        """'small', 'main', 'ghost' or None: where the key is now (for tests)."""
        if key in self._small:
            return "small"
        if key in self._main:
            return "main"
        if key in self._ghost:
            return "ghost"
        return None

    def __len__(self) -> int:
        return len(self._freq)

    def __contains__(self, key: object) -> bool:
        return key in self._freq

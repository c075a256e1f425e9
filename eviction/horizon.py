"""Keep-for-H bound: how far a policy that only sees a block's age can go.

The model. A *keep-for-H* policy keeps every block for ``H`` seconds after
each use of it and then drops it. For each use of a block (a request that
contains it) let ``gap`` be the time to that block's next use (none: the
use is the block's last). Then, over a trace of duration ``T``:

- ``hits(H)`` = the number of uses whose next use comes within ``H``
  (``gap <= H``): those next uses find the block;
- ``occ(H)`` = ``sum(min(gap, H)) / T``: the time-averaged number of blocks
  kept (block-seconds over seconds). A last use is kept for
  ``min(H, time left to the trace's end)``; with a *reuse oracle* a block
  that is never used again costs nothing (only reused uses count in occ).

Keeping only a share ``s`` of the blocks (say by hash) scales both by
``s``, and mixing shares kept for different ``H`` mixes the points, so the
best such policy at capacity ``C`` blocks reaches the upper concave hull of
the points ``(occ(H), hits(H))`` and ``(0, 0)``, evaluated at ``C`` (flat
beyond the last point). Divided by the trace's blocks it is a hit ratio,
comparable to ``kvpool cachesim``'s block prefix-hit ratio. ``hits`` only
jumps at gap values and ``occ`` grows between them, so evaluating ``H`` at
``0``, at every distinct gap and at infinity gives the exact hull over all
``H`` (no grid).

Why it is optimistic (an upper figure for keep-for-H policies, not a proof
about every online policy):

- capacity is met on time average only, not at every instant;
- uses are counted one by one, while the prefix-hit ratio stops at a
  request's first miss. With chained keys (a block's key fixes its whole
  prefix, as ``kvpool.index.keys.block_keys`` makes them) a single ``H``
  hits whole prefixes, so each point is exact; only the mixtures (a share
  of blocks kept, chosen block by block) can hit a deep block whose parent
  was not kept, and count it;
- the reuse oracle (``reuse_oracle=True``) is free knowledge of which
  blocks are never used again.

What it does not cover: policies that tell blocks apart by more than their
age (which session, how deep, how often used). On traces where a session's
next turn is unpredictable from what came before (IID think times, a
memoryless number of turns), age is the main signal there is, which is what
makes the figure a useful yardstick.

Invariants (tested): the result rises with capacity; capacity 0 gives 0;
the oracle figure is at least the plain one; neither exceeds the
infinite-capacity prefix-hit ratio for chained keys (``hits(inf)`` is then
exactly the infinite-capacity prefix hits).
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Sequence
from itertools import accumulate, pairwise

__all__ = ["keep_for_h_bound", "keep_for_h_points", "use_gaps"]


def _check(requests: Sequence[Sequence[bytes]], timestamps_s: Sequence[float]) -> None:
    if len(requests) != len(timestamps_s):
        raise ValueError(
            f"requests and timestamps_s differ in length ({len(requests)} != {len(timestamps_s)})"
        )
    prev = -math.inf
    for i, t in enumerate(timestamps_s):
        if not math.isfinite(t):
            raise ValueError(f"timestamps_s[{i}] is not finite ({t!r})")
        if t < prev:
            raise ValueError(
                f"timestamps_s must be sorted (non-decreasing): [{i}] = {t} < [{i - 1}] = {prev}"
            )
        prev = t


def use_gaps(
    requests: Sequence[Sequence[bytes]], timestamps_s: Sequence[float]
) -> tuple[list[float], list[float]]:
    """Per use of a block (a distinct key of a request): ``(gaps, tails)``.

    ``gaps``: time to the block's next use, for the uses that have one;
    ``tails``: time from the block's last use to the trace's last timestamp.
    ``len(gaps) + len(tails)`` is the number of uses; both unsorted.
    """
    _check(requests, timestamps_s)
    gaps: list[float] = []
    tails: list[float] = []
    if not requests:
        return gaps, tails
    end = timestamps_s[-1]
    next_use: dict[bytes, float] = {}
    for i in range(len(requests) - 1, -1, -1):
        t = timestamps_s[i]
        for key in set(requests[i]):
            nxt = next_use.get(key)
            if nxt is None:
                tails.append(end - t)
            else:
                gaps.append(nxt - t)
            next_use[key] = t
    return gaps, tails


def keep_for_h_points(
    gaps: Sequence[float], tails: Sequence[float], duration_s: float, reuse_oracle: bool
) -> list[tuple[float, int]]:
    """``(occ(H), hits(H))`` for H = 0, every distinct gap, and infinity.

    ``occ`` is in blocks (block-seconds over ``duration_s``; a zero duration
    makes every occupancy 0). Sorted by H, so both coordinates rise.
    """
    g = sorted(gaps)
    prefix = [0.0, *accumulate(g)]  # prefix[k] = sum of the k smallest gaps
    tl = [] if reuse_oracle else sorted(tails)
    tprefix = [0.0, *accumulate(tl)]
    scale = 1.0 / duration_s if duration_s > 0 else 0.0

    def block_seconds(h: float) -> tuple[float, int]:
        k = bisect_right(g, h)  # gaps <= h: hits, kept for their gap
        j = bisect_right(tl, h)
        total = prefix[k] + tprefix[j]
        if h != math.inf:
            total += h * ((len(g) - k) + (len(tl) - j))
        return total, k

    hs = [0.0, *sorted(set(g)), math.inf]
    points: list[tuple[float, int]] = []
    for h in hs:
        seconds, hits = block_seconds(h)
        points.append((seconds * scale, hits))
    return points


def _upper_hull(points: Sequence[tuple[float, int]]) -> list[tuple[float, float]]:
    """Upper concave hull of ``points`` and (0, 0), up to the highest point."""
    pts = sorted({(0.0, 0.0), *((float(o), float(h)) for o, h in points)})
    hull: list[tuple[float, float]] = []
    for p in pts:
        if hull and p[1] <= hull[-1][1]:
            continue  # no more hits for more room: dominated (the hull is flat here)
        while len(hull) >= 2:
            (x1, y1), (x2, y2) = hull[-2], hull[-1]
            # drop the middle point unless it lies strictly above the chord
            if (y2 - y1) * (p[0] - x1) <= (p[1] - y1) * (x2 - x1):
                hull.pop()
            else:
                break
        if hull and p[0] == hull[-1][0]:
            hull.pop()  # same room, more hits
        hull.append(p)
    return hull


def _hull_at(hull: Sequence[tuple[float, float]], c: float) -> float:
    for (x1, y1), (x2, y2) in pairwise(hull):
        if c <= x2:
            return y1 + (y2 - y1) * (c - x1) / (x2 - x1)
    return hull[-1][1]


def keep_for_h_bound(
    requests: Sequence[Sequence[bytes]],
    timestamps_s: Sequence[float],
    capacities: Sequence[int],
    reuse_oracle: bool = False,
) -> list[float]:
    """Best keep-for-H hit ratio at each capacity (blocks), see the module doc.

    ``requests``: each request's block keys, in trace order (as
    ``cachesim.trace_keys`` makes them); ``timestamps_s``: their arrival
    times, non-decreasing (any unit works, occupancy is unit-free; seconds
    by convention). Returns one hit ratio per capacity: hits over the total
    number of blocks of all requests (the simulator's denominator).

    Raises ``ValueError`` on a length mismatch, unsorted or non-finite
    timestamps, or a negative capacity.
    """
    for c in capacities:
        if c < 0:
            raise ValueError(f"capacities must be >= 0, got {c}")
    gaps, tails = use_gaps(requests, timestamps_s)
    total = sum(len(keys) for keys in requests)
    if total == 0:
        return [0.0 for _ in capacities]
    duration = timestamps_s[-1] - timestamps_s[0]
    hull = _upper_hull(keep_for_h_points(gaps, tails, duration, reuse_oracle))
    return [_hull_at(hull, c) / total if c > 0 else 0.0 for c in capacities]

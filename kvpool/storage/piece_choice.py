"""Whether the SSD tier reads a block of each size in pieces or in one read, learned
from its first reads.

Why: a read in pieces (``kvpool.storage.piece_read``) lets the tier hash (and copy
on) piece k while later pieces still read, but each landed piece costs a wake-up
of the reader, and where the device completes all pieces together nothing is
overlapped. Which wins is the disk's (issue 17, bench/RESULTS.md "Session 39" and
"Session 42"): on the Intel VM class pieces read 1 MiB at 0.85-0.95x a raw
O_DIRECT read against 0.83-0.88x whole and 16 MiB at 0.97x against 0.91x; on the
AMD EPYC class, whose virtual disk completes a read's pieces within microseconds of
each other up to 4 MiB, one read ran 1 / 2 / 4 MiB at 0.96-1.02 / 0.95-1.02 /
0.90-1.01x and pieces 0.92-1.09 / 0.88-0.97 / 0.82-0.92x, while at 16 MiB pieces
still won (0.96-0.98x against 0.92-0.955x). No fixed size is right on both.

Sizes fall in power-of-two classes (all sizes with the same ``int.bit_length()``)
from ``PIECED_MIN`` up. A class's first ``2 * TRIALS`` reads go in pairs, one each
way in an order a coin decides, each timed from its submission to its verdict
(the read, the hash, and a hit's copy on to the caller's buffer: whatever the way
changes); then the class settles for the life of the tier on pieces unless one
read's median time per byte beat them by more than ``MARGIN``. A read that raised
or failed its checksum is not a sample. ``$KVPOOL_SSD_READS=pieces`` (or ``whole``)
fixes every class's way instead, nothing learned (``learn``, the default, learns).

Invariants:
- the way never changes what a read returns: both read the same range into the
  same buffer and verify it against the same checksum;
- ``ways[k]`` is ``PIECES``, ``WHOLE`` or ``LEARN`` for sizes with bit_length ``k``;
  a class leaves ``LEARN`` once, and its way never changes after that.

Thread-safe: ``SsdTier.read_into`` runs outside the pool's lock. ``ways`` is read
without a lock (a list item: one atomic load) and written once per class under
``_lock``; trial samples are appended without it (two readers finishing together
settle the class once).
"""

from __future__ import annotations

import os
import random
import threading
import time
from collections.abc import Callable
from statistics import median

from kvpool.config import format_size
from kvpool.storage.piece_read import PIECED_MIN

PIECES, WHOLE, LEARN = 0, 1, 2

#: timed reads each way before a class settles (medians of 16: a read that waited
#: behind another process's I/O moves neither).
TRIALS = 16
#: pieces are kept unless one read beat them by more than this factor.
MARGIN = 1.02

#: ``read(pieced)``: the read one way or the other; True when the block verified.
Read = Callable[[bool], bool]

_ENV_WAYS = {"pieces": PIECES, "whole": WHOLE, "learn": LEARN}


def way_from_env() -> int:
    """``$KVPOOL_SSD_READS``: ``PIECES``, ``WHOLE`` or ``LEARN`` (unset)."""
    text = os.environ.get("KVPOOL_SSD_READS", "learn")
    way = _ENV_WAYS.get(text.strip().lower())
    if way is None:
        raise ValueError(f"$KVPOOL_SSD_READS must be one of {', '.join(_ENV_WAYS)}, not {text!r}")
    return way


class PieceChoice:
    """The way each size class reads, and the timed trials of the classes learning."""

    def __init__(
        self,
        way: int = LEARN,
        *,
        trials: int = TRIALS,
        clock: Callable[[], int] = time.perf_counter_ns,
        coin: Callable[[], bool] | None = None,
    ) -> None:
        if trials < 1:
            raise ValueError(f"trials must be at least 1, got {trials}")
        if way not in (PIECES, WHOLE, LEARN):
            raise ValueError(f"way must be PIECES, WHOLE or LEARN, not {way!r}")
        first = PIECED_MIN.bit_length()
        self.ways = [WHOLE if k < first else way for k in range(65)]
        self._fixed = way != LEARN  # $KVPOOL_SSD_READS: no class learns
        self._trials = trials
        self._clock = clock
        self._coin = coin or _seeded_coin()
        self._lock = threading.Lock()
        # per learning class: ns per byte of its timed reads, (in pieces, whole)
        self._samples: dict[int, tuple[list[float], list[float]]] = {
            k: ([], []) for k in range(first, 65)
        }
        self._speeds: dict[int, float] = {}  # settled class -> pieces' speed / one read's

    def run(self, nbytes: int, read: Read) -> bool:
        """``read(pieced)`` for a read of ``nbytes`` (from ``PIECED_MIN``), the way
        its class settled on, or timed as one of its trials while it learns."""
        k = nbytes.bit_length()
        way = self.ways[k]
        if way != LEARN:
            return read(way == PIECES)
        pieced_ns, whole_ns = self._samples[k]
        # trials go in pairs, one read each way, the first of each pair by a coin
        # toss: a disturbance that recurs every other read falls on both ways alike
        n_pieced, n_whole = len(pieced_ns), len(whole_ns)
        pieced = self._coin() if n_pieced == n_whole else n_pieced < n_whole
        start = self._clock()
        valid = read(pieced)
        if valid:
            (pieced_ns if pieced else whole_ns).append((self._clock() - start) / nbytes)
            if len(pieced_ns) >= self._trials and len(whole_ns) >= self._trials:
                self._settle(k)
        return valid

    def _settle(self, k: int) -> None:
        with self._lock:
            if self.ways[k] != LEARN:
                return
            pieced_ns, whole_ns = self._samples[k]
            pieced, whole = median(pieced_ns), median(whole_ns)
            speed = whole / pieced if pieced > 0 else float("inf")
            self._speeds[k] = speed
            self.ways[k] = WHOLE if speed * MARGIN < 1 else PIECES

    def way_of(self, nbytes: int) -> str:
        """How a read of ``nbytes`` goes: ``one read (below pieces)``, ``learning``,
        ``pieces (pieces 1.04x)`` / ``one read (pieces 0.91x)`` (learned: the speed
        of pieces against one read), or ``pieces ($KVPOOL_SSD_READS)`` (fixed)."""
        k = nbytes.bit_length()
        way = self.ways[k]
        if k < PIECED_MIN.bit_length():
            return "one read (below pieces)"
        if way == LEARN:
            return "learning"
        name = "pieces" if way == PIECES else "one read"
        if self._fixed:
            return f"{name} ($KVPOOL_SSD_READS)"
        return f"{name} (pieces {self._speeds[k]:.2f}x)"

    def describe(self) -> str:
        """Each class that read so far, with ``way_of``, e.g. ``1MiB: one read
        (pieces 0.91x); 4MiB: learning``, or the fixed way: ``pieces
        ($KVPOOL_SSD_READS)``."""
        if self._fixed:
            return self.way_of(1 << 63)  # every class from PIECED_MIN is fixed alike
        parts = []
        for k, (pieced_ns, whole_ns) in sorted(self._samples.items()):
            if k in self._speeds or pieced_ns or whole_ns:
                parts.append(f"{format_size(1 << (k - 1))}: {self.way_of(1 << (k - 1))}")
        return "; ".join(parts)


def _seeded_coin() -> Callable[[], bool]:
    """A fair coin, the same sequence in every process (runs reproduce)."""
    draw = random.Random(42).random
    return lambda: draw() < 0.5

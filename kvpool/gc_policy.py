"""Garbage collection in kvpool's long-running servers (``kvpool master``, ``kvpool node``).

CPython frees nearly all garbage by reference counting; its cyclic collector is
only for reference cycles, yet by default it runs a pass whenever tracked
allocations outnumber deallocations by 700, and every so often (when the
objects promoted since the last one reach a quarter of the old generation) a
pass over every object the process holds. A master's catalog and a node's
block table keep several objects per block, and each put allocates, promotes
and frees a few dozen more. Measured (issue 17, session 38, Intel VM, ``perf``
of each process under back-to-back 64 KiB same-host puts into a full pool, so
every put also evicts): the collector's own functions were 24% of the master's
CPU and 12% of the node's, and a full pass stalls every request while it walks
the heap -- longer the more blocks the server holds.

The servers' rule instead (``ServerGc``):

- once started, ``gc.freeze()``: what startup built (modules, classes, the
  config, the arena's bookkeeping) is never garbage and is left out of every
  later pass;
- the young and middle generations run by counts as CPython sets them (700
  allocations, 10 young passes): short, bounded passes that free a request's
  cycles (an exception's traceback, a frame) soon. Raising them trades CPU for
  pauses: at 50,000 allocations a young pass held the process 26 ms, at 700
  0.2 ms (a middle pass 2.4 ms; scratch ``gcpause.py``, issue 17 session 38);
- the whole heap only on a timer, every ``FULL_EVERY_S`` seconds, never by
  counts: a cycle that outlived the middle generation is reclaimed at most that
  long after it became garbage, and the full pass (~50 ms per 400k tracked
  objects on the Intel VM, as long as before: it walks the same heap) comes once
  a minute instead of each time the catalog has grown or churned by a quarter.

Invariants: ``start`` changes the process's collector settings once and ``stop``
puts the thresholds back and ends the timer thread; nothing is ever turned off
(``gc.isenabled()`` stays as it was), so no cycle is kept forever.

Not for library use: an engine that imports kvpool keeps its own collector
settings; only the commands that run a server call this.
"""

from __future__ import annotations

import gc
import logging
import threading
import time

log = logging.getLogger("kvpool.gc_policy")

#: Middle-generation passes before a full pass by counts: never, in practice (the
#: timer runs the full passes). CPython's default: 10.
NO_FULL_BY_COUNTS = 1 << 30
#: Seconds between full passes.
FULL_EVERY_S = 60.0


class ServerGc:
    """The collector rule of one server process (see the module docstring)."""

    def __init__(self, full_every_s: float = FULL_EVERY_S) -> None:
        if not full_every_s > 0:
            raise ValueError(f"full_every_s must be > 0 (got {full_every_s!r})")
        self.full_every_s = full_every_s
        self.full_passes = 0  # full passes the timer ran
        self.longest_pass_s = 0.0  # the longest of them
        self._saved: tuple[int, int, int] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Freeze what exists, end full passes by counts and start the timer (once)."""
        if self._thread is not None:
            return
        self._saved = young, middle, _ = gc.get_threshold()
        gc.freeze()
        gc.set_threshold(young, middle, NO_FULL_BY_COUNTS)
        self._thread = threading.Thread(target=self._loop, name="kvpool-gc", daemon=True)
        self._thread.start()
        log.info(
            "garbage collector: %d objects frozen; the whole heap every %g s, not by counts",
            gc.get_freeze_count(),
            self.full_every_s,
        )

    def stop(self) -> None:
        """End the timer and restore the thresholds (the frozen objects stay out of
        passes: ``gc.unfreeze`` would make the next pass walk them all again)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._saved is not None:
            gc.set_threshold(*self._saved)
            self._saved = None

    def _loop(self) -> None:
        while not self._stop.wait(self.full_every_s):
            started = time.perf_counter()
            found = gc.collect()
            took = time.perf_counter() - started
            self.full_passes += 1
            self.longest_pass_s = max(self.longest_pass_s, took)
            log.debug("full collection: %d unreachable objects, %.1f ms", found, took * 1e3)

"""SIGINT / SIGTERM as a stop request that a process's main thread waits for.

Invariant: the signal handler only stores a number (no lock, no call that can
block); everything else (setting ``StopSignals.event`` for other threads,
returning from ``wait``, ignoring the stop signals that come after) happens in
ordinary code of the main thread.

Why: Python runs a signal handler in the main thread between two bytecodes. A
handler that calls ``threading.Event.set()`` takes the event's lock; if the main
thread was itself inside ``Event.wait`` at a moment it held that lock (on entry,
and again on every timeout of ``wait(1.0)``), ``set()`` waits forever for a lock
its own thread holds. Found on 2026-12-02: a ``kvpool master`` and two nodes
stuck after SIGTERM with their main threads blocked in ``Event.set`` inside the
handler, one frame per signal, until SIGKILL. Every long-running kvpool process
(``kvpool master``, ``kvpool node``, the serve runtime's workers and pipeline
stages) waits through this class.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterable
from types import FrameType
from typing import Any

#: How often ``wait`` looks at the flag: the longest delay between a signal and the
#: main thread acting on it.
POLL_S = 0.05

_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopSignals:
    """Install handlers for ``signals`` (main thread only, as ``signal.signal``
    requires); ``wait`` until one arrives or another thread sets ``event``."""

    def __init__(self, signals: Iterable[int] = _STOP_SIGNALS) -> None:
        self.event = threading.Event()  # set by wait() once stopping; others may set it too
        self.received: int | None = None  # the first stop signal, once one came
        self._previous: dict[int, Any] = {}
        for sig in signals:
            self._previous[sig] = signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        if self.received is None:  # a plain store: the only thing a handler may do
            self.received = signum

    @property
    def stopping(self) -> bool:
        """A stop signal came, or some thread set ``event`` (neither takes a lock)."""
        return self.received is not None or self.event.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Until stopping (True; ``event`` is then set, and further stop signals
        are ignored) or ``timeout`` seconds passed (False). Call from the main
        thread: it alone runs the handlers and may change them.

        Why ignore the later ones: the clean shutdown that follows (a node unlinks
        its shared memory) must run to its end, and Python's finalization puts
        the default action back for signals with Python handlers, so a second
        SIGTERM at exit would kill the process mid-way (exit status -15, seen in
        ``test_stop_signals``). SIGKILL still ends it; ``kvpool.procs`` sends it
        after its deadline."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.stopping:
            left = POLL_S if deadline is None else min(POLL_S, deadline - time.monotonic())
            if left <= 0:
                return False
            time.sleep(left)
        self.event.set()
        for sig in self._previous:
            signal.signal(sig, signal.SIG_IGN)
        return True

    def restore(self) -> None:
        """Put back the handlers that were installed before (tests, nested use)."""
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()

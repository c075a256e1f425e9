"""Spin briefly before a blocking receive on the TCP data path.

``spin(fd)`` polls the socket (the GIL released) until a byte, EOF or an error
is there or ``SPIN_US`` microseconds passed, and returns; the caller's
blocking receive then runs as before. Every receive of a reply in
``kvpool.transport.tcp_conn`` calls it first.

Why: on VMs whose idle loop halts the vCPU as soon as a thread sleeps, a reply
that arrives while the caller sleeps costs a halt, a VM exit and a wake-up,
and the Python after it runs with cold caches and branch predictors. On the
2 vCPU AMD EPYC machines (cpuidle haltpoll, ``guest_halt_poll_ns`` = 0) that
made a 64 KiB read over loopback ~25% slower than a raw socket; spinning
first made it faster than one (bench/RESULTS.md, "Session 11").

What it costs: the CPU time of the spin, at most ``SPIN_US`` per receive, on
at most ``SPINNERS`` threads of the process at once (the others block at
once). Both come from the environment, read once at import:

- ``KVPOOL_TCP_SPIN_US`` (default 100; 0 turns spinning off);
- ``KVPOOL_TCP_SPINNERS`` (default 1).

Where the compiled ``kvpool.transport._spin_wait`` is absent (an optional
extension: no C compiler at install time) ``spin`` does nothing. ``STATUS``
says which, and why; ``counters()`` how the spins ended.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable

DEFAULT_SPIN_US = 100
DEFAULT_SPINNERS = 1
MAX_SPIN_US = 1_000_000  # a budget past a second is a typo, not a tuning


def _env_int(name: str, default: int, high: int) -> int:
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value <= high:
        raise ValueError(f"${name} must be an integer from 0 to {high}, got {text!r}")
    return value


SPIN_US = _env_int("KVPOOL_TCP_SPIN_US", DEFAULT_SPIN_US, MAX_SPIN_US)
SPINNERS = _env_int("KVPOOL_TCP_SPINNERS", DEFAULT_SPINNERS, 1 << 20)


def _load() -> tuple[Callable[[int, int], bool] | None, Callable[[], dict[str, int]] | None, str]:
    """The native wait, its counters, and a line saying what ``spin`` does, and why."""
    if SPIN_US == 0 or SPINNERS == 0:
        return None, None, "off ($KVPOOL_TCP_SPIN_US or $KVPOOL_TCP_SPINNERS is 0)"
    try:
        native = importlib.import_module("kvpool.transport._spin_wait")
    except ImportError as exc:  # built without a compiler: the optional extension is absent
        return None, None, f"off (kvpool.transport._spin_wait not built: {exc})"
    native.set_max_spinners(SPINNERS)
    status = f"up to {SPIN_US} us before each blocking receive, {SPINNERS} thread(s) at a time"
    return native.wait_readable, native.counters, status


_wait, _counters, STATUS = _load()
_BUDGET_NS = SPIN_US * 1000


def spin(fd: int) -> None:
    """Poll ``fd`` until it is readable or the budget passed (no-op when off)."""
    if _wait is not None:
        _wait(fd, _BUDGET_NS)


def active() -> bool:
    """Whether ``spin`` polls (the extension is built and spinning is not turned off)."""
    return _wait is not None


def counters() -> dict[str, int]:
    """Spins since import: ``waits`` (calls), ``ready`` (the socket became readable),
    ``timeouts`` (the budget passed), ``crowded`` (``SPINNERS`` threads already
    spun); empty when spinning is off."""
    return {} if _counters is None else _counters()

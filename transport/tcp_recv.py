"""How the TCP data path's client receives replies: spin briefly, then receive.

``spin(fd)`` polls the socket (the GIL released) until a byte, EOF or an error
is there or ``SPIN_US`` microseconds passed, and returns; the caller's
blocking receive then runs as before. Every receive of a reply in
``kvpool.transport.tcp_conn`` spins first. ``recv_all(fd, views, flags)`` fills
a list of buffers (a pipelined batch's replies, or the rest of one) in one
native call, spinning before each of its receives; ``read_blocks`` runs a
pipelined batch of checked reads (requests, replies, header checks) in one.

Why: on VMs whose idle loop halts the vCPU as soon as a thread sleeps, a reply
that arrives while the caller sleeps costs a halt, a VM exit and a wake-up,
and the Python after it runs with cold caches and branch predictors. On the
2 vCPU AMD EPYC machines (cpuidle haltpoll, ``guest_halt_poll_ns`` = 0) that
made a 64 KiB read over loopback ~25% slower than a raw socket; spinning
first made it faster than one (bench/RESULTS.md, "Session 11").

A write is answered once the peer has taken its payload in: ``spin_ack``
spins that much longer, by the payload's size (``ACK_EXTRA_MAX_US`` at most).
A receive that takes what has arrived (no ``MSG_WAITALL``: a reply over
``tcp_wire.WAITALL_MAX``, its first receive through ``spin(fd, want)`` and the rest
in ``recv_all``; a write's payload on the node) spins until a quarter MiB is queued
(the C's ``WANT_MAX``; less where the budget at 2.5 GB/s or a quarter of the socket's
receive buffer is less), not until the first byte: taken a few segments at a time, a
1 MiB read over loopback ran at 0.80-0.83x a raw socket, 0.90-0.94x now (through the
pool 0.83-0.86x -> 0.84-1.00x; bench/RESULTS.md, "Session 39"; the C source says more).
A reply's first receive waits for 64 KiB at most (``FIRST_WANT_MAX``): nothing is
copied until it returns, and a quarter MiB left more of the copy after the last byte
(256 KiB reads across a veth link 0.81x -> 0.90x a raw socket; "Session 40").

What it costs: the CPU time of the spin, at most ``SPIN_US`` per receive (plus
the extra of a write's answer), on at most ``SPINNERS`` threads of the process
at once (the others block at once). The spin yields between polls, so a thread
that is ready to run on its CPU (a commit sender, another process) still runs.
Beside a busy co-runner that yield costs the co-runner's whole scheduler slice
(~4 ms a receive on the Intel VM, issue 17 session 30), so a yield that kept the
spinner off its CPU for ``LONG_YIELD_US`` pauses that thread's spins (its
receives sleep at once): ``FIRST_PAUSE_MS``, doubled while long yields follow,
up to ``MAX_PAUSE_MS`` (the C source's header says why; ``set_pause`` changes them).
The budget and the spinner limit come from the environment, read once at import:

- ``KVPOOL_TCP_SPIN_US`` (default 100; 0 turns spinning off);
- ``KVPOOL_TCP_SPINNERS`` (default 1).

Where the compiled ``kvpool.transport._tcp_recv`` is absent (an optional
extension: no C compiler at install time) ``spin`` does nothing and
``recv_all`` and ``read_blocks`` are None (``tcp_wire.recv_scatter`` and
``DataConn.read_blocks`` then loop in Python).
``STATUS`` says which, and why; ``counters()`` how the spins ended.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvpool.config import env_int, optional_extension

DEFAULT_SPIN_US = 100
DEFAULT_SPINNERS = 1
MAX_SPIN_US = 1_000_000  # a budget past a second is a typo, not a tuning

SPIN_US = env_int("KVPOOL_TCP_SPIN_US", DEFAULT_SPIN_US, MAX_SPIN_US)
SPINNERS = env_int("KVPOOL_TCP_SPINNERS", DEFAULT_SPINNERS, 1 << 20)
#: The spin's pause after a long yield, given to the compiled module at import
#: (``set_pause`` changes them; the C source's header says why these).
LONG_YIELD_US, FIRST_PAUSE_MS, MAX_PAUSE_MS = 500, 10, 1000
#: A write's acknowledgement leaves the peer once it has taken the payload in, which
#: for a large payload outlasts ``SPIN_US`` (``spin_ack``): its wait spins longer by
#: the payload's bytes at 2 GB/s (1 ns per 2 bytes), this much longer at most.
ACK_EXTRA_MAX_US = 1000


_module: Any  # (its functions are looked up where STATUS says it is there)
_module, _missing = optional_extension("kvpool.transport._tcp_recv")
_BUDGET_NS = SPIN_US * 1000 if SPINNERS else 0
if not _BUDGET_NS:
    STATUS = "off ($KVPOOL_TCP_SPIN_US or $KVPOOL_TCP_SPINNERS is 0)"
elif _module is None:
    STATUS = f"off ({_missing})"
else:
    _module.set_max_spinners(SPINNERS)
    _want_kib = _module.want_for_budget(_BUDGET_NS) >> 10
    _first_kib = min(_want_kib, _module.FIRST_WANT_MAX >> 10)
    STATUS = (
        f"up to {SPIN_US} us before each blocking receive (a write's acknowledgement: up to"
        f" {ACK_EXTRA_MAX_US} us more, by its payload; a large reply: {_first_kib} KiB queued"
        f" before its first receive, then {_want_kib} KiB at a time), {SPINNERS} thread(s) at"
        " a time,"
        f" paused {FIRST_PAUSE_MS}-{MAX_PAUSE_MS} ms after a yield of {LONG_YIELD_US} us"
    )
_wait = _module.wait_readable if _module is not None and _BUDGET_NS else None
_ACK_EXTRA_MAX_NS = ACK_EXTRA_MAX_US * 1000


def _recv_all(fd: int, views: list[memoryview], flags: int) -> int:
    return int(_module.recv_all(fd, views, flags, _BUDGET_NS))


#: Fill every buffer of a list from a socket (``recvmsg`` flags), spinning before each
#: receive; the bytes received (fewer: the peer closed). None where the extension was
#: not built.
recv_all: Callable[[int, list[memoryview], int], int] | None = (
    None if _module is None else _recv_all
)


def _read_blocks(
    fd: int,
    plan: list[tuple[int, Any, bytes, int]],
    first_rid: int,
    received: int,
    heads: bytearray,
    waitall_max: int,
    size: int,
) -> tuple[list[bool], int, int, int] | None:
    return _module.read_blocks(fd, plan, first_rid, received, heads, waitall_max, _BUDGET_NS, size)


#: A pipelined batch of checked reads (offset, host buffer, key, block offset) in one
#: native call (requests packed and sent, replies received, headers checked; the C
#: source says how): (found, index of the first reply neither ok nor stale, bytes the
#: server has sent now, payload bytes served), or None -- nothing sent -- when a read
#: is not a host read inside the region of ``size`` bytes it takes. None where the
#: extension was not built.
read_blocks: (
    Callable[
        [int, list[tuple[int, Any, bytes, int]], int, int, bytearray, int, int],
        tuple[list[bool], int, int, int] | None,
    ]
    | None
) = None if _module is None else _read_blocks


def spin(fd: int, want: int = 1) -> None:
    """Poll ``fd`` until it is readable or the budget passed (no-op when off);
    ``want`` > 1: until that many bytes are queued, 64 KiB at most (a reply's first
    receive: the C's ``FIRST_WANT_MAX``)."""
    if _wait is not None:
        _wait(fd, _BUDGET_NS, want)


def spin_ack(fd: int, payload: int) -> None:
    """``spin`` before the receive of a write's acknowledgement, ``payload`` bytes
    just sent: longer by the time the peer may still take to receive them (2 GB/s,
    ``ACK_EXTRA_MAX_US`` at most). A 1 MiB put's acknowledgement came 143-169 us
    after its send returned on the Intel VM (issue 17, session 29): with the plain
    budget the writer's vCPU halted first, and the wake-up it then paid made the
    put ~7% slower. The spin still ends as soon as the acknowledgement is there."""
    if _wait is not None:
        _wait(fd, _BUDGET_NS + min(payload >> 1, _ACK_EXTRA_MAX_NS))


def active() -> bool:
    """Whether ``spin`` polls (the extension is built and spinning is not turned off)."""
    return _wait is not None


def counters() -> dict[str, int]:
    """Spins since import: ``waits`` (calls), each ended one way: ``ready`` (the
    socket became readable), ``timeouts`` (the budget passed), ``crowded``
    (``SPINNERS`` threads already spun), ``long_yields`` (a yield kept the CPU
    away ``LONG_YIELD_US``: the thread's spinning paused), ``paused`` (none while
    paused); and ``max_spinners``, ``next_pause_us`` (the pause a long yield of the
    calling thread starts now); empty when spinning is off."""
    return {} if _wait is None else dict(_module.counters())


def set_pause(long_yield_us: int, first_pause_ms: float, max_pause_ms: float) -> None:
    """Change the pause rule (tests; ``LONG_YIELD_US`` etc. are the defaults) and
    end the calling thread's pause in force; no-op when spinning is off."""
    if _module is not None:
        ns_per_ms = 1_000_000
        _module.set_pause(
            long_yield_us * 1000, int(first_pause_ms * ns_per_ms), int(max_pause_ms * ns_per_ms)
        )


set_pause(LONG_YIELD_US, FIRST_PAUSE_MS, MAX_PAUSE_MS)  # the module's rule, from here on

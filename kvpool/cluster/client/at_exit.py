"""Close the cluster clients still open when the interpreter exits normally.

A distributed put is acknowledged before its master commit is answered
(kvpool.cluster.client.commits): the commit thread sends it within its
linger, and the node holds the block meanwhile. A process that returns from
``put`` and exits at once (an engine's worker, a script) would otherwise end
its daemon threads before the commit left, and the block would stay
invisible until its grant expired -- acknowledged, then lost. Seen in CI: an
SGLang write-back process that exited right after ``batch_set``.

So every ``RemotePool`` is tracked here while open, and an ``atexit`` hook
closes those still open: ``close`` flushes the pipelined commits (waiting for
their answers, bounded by the failover deadline), gives back grants and
leases, then drops the connections. ``atexit`` runs before the interpreter
stops daemon threads, so the RPC reader that receives the answers still runs.
A failure is logged, never raised at exit. A process killed by a signal runs
no hook: a put whose commit had not left yet (at most the linger plus a round
trip after it returned) stays on its node, whole but invisible, until the node
commits it for the writer (kvpool.cluster.unconfirmed: its heartbeat interval
plus 0.5 s after the seal).
"""

from __future__ import annotations

import atexit
import logging
import threading
import weakref
from typing import Protocol


class Closable(Protocol):
    def close(self) -> None: ...


log = logging.getLogger("kvpool.cluster.client")
_open: weakref.WeakSet[Closable] = weakref.WeakSet()
_lock = threading.Lock()
_registered = False


def track(pool: Closable) -> None:
    """``pool`` is open: close it at exit unless it is closed before."""
    global _registered
    with _lock:
        _open.add(pool)
        if not _registered:
            atexit.register(close_all)
            _registered = True


def untrack(pool: Closable) -> None:
    with _lock:
        _open.discard(pool)


def close_all() -> None:
    """Close every tracked client (the exit hook; tests call it too)."""
    with _lock:
        pools = list(_open)
        _open.clear()
    for pool in pools:
        try:
            pool.close()
        except Exception as exc:  # at exit: say what was lost, never raise
            log.error("closing a kvpool client at exit: %s", exc)

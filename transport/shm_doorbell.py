"""The seal file's doorbell as a futex: the node's commit thread sleeps until a writer rings.

A same-host writer that asks the node to commit its block (``NODE_COMMITS`` in its
seal record, kvpool.transport.shm_seal) rings the doorbell, a word of the seal
file's header; the node's commit thread (kvpool.cluster.node_commits) takes the
rung records. It used to learn of rings only by polling the word, every 2 ms for
as long as any claim taken ahead was open -- which is always, while a same-host
client keeps its stock of grants, and for good after one exits without returning
it: an idle node with one same-host client attached woke ~500 times a second, ~3%
of a CPU (issue 17, session 48). Now the thread, when it has nothing to poll for,
sleeps on the doorbell as a futex (shared between processes: the file is mapped by
each) and a ring wakes it.

Protocol (words of the seal file's header, u64, native byte order; the futex is
the 32-bit half of the doorbell holding its low bits):

- ``DOORBELL`` (word 8): a writer rings with ``WRITER`` (1) after its record; the
  node's own threads with ``HURRY`` (2) to make the commit thread look now (an ask
  about a commit owed, a commit owed by a TCP write, ``close``). The commit thread
  clears it (``SealRecords.rung``) before it reads records.
- ``SLEEPING`` (word 9): set by the commit thread, sequentially consistent, before
  its futex wait and cleared after; a writer's ring, itself a sequentially
  consistent store, is followed by a load of it and a ``FUTEX_WAKE`` only when set.
  So either the writer sees the thread asleep and wakes it, or the thread's futex
  wait (which sleeps only while the doorbell is still 0) sees the ring: no ring is
  lost, and a writer pays a system call only for the first ring after a quiet spell.
  While writers are busy the thread polls (a timed wait on its own event, the
  word not set), so a stream of puts costs them nothing extra and shares frames.
- ``POLLED`` (word 10): set by a writer that cannot ring this way (the compiled
  module absent from its install): the node then polls as before, so that writer's
  rings are seen within the poll period.

The functions here are the compiled module's (kvpool.transport._shm_copy; turning
its copies off with ``$KVPOOL_SHM_COPY=0`` leaves them on); ``AVAILABLE`` is False
where it was not built, and then the node polls and writers only set the word.
"""

from __future__ import annotations

import importlib
from typing import Any

DOORBELL_WORD, SLEEPING_WORD, POLLED_WORD = 8, 9, 10
WRITER, HURRY = 1, 2  # who rang: a writer, or the node itself


def _native() -> Any:
    try:  # by name: the compiled module, whatever $KVPOOL_SHM_COPY says of its copies
        return importlib.import_module("kvpool.transport._shm_copy")
    except ImportError:  # built without a compiler: the optional extension is absent
        return None


_module = _native()
#: Whether this process rings and waits on the futex (else: plain stores, polling).
AVAILABLE = _module is not None


def ring(mapping: Any, value: int = WRITER, *, force: bool = False) -> None:
    """Ring the doorbell of the seal file mapped at ``mapping`` with ``value`` and wake
    the node's commit thread if it said it sleeps on it (``force``: in any case). Call
    only where ``AVAILABLE``."""
    _module.doorbell_ring(mapping, value, force)


def wait(mapping: Any, timeout_s: float) -> None:
    """The commit thread's sleep, at most ``timeout_s``, until the doorbell is rung (at
    once if it is; ``SealRecords.rung`` then reads and clears it). Call only where
    ``AVAILABLE``."""
    _module.doorbell_wait(mapping, int(timeout_s * 1e9))

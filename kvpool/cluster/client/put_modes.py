"""The environment switches of distributed puts, each read once where a client starts.

Each is ``0`` (off) or ``1``/unset/empty (on); anything else is refused, so a
typo never silently picks a mode. ``pipelined_default`` checks them all, so a
bad setting fails before the client connects.
"""

from __future__ import annotations

import os


def pipelined_default(explicit: bool | None = None) -> bool:
    """Whether puts pipeline their commit: ``explicit``, else ``$KVPOOL_PUT_PIPELINE``
    (``0``/``1``), else True. Checks the other switches too, so that a bad
    setting of any fails before the client connects."""
    commit_thread_default()
    node_commits_default()
    return explicit if explicit is not None else _switch("KVPOOL_PUT_PIPELINE")


def commit_thread_default() -> bool:
    """Whether a sender thread sends the pipelined commits: ``$KVPOOL_PUT_COMMIT_THREAD``
    (``0``/``1``), else True."""
    return _switch("KVPOOL_PUT_COMMIT_THREAD")


def node_commits_default() -> bool:
    """Whether single puts leave their commit to the node where it takes them (sealed
    in shared memory, or written over TCP with ``WRITE_COMMIT``):
    ``$KVPOOL_NODE_COMMITS`` (``0``/``1``), else True."""
    return _switch("KVPOOL_NODE_COMMITS")


def _switch(name: str) -> bool:
    """An on/off environment setting: unset, empty or ``1`` is on, ``0`` off; anything
    else is refused (a typo must not silently pick a mode)."""
    raw = os.environ.get(name, "").strip()
    if raw in ("", "1"):
        return True
    if raw == "0":
        return False
    raise ValueError(f"{name} must be 0 or 1, got {raw!r}")

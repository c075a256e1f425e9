"""The leadership interface a master needs, and an in-memory implementation.

A leader holds a key bound to a lease: if it stops renewing, the lease
expires and the key disappears, so another master can take it. The key's
creation revision is the leader's *epoch*: the store's revisions only grow,
so every new term has a higher epoch than every earlier one.

Invariants every implementation keeps:
- ``campaign`` creates the key only if it is absent, atomically, bound to a
  fresh lease of ``ttl`` seconds; it returns the epoch, or None if someone
  else leads;
- ``renew`` returns False once the lease is gone (expired or revoked); it
  raises on a transport failure (the caller decides when that means lost);
- ``leader`` reads the current holder (value and epoch) or None.
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass


@dataclass(frozen=True)
class Leader:
    value: str  # the leader's advertised "host:port"
    epoch: int  # creation revision of its key


class Coordinator(ABC):
    @abstractmethod
    def campaign(self, key: str, value: str, ttl: float) -> int | None:
        """Become the leader if nobody is: the new epoch, else None."""

    @abstractmethod
    def renew(self) -> bool:
        """Keep our lease alive; False when it is gone."""

    @abstractmethod
    def leader(self, key: str) -> Leader | None:
        """Who leads now (None: nobody)."""

    @abstractmethod
    def resign(self, key: str) -> None:
        """Give up leadership (best effort: the lease expires anyway)."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections."""


class MemoryStore:
    """What several ``MemoryCoordinator``s share: keys with lease deadlines, a revision."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.revision = 0
        self.keys: dict[str, tuple[str, int, int]] = {}  # key -> (value, create rev, lease)
        self.leases: dict[int, tuple[float, float]] = {}  # lease -> (deadline, ttl)
        self.down = False  # simulate an unreachable store

    def expire(self) -> None:
        now = time.monotonic()
        dead = {lease for lease, (deadline, _) in self.leases.items() if deadline <= now}
        for lease in dead:
            del self.leases[lease]
        self.keys = {k: v for k, v in self.keys.items() if v[2] in self.leases}

    def check(self) -> None:
        if self.down:
            raise ConnectionError("coordination store unreachable")


class MemoryCoordinator(Coordinator):
    """A fake for unit tests: same contract, no etcd."""

    def __init__(self, store: MemoryStore) -> None:
        self.store = store
        self.lease = 0

    def campaign(self, key: str, value: str, ttl: float) -> int | None:
        s = self.store
        with s.lock:
            s.check()
            s.expire()
            if key in s.keys:
                return None
            s.revision += 1
            self.lease = s.revision
            s.leases[self.lease] = (time.monotonic() + ttl, ttl)
            s.keys[key] = (value, s.revision, self.lease)
            return s.revision

    def renew(self) -> bool:
        s = self.store
        with s.lock:
            s.check()
            s.expire()
            held = s.leases.get(self.lease)
            if held is None:
                return False
            s.leases[self.lease] = (time.monotonic() + held[1], held[1])
            return True

    def leader(self, key: str) -> Leader | None:
        s = self.store
        with s.lock:
            s.check()
            s.expire()
            held = s.keys.get(key)
            return None if held is None else Leader(held[0], held[1])

    def resign(self, key: str) -> None:
        s = self.store
        with s.lock:
            s.leases.pop(self.lease, None)
            s.expire()

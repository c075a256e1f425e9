"""The leader / standby loop of one master, and its self-fencing watchdog.

A master campaigns for ``/kvpool/<cluster>/leader``; the winner serves, the
others poll who leads (every ``poll_s``) so that they can point callers at
the leader and take over as soon as its key is gone.

Self-fencing: etcd expires the lease ``ttl`` seconds after the last renewal
it received, which is after we sent it. So the leader may serve only until
``sent + fence_fraction * ttl`` of its last successful renewal; past that
(etcd unreachable, the process was stopped, the renew thread starved)
``serving()`` is False at once, for every handler, and the watchdog deposes
the master (``on_deposed``) even if no renewal ever returns. A new leader
can only be elected after the old lease expired, by which time the old one
has stopped serving.

Invariants:
- ``serving()`` is True only while leading and before the fencing deadline;
- ``on_elected(epoch)`` and ``on_deposed()`` alternate, never overlap, and
  run on the election thread; epochs passed to ``on_elected`` only grow;
- ``serving()`` turns True only after ``on_elected`` returned, and False
  before ``on_deposed`` is called: no call is served on a term's state
  before it is set up or after it is torn down.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvpool.cluster.ha.coordinator import Coordinator

log = logging.getLogger("kvpool.cluster.ha")


@dataclass(frozen=True)
class ElectionConfig:
    cluster: str = "default"
    ttl: float = 3.0  # the leader lease, seconds
    fence_fraction: float = 0.6  # serve at most this share of the TTL past a renewal
    poll_s: float = 0.25  # standbys look up the leader this often

    def __post_init__(self) -> None:
        if self.ttl < 1.0:
            raise ValueError("the leader TTL must be >= 1 s (etcd leases are whole seconds)")

    @property
    def key(self) -> str:
        return f"/kvpool/{self.cluster}/leader"


class Election:
    def __init__(
        self,
        coordinator: Coordinator,
        me: str,
        config: ElectionConfig,
        on_elected: Callable[[int], None],
        on_deposed: Callable[[], None],
    ) -> None:
        self.coordinator, self.me, self.config = coordinator, me, config
        self._on_elected, self._on_deposed = on_elected, on_deposed
        self._lock = threading.Lock()
        self.leading = False
        self.epoch = 0
        self.leader = ""  # the leader's address as last seen ("" = unknown)
        self._valid_until = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvpool-election", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def serving(self) -> bool:
        return self.leading and time.monotonic() < self._valid_until

    def close(self) -> None:
        self._stop.set()
        self._thread.join(self.config.ttl + 2)
        if self.leading:
            self.leading = False
            with contextlib.suppress(Exception):
                self.coordinator.resign(self.config.key)
        self.coordinator.close()

    # -- the loop -----------------------------------------------------------------------

    def _run(self) -> None:
        cfg = self.config
        while not self._stop.is_set():
            try:
                if self.leading:
                    self._renew()
                    pause = cfg.ttl / 6
                else:
                    self._campaign()
                    pause = cfg.ttl / 6 if self.leading else cfg.poll_s
            except Exception as exc:
                log.warning("leader election: %s", exc)
                pause = cfg.poll_s
            self._fence_if_expired()
            self._wait(pause)

    def _wait(self, pause: float) -> None:
        """Sleep, but wake to fence exactly at the deadline (the watchdog)."""
        end = time.monotonic() + pause
        while not self._stop.is_set():
            now = time.monotonic()
            if now >= end:
                return
            if self.leading:
                self._fence_if_expired()
            self._stop.wait(min(end - now, 0.05))

    def _campaign(self) -> None:
        cfg = self.config
        sent = time.monotonic()
        epoch = self.coordinator.campaign(cfg.key, self.me, cfg.ttl)
        if epoch is None:
            current = self.coordinator.leader(cfg.key)
            self.leader = current.value if current is not None else ""
            return
        if epoch <= self.epoch:  # never serve a lower term than one we served
            self.coordinator.resign(cfg.key)
            return
        self.epoch = epoch
        # The term's state first, serving after: a call that passed ``serving()``
        # before ``on_elected`` ran would act on the state of no term (an empty
        # catalog past its start-up grace answers "pool full").
        self._on_elected(epoch)
        with self._lock:
            self.leader = self.me
            self._valid_until = sent + cfg.fence_fraction * cfg.ttl
            self.leading = True
        log.info("elected leader of %s in term %d", cfg.cluster, epoch)

    def _renew(self) -> None:
        sent = time.monotonic()
        if self.coordinator.renew():
            self._valid_until = sent + self.config.fence_fraction * self.config.ttl
        else:
            log.warning("leader lease of term %d is gone", self.epoch)
            self._depose()

    def _fence_if_expired(self) -> None:
        if self.leading and time.monotonic() >= self._valid_until:
            log.warning("could not renew the leader lease in time: stopping to serve")
            self._depose()

    def _depose(self) -> None:
        with self._lock:
            if not self.leading:
                return
            self.leading = False
            self.leader = ""
        self._on_deposed()

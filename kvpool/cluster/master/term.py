"""The master's term: which epoch it serves, standalone or elected on etcd.

Standalone (no ``etcd`` in the config) a master serves from its start, in a
term numbered by the wall clock in milliseconds (it grows across restarts;
a node that has seen a higher term refuses to register, so a clock stepped
back is noticed). With ``etcd`` it runs an ``Election``
(kvpool.cluster.ha): while it is a standby, or once it could not renew its
lease in time, every call is answered ``NotLeaderError`` naming the leader
it knows, and each term it wins starts from an empty catalog (the nodes
re-register what they hold: they are the source of truth, nothing is
replayed from a log).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from kvpool.cluster.master.config import MasterConfig
from kvpool.errors import NotLeaderError


def standalone_epoch() -> int:
    return time.time_ns() // 1_000_000


class MasterTerm:
    def __init__(self, config: MasterConfig, begin: Callable[[int], None]) -> None:
        """``begin(epoch)`` resets the master's state for a new term (0: none)."""
        self.config, self._begin = config, begin
        self.election: Any = None
        if not config.etcd:
            begin(standalone_epoch())
            return
        from kvpool.cluster.ha.election import ElectionConfig

        # Checked here, before the master binds a port: a bad TTL fails at once.
        self._election_config = ElectionConfig(cluster=config.cluster, ttl=config.leader_ttl)

    def start(self, address: tuple[str, int]) -> None:
        cfg = self.config
        if not cfg.etcd:
            return
        from kvpool.cluster.ha.election import Election
        from kvpool.cluster.ha.etcd import EtcdCoordinator

        me = cfg.advertise or f"{address[0]}:{address[1]}"
        election = self._election_config
        coordinator = EtcdCoordinator(cfg.etcd, timeout=min(1.0, cfg.leader_ttl / 4))
        self.election = Election(coordinator, me, election, self._begin, lambda: self._begin(0))
        self.election.start()

    def serving(self) -> bool:
        return self.election is None or self.election.serving()

    def gate(self, fn: Callable[[Any], Any]) -> Callable[[Any], Any]:
        """``fn``, answered ``NotLeaderError(leader)`` unless this master serves now."""

        def gated(params: Any) -> Any:
            if not self.serving():
                raise NotLeaderError(self.election.leader if self.election else "")
            return fn(params)

        return gated

    def close(self) -> None:
        if self.election is not None:
            self.election.close()

"""The ``put.*`` handlers: two-phase allocation, grants, commit, revoke.

A put allocates room (``put.allocate``; nothing visible yet), the client
writes the bytes straight to the nodes, then commits (``put.commit``) or
revokes. An allocate call may also lend keyless grants for the client's next
puts, bound to their keys at commit: one master round trip per put after the
first. Invariant: grants held by all clients together stay under
``grant_share`` of the cluster's DRAM, and a client is told a grant lives no
longer than the re-join grace (so a restarted master cannot hand its range
to another writer while a client still fills it).
"""

from __future__ import annotations

import time
from typing import Any

from kvpool.args import check_keys
from kvpool.cluster.master.config import MAX_GRANTS
from kvpool.cluster.master.state import MasterState
from kvpool.cluster.wire import AllocateReply, AllocateRequest, CommitRequest, IdsRequest
from kvpool.errors import MasterNotReadyError, NotLeaderError
from kvpool.index.catalog import CatalogFullError


class PutHandlers:
    def __init__(self, state: MasterState) -> None:
        self.state = state

    def allocate(self, msg: AllocateRequest) -> AllocateReply:
        if not len(msg.keys) == len(msg.sizes) == len(msg.parents):
            raise ValueError("keys, sizes and parents must have the same length")
        check_keys(msg.keys, msg.parents)
        if any(not isinstance(size, int) or size <= 0 for size in msg.sizes):
            raise ValueError("block sizes must be positive integers")
        if not isinstance(msg.spare, int) or not isinstance(msg.spare_size, int):
            raise ValueError("spare and spare_size must be integers")
        if msg.spare < 0 or (msg.spare and msg.spare_size <= 0):
            raise ValueError("spare must be >= 0, and spare_size > 0 when spare > 0")
        state = self.state
        placements: list[list[list[Any]] | None] = []
        error, full = "", []
        # One critical section, the catalog read inside it: a term that ends or
        # begins meanwhile swaps the catalog, and "no node" must be judged on the
        # catalog the allocation then uses.
        with state.lock:
            catalog, epoch = state.catalog, state.epoch
            if not epoch:  # the term ended after this call passed the gate
                raise NotLeaderError("")
            if not catalog.has_usable_node():
                young = time.monotonic() - state.started < state.config.startup_grace_s
                if young or catalog.grace_left():
                    # A new term: nodes are (re-)registering. Never block the connection.
                    raise MasterNotReadyError("nodes are re-registering with a new master")
            evictions = catalog.evictions
            avoid = frozenset(msg.avoid)
            for i, (key, size, parent) in enumerate(
                zip(msg.keys, msg.sizes, msg.parents, strict=True)
            ):
                try:
                    allocs = catalog.allocate(
                        key, size, parent, max(1, msg.replicas), msg.node_id or None, avoid
                    )
                except CatalogFullError as exc:
                    placements.append(None)
                    error = str(exc)
                    full.append(i)
                    continue
                placements.append(
                    None if allocs is None else [[a.alloc_id, a.node_id, a.offset] for a in allocs]
                )
            lend = msg.spare and msg.replicas <= 1 and not msg.node_id and self.grant_window()
            spares = self._grant(msg) if lend else []
            state.metrics.evictions.inc(catalog.evictions - evictions)
            nodes = state.regions_of(
                [p[1] for ps in placements if ps for p in ps] + [g[1] for g in spares]
            )
        return AllocateReply(
            placements=placements,
            nodes=nodes,
            error=error,
            full=full,
            ttl=state.config.alloc_ttl,
            spares=spares,
            spare_ttl=self.grant_window(),
            epoch=epoch,
        )

    def grant_window(self) -> float:
        """What clients are told a grant lives (they use it for half of that): never
        past the re-join grace, so a restarted master cannot hand its range to
        another writer while a client still fills it."""
        return min(self.state.catalog.grant_ttl, self.state.config.rejoin_grace_s)

    def _grant(self, msg: AllocateRequest) -> list[list[Any]]:
        """Keyless allocations for a client's next puts: all clients' grants together
        hold at most ``grant_share`` of the cluster's DRAM."""
        catalog = self.state.catalog
        room = int(self.state.config.grant_share * catalog.dram_capacity())
        count = min(msg.spare, MAX_GRANTS, (room - catalog.granted_bytes) // msg.spare_size)
        grants = catalog.grant(msg.spare_size, count, frozenset(msg.avoid)) if count > 0 else []
        return [[g.alloc_id, g.node_id, g.offset] for g in grants]

    def commit(self, msg: CommitRequest) -> list[bool | None]:
        ids, keys, parents = msg.ids, msg.keys, msg.parents
        if keys and len(keys) != len(ids):
            raise ValueError("commit: keys must be empty or one per id")
        if parents and len(parents) != len(keys):
            raise ValueError("commit: parents must be empty or one per key")
        parents = parents or [None] * len(keys)
        check_keys(
            [k for k in keys if k is not None],
            [p for k, p in zip(keys, parents, strict=True) if k is not None],
        )
        state = self.state
        done: list[bool | None] = []
        with state.lock:
            catalog = state.catalog  # this term's (read under the lock: terms swap it)
            for i, alloc_id in enumerate(ids):
                key = keys[i] if keys else None
                # A late second commit of a committed allocation (its node committed it for
                # the writer, or the writer retried) answers True: the put did land.
                if key is None:
                    ok = catalog.commit(alloc_id) is not None
                    done.append(ok or catalog.committed_before(alloc_id))
                else:
                    got = catalog.commit_grant(alloc_id, key, parents[i])
                    late = got is None and catalog.committed_before(alloc_id, key)
                    done.append(True if late else got)
        return done

    def revoke(self, msg: IdsRequest) -> None:
        with self.state.lock:
            for alloc_id in msg.ids:
                self.state.catalog.revoke(alloc_id)

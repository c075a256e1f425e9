"""The distributed put: allocate (or use a grant), write to the nodes, commit.

Two-phase by design: bytes land in an allocated range first, then the master
makes the key visible (``COMMIT``); a write that fails is revoked, so a block
is never visible half-written. Allocation costs a master round trip unless a
*grant* (space reserved earlier with no key, kvpool.cluster.client.grant_supply)
is in stock. The writes and their seals: kvpool.cluster.client.put_writes.

Pipelined commits (the default; kvpool.cluster.client.commits has the rules):
a put with ``replicas`` == 1 returns once its node holds the block whole with
its key (what makes it outlive a master crash); its ``COMMIT`` is answered in
the background, so a put with a grant in stock costs the node's round trip only
(same host: none, its claim taken ahead and its seal in shared memory). A single
put's node may send the commit itself (kvpool.cluster.node_commits): then the put
sends no frame to the master at all. A put of a key this client already put goes
the synchronous way; ``pipelined=False`` (or ``replicas`` > 1) commits synchronously.

Invariants:
- a key's bytes are written (same-host: and sealed) before ``put`` answers True;
  its commit is sent, queued behind the one in flight, or owed by its node before
  it returns; a failed write's allocation or grant is revoked, never committed;
- ``put`` never answers for a key that holds no block (the store contract).
  A block no commit made visible (its grant or allocation unknown to the
  master: expired, or a failover in between), whose seal was refused (its node
  started a new master term) or whose write failed is put again on fresh
  allocations until stored or found stored, within the failover deadline;
  then ``PutFailedError``. A pipelined commit the master refuses is settled by
  ``CommitPipe`` or raised, never dropped silently;
- puts with ``replicas`` > 1 allocate (grants are single placements) and commit
  synchronously; a block that lost a copy is put again whole, once (``put_once``)."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Sequence

import numpy as np

from kvpool.bindings.buffers import Region, region_nbytes
from kvpool.cluster.client import fenced
from kvpool.cluster.client.acked import Acked, Recovery
from kvpool.cluster.client.commits import CommitPipe
from kvpool.cluster.client.grant_supply import GrantSupply
from kvpool.cluster.client.grants import Grant
from kvpool.cluster.client.put_modes import node_commits_default
from kvpool.cluster.client.put_writes import (
    Sealing,
    Writes,
    Written,
    recover_puts,
    wait_for_seals,
    write_or_give_back,
)
from kvpool.cluster.client.sealed_put import SealedPutter
from kvpool.cluster.client.session import TRANSFER_ERRORS, ClientSession
from kvpool.cluster.wire import (
    COMMIT,
    EXISTS,
    AllocateRequest,
    CommitRequest,
    KeysRequest,
)
from kvpool.errors import PutFailedError
from kvpool.transport.fencing import WriteStamp
from kvpool.transport.shm import ShmTransport
from kvpool.transport.shm_seal import SealRecords
from kvpool.transport.tcp import TcpTransport

MINE_MAX = 1 << 16  # keys remembered as put by this client (own duplicates go synchronous)
log = logging.getLogger("kvpool.cluster.client")


class RemotePutter:
    """Runs puts for one cluster client's session and keeps its stock of grants."""

    def __init__(self, session: ClientSession, grant_bytes: int, pipelined: bool = True) -> None:
        self._session = session
        self.pipelined = pipelined
        self.supply = GrantSupply(session, grant_bytes)
        self.grants = self.supply.stock

        def recover(items: list[Acked]) -> list[Recovery]:
            return recover_puts(session, items, self.put_once)

        self.commits = CommitPipe(session.rpc, recover, session.rpc.deadline)
        self.commits.by_node.alive = session.node_alive
        self.node_commits = node_commits_default()  # single puts ask their node to commit
        self._mine: dict[bytes, None] = {}  # insertion-ordered, bounded by MINE_MAX
        self.late_commits = 0  # pipelined puts committed synchronously: grant window passed
        session.on_region_change(self.supply.forget_node)
        # single puts, same host or TCP, before anything here (kvpool.cluster.client.sealed_put)
        self.sealed = SealedPutter(
            session,
            self.supply,
            self.commits,
            self._mine,
            self._remember,
            self._commit_late,
            enabled=pipelined and self.node_commits and self.supply.enabled,
        )

    def put(
        self,
        keys: Sequence[bytes],
        regions: Sequence[Region],
        parents: Sequence[bytes | None],
        replicas: int,
    ) -> tuple[list[bool], list[int], str]:
        """``put_once`` with the commit pipelined where it may be (see the module
        docstring); raises ``PutCommitError`` first for earlier puts known lost."""
        self.commits.check()
        pipelined = self.pipelined and replicas == 1
        if pipelined and len(keys) == 1 and (one := self._put_one(keys[0], regions[0], parents[0])):
            return one
        if pipelined and any(k in self._mine for k in keys):
            self.commits.flush()  # its earlier commit decides the exact answer
            pipelined = False
        return self.put_once(keys, regions, parents, replicas, pipelined=pipelined)

    def _put_one(
        self, key: bytes, region: Region, parent: bytes | None
    ) -> tuple[list[bool], list[int], str] | None:
        """``put_once`` of one new key, pipelined, without its batch bookkeeping; None
        (nothing done) unless a grant is in stock. Written here: a TCP write, or a same-host
        one whose grant holds its claim and whose node publishes seal records (``SealedPutter``
        declined it); anything else (a claim to take, UCX) goes to ``put_once``."""
        if key in self._mine or not self.supply.enabled:
            return None
        size = region_nbytes(region)
        taken = self.supply.take(size)
        if taken is None:
            return None
        grant, claimed_at = taken
        node_id, session = grant.node_id, self._session
        try:
            data, seals = session.transport(node_id), None
        except BaseException:  # no transport reaches that node from here: give it back
            self.supply.revoke([grant.alloc_id])
            raise
        if type(data) is ShmTransport and claimed_at > 1 and type(region) is np.ndarray:
            seals = session.seals(node_id)
        if seals is None and type(data) is not TcpTransport:
            return self.put_once([key], [region], [parent], 1, pipelined=True, taken=taken)
        stamp = WriteStamp(grant.epoch, grant.alloc_id, grant.offset, size, key, parent)
        items = [(stamp, grant.offset, region)]
        node: SealRecords | TcpTransport | None = seals  # the node commits: it asks there
        if isinstance(data, TcpTransport) and data.info.tcp_node_commits:
            node = data
        by_node: set[int] | None = set() if node is not None and self.node_commits else None
        try:
            control, counts = session.control(node_id), session.counts
            ok, sealing = fenced.write_blocks_begin(
                data, control, items, {0: claimed_at}, seals, counts, node_commits=by_node
            )
        except TRANSFER_ERRORS:
            ok, sealing = None, None
        item = (0, grant.alloc_id, grant.offset, grant.epoch, claimed_at)
        written: list[Written] = [(item, node_id)] if ok == [fenced.OK] else []
        if not written:  # as ``_write``: forget a failed node, revoke; put again below
            if ok is None:
                self.supply.node_failed(node_id)
            self.supply.revoke([grant.alloc_id])
        seal: list[Sealing] = [] if sealing is None else [(node_id, [0], sealing)]
        lost = [] if written else [0]
        watch = {0: node} if by_node and node is not None else None
        stored, retry = self._acknowledge(
            [key], [parent], [size], written, lost, seal, {0}, grant.expires, True, watch
        )
        self.supply.top_up(size)
        full = list[int]()
        why = self._put_again([key], [region], [parent], 1, [0], stored, full) if retry else ""
        return stored, full, why

    def forget_key(self, key: bytes) -> None:
        """This client removed ``key``: a put of it is no longer an own duplicate."""
        self._mine.pop(key, None)

    def put_once(
        self,
        keys: Sequence[bytes],
        regions: Sequence[Region],
        parents: Sequence[bytes | None],
        replicas: int,
        use_grants: bool = True,
        again: bool = True,
        pipelined: bool = False,
        taken: tuple[Grant, int] | None = None,
    ) -> tuple[list[bool], list[int], str]:
        """(stored per key, indices that found no room, the master's reason). ``again``:
        put what this pass could not finish again (``_put_again``); ``pipelined``: send
        the commit without waiting (``replicas`` must be 1); ``taken``: the first key's
        grant, taken from the stock already."""
        if not keys:
            return [], [], ""
        sizes = [region_nbytes(r) for r in regions]
        use_grants = use_grants and replicas == 1 and self.supply.enabled
        writes: Writes = {}
        granted: set[int] = set()
        rest = []
        use_by = float("inf")  # the earliest use deadline of the grants taken
        for i, size in enumerate(sizes):
            if i == 0 and taken is not None:
                got: tuple[Grant, int] | None = taken
            else:
                got = self.supply.take(size) if use_grants else None
            if got is None:
                rest.append(i)
            else:
                grant, claimed = got
                granted.add(i)
                use_by = min(use_by, grant.expires)
                item = (i, grant.alloc_id, grant.offset, grant.epoch, claimed)
                writes.setdefault(grant.node_id, []).append(item)
        full: list[int] = []
        error = ""
        if rest:  # the classic allocation, asking for spare grants on the way
            request = AllocateRequest(
                [keys[i] for i in rest],
                [sizes[i] for i in rest],
                [parents[i] for i in rest],
                replicas,
            )
            reply = self.supply.allocate(request, use_grants)
            for i, placements in zip(rest, reply.placements, strict=True):
                for alloc_id, node_id, off in placements or ():
                    writes.setdefault(node_id, []).append((i, alloc_id, off, reply.epoch, False))
            full, error = [rest[j] for j in reply.full], reply.error
        written, lost, sealing = write_or_give_back(
            self._session, self.supply, writes, keys, regions, parents, sizes
        )
        partial: list[Written] = []
        if replicas > 1 and lost and again:
            # A block that lost a copy is put again whole, away from that node (``suspects``),
            # not acknowledged short; that pass keeps what it gets (at most ``replicas``).
            lost_now = set(lost)
            partial = [w for w in written if w[0][0] in lost_now]
            written = [w for w in written if w[0][0] not in lost_now]
        stored, retry = self._acknowledge(
            keys, parents, sizes, written, lost, sealing, granted, use_by, pipelined
        )
        if partial:  # their seals were collected above: give their ranges back
            self.supply.revoke([item[1] for item, _ in partial])
        if use_grants and not rest:  # after the commit: the master is not kept from it
            self.supply.top_up(sizes[0])
        if retry and again:
            error = self._put_again(keys, regions, parents, replicas, retry, stored, full) or error
        return stored, full, error

    def _acknowledge(
        self,
        keys: Sequence[bytes],
        parents: Sequence[bytes | None],
        sizes: list[int],
        written: list[Written],
        lost: list[int],
        sealing: list[Sealing],
        granted: set[int],
        use_by: float,
        pipelined: bool,
        watch: dict[int, SealRecords | TcpTransport] | None = None,
    ) -> tuple[list[bool], list[int]]:
        """Commit what was written (sent without waiting when ``pipelined``) and wait
        for the seals: (stored per key, indices not stored, to put again). ``watch``:
        indices whose node commits them once sealed (seal records or TCP node to watch)."""
        watch = watch or {}
        late = pipelined and granted and time.monotonic() > use_by
        if late and not watch:
            # The write outlasted the grants' use window (a contended node): the master may
            # expire one before a pipelined commit lands, and after the ack only the node's
            # copy could be recovered. Commit now: a refused grant is put again. (A block
            # its node commits: waited for below, as ``flush`` waits.)
            pipelined = False
            self.late_commits += 1
        stored = [False] * len(keys)
        acked: list[Acked] = []
        if pipelined:
            acked = [
                Acked(keys[i], parents[i], a, node, off, sizes[i], i in granted)
                for (i, a, off, *_), node in written
            ]
            self.commits.send(
                [a for a, (w, _) in zip(acked, written, strict=True) if w[0] not in watch]
            )
            for (i, *_), _node in written:
                stored[i] = True
            retry = lost
        else:
            retry = self._commit(keys, parents, written, granted, stored) + lost
        sealed = False
        try:
            retry += wait_for_seals(sealing, stored)
            sealed = True
        finally:
            if pipelined:  # if the seals raised, the put raises: none of it was acked
                refused = [a for (i, a, *_), _ in written if not (sealed and stored[i])]
                self.commits.answered(acked, refused)
                for a, ((i, *_), _) in zip(acked, written, strict=True):
                    if i in watch and sealed and stored[i]:
                        self.commits.watch(a, watch[i])
        if pipelined:
            self._remember([keys[i] for i, ok in enumerate(stored) if ok])
        if late and watch:
            self._commit_late()
        return stored, sorted({i for i in retry if not stored[i]})  # a replica may have made it

    def _put_again(
        self,
        keys: Sequence[bytes],
        regions: Sequence[Region],
        parents: Sequence[bytes | None],
        replicas: int,
        indices: list[int],
        stored: list[bool],
        full: list[int],
    ) -> str:
        """Put ``indices`` again on fresh allocations until each is stored or found
        stored (re-registered by its node after a failover, or another client's)
        within the failover deadline, else ``PutFailedError``. Fills ``stored``
        and ``full``; returns the master's reason for ``full``."""
        rpc, error, pause = self._session.rpc, "", 0.02
        give_up = time.monotonic() + rpc.deadline
        while True:
            redone, still, why = self.put_once(
                [keys[i] for i in indices],
                [regions[i] for i in indices],
                [parents[i] for i in indices],
                replicas,
                use_grants=False,
                again=False,
            )
            for i, ok in zip(indices, redone, strict=True):
                stored[i] = ok
            full += [indices[j] for j in still]
            error = error or why
            indices = [i for i in indices if not stored[i] and i not in full]
            if indices:
                found = rpc.call(EXISTS, KeysRequest([keys[i] for i in indices]))
                for i, hit in zip(indices, found, strict=True):
                    stored[i] = bool(hit)
                indices = [i for i in indices if not stored[i]]
            if not indices:
                return error
            if time.monotonic() + pause > give_up:
                why = "nodes failed or refused the writes, or another client puts the key"
                raise PutFailedError([keys[i] for i in indices], f"{rpc.deadline:g} s: {why}")
            time.sleep(pause)
            pause = min(2 * pause, 0.25)

    def close(self) -> None:
        """Flush the pipelined commits (``PutCommitError`` for lost puts); give back grants."""
        try:
            self.commits.close()
        finally:
            self.supply.close()

    # -- helpers --------------------------------------------------------------------

    def _commit(
        self,
        keys: Sequence[bytes],
        parents: Sequence[bytes | None],
        written: list[Written],
        granted: set[int],
        stored: list[bool],
    ) -> list[int]:
        """Commit what was written; fills ``stored``; returns the indices to retry:
        those no commit made visible, except grants whose key was stored already
        (False: the caller's bytes were not needed). An allocation's commit is
        refused (False) when the master no longer knows it: it expired, its node
        re-registered, or the commit reached a new master after a failover."""
        if not written:
            return []
        ids = [item[1] for item, _ in written]
        request = CommitRequest(ids)
        if granted:
            request.keys = [keys[i] if i in granted else None for (i, *_), _ in written]
            request.parents = [parents[i] if i in granted else None for (i, *_), _ in written]
        done = self._session.rpc.call(COMMIT, request)
        retry = []
        for ((i, *_), _), ok in zip(written, done, strict=True):
            stored[i] = stored[i] or bool(ok)
            if not ok and not (ok is False and i in granted):
                retry.append(i)
        return retry

    def _commit_late(self) -> None:
        """A pipelined put acknowledged past its grant's use window: the master may
        expire the grant before the commit lands, so wait for it before returning."""
        self.late_commits += 1
        self.commits.flush()

    def _remember(self, keys: list[bytes]) -> None:
        mine = self._mine
        for key in keys:
            mine[key] = None
        while len(mine) > MINE_MAX:  # the oldest go (another thread may race: harmless)
            with contextlib.suppress(RuntimeError, StopIteration, KeyError):
                del mine[next(iter(mine))]

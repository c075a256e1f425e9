"""Handles the cluster client gives out: a reserved block being written, a lease,
and the ticket that hands a reservation to another process.

They take the client's ``ClientSession`` (RPC client, regions, transports),
never the pool, so this module imports neither the pool nor the reads.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from kvpool.api import BlockWriter, Lease
from kvpool.bindings.buffers import Region
from kvpool.cluster.client import fenced
from kvpool.cluster.client.session import TRANSFER_ERRORS, ClientSession, Placement
from kvpool.cluster.wire import (
    COMMIT,
    DEFAULT_ALLOC_TTL,
    EXISTS,
    REVOKE,
    IdsRequest,
    KeysRequest,
)
from kvpool.errors import KVPoolError, StaleWriteError
from kvpool.transport import tcp_wire as w
from kvpool.transport.fencing import WriteStamp

#: A piece of a reserved block for ``fenced.write_parts``: (stamp, region offset, bytes).
_Piece = tuple[WriteStamp, int, Region]


@dataclass(frozen=True)
class ReservationTicket:
    """A reservation exported by ``RemoteBlockWriter.export`` for ``RemotePool.adopt``.

    Plain data (bytes, str, int, float, dicts and lists), so it crosses
    process boundaries in any msgpack payload. ``ttl_s`` is the time left
    before the master revokes the allocation, counted when the ticket was
    made: monotonic clocks are per host, so the adopter re-bases it on its
    own clock. ``nodes`` holds the regions of the nodes in ``allocations``,
    so the adopter can reach them before it ever talked to the master.
    """

    key: bytes
    size: int
    allocations: list[tuple[int, str, int]]  # (allocation id, node id, offset) per replica
    ttl_s: float
    nodes: dict[str, dict[str, Any]]
    epoch: int = 0  # the master term of the allocations (writes are stamped with it)
    parent: bytes | None = None


class RemoteBlockWriter(BlockWriter):
    """A block allocated on the master, filled on its node(s), visible after ``commit``.

    Every write goes to every replica, stamped with its allocation
    (kvpool.cluster.client.fenced); a failed or refused write aborts the block.
    The master revokes allocations not committed within its TTL and may then
    hand the range to another block: the node then refuses this writer's
    stamp, whatever the timing (a writer also stops at ``deadline``, a little
    before that TTL). ``commit`` seals the block on its nodes (they then know
    its key: it survives a master crash) before the master makes it visible.
    """

    def __init__(
        self,
        session: ClientSession,
        key: bytes,
        size: int,
        allocations: Sequence[Sequence[Any]],
        deadline: float | None = None,
        *,
        epoch: int = 0,
        parent: bytes | None = None,
    ) -> None:
        """``allocations``: (allocation id, node id, offset) per replica, as the
        master's allocate reply and a ``ReservationTicket`` both carry them."""
        self._session, self.key, self.size = session, key, size
        self._ids = [int(alloc_id) for alloc_id, _, _ in allocations]
        self._placements = [Placement(str(node), int(offset)) for _, node, offset in allocations]
        # Without a deadline from the allocation reply, assume the default TTL.
        self.deadline = deadline or time.monotonic() + 0.9 * DEFAULT_ALLOC_TTL
        self.epoch, self.parent = epoch, parent
        self._stamps = [
            WriteStamp(epoch, a, p.offset, size, key, parent)
            for a, p in zip(self._ids, self._placements, strict=True)
        ]
        self.done = False

    @property
    def node_ids(self) -> list[str]:
        """The nodes holding a replica of this block."""
        return [p.node_id for p in self._placements]

    def export(self) -> ReservationTicket:
        """A ticket another process's ``RemotePool.adopt`` turns into a writer onto
        the same reserved space. This writer stays valid: whichever side commits
        (or aborts) first decides, and every writer must finish writing first."""
        return ReservationTicket(
            self.key,
            self.size,
            [(a, p.node_id, p.offset) for a, p in zip(self._ids, self._placements, strict=True)],
            self.deadline - time.monotonic(),
            self._session.region_dicts(set(self.node_ids)),
            self.epoch,
            self.parent,
        )

    def _write(self, offset: int, src: Region) -> None:
        self.write_group([(self, offset, src)])

    def _check_writable(self) -> None:
        self._session.check_open()
        if self.done:
            raise KVPoolError("this block writer is already committed or aborted")
        if time.monotonic() > self.deadline:
            raise KVPoolError("this block's reservation expired before it was written; retry")

    def _replicas(self) -> Iterator[tuple[tuple[int, str], Placement, WriteStamp]]:
        """Per replica: (its client and node, to batch by), where, and its stamp."""
        for placement, stamp in zip(self._placements, self._stamps, strict=True):
            yield (id(self._session), placement.node_id), placement, stamp

    @classmethod
    def write_group(cls, writes: Sequence[tuple[BlockWriter, int, Region]]) -> None:
        """Every piece to every replica, one exchange per node for the lot
        (``fenced.write_parts``: pipelined over TCP; a same-host copy claims each
        block once around its pieces). A refused piece raises ``StaleWriteError``:
        its block can no longer commit."""
        by_node: dict[tuple[int, str], list[tuple[RemoteBlockWriter, Placement, _Piece]]] = {}
        for writer, offset, src in writes:
            assert isinstance(writer, RemoteBlockWriter)  # write_pieces groups by class
            writer._check_writable()
            for node, placement, stamp in writer._replicas():
                piece = (stamp, placement.offset + offset, src)
                by_node.setdefault(node, []).append((writer, placement, piece))
        for (_, node_id), items in by_node.items():
            session = items[0][0]._session
            try:
                data, control = session.transport(node_id), session.control(node_id)
                statuses = fenced.write_parts(data, control, [piece for _, _, piece in items])
            except TRANSFER_ERRORS:
                session.suspects.report(node_id)  # the next reserve goes elsewhere
                raise
            for (writer, placement, _), status in zip(items, statuses, strict=True):
                writer._fenced(status, placement)

    def _fenced(self, status: int, placement: Placement) -> None:
        if status != fenced.OK:
            raise StaleWriteError(
                f"node {placement.node_id} refused a write of this block: its reservation "
                "is stale (a newer allocation or master term owns the range); retry"
            )

    def commit(self) -> None:
        self.commit_group([self])

    @classmethod
    def commit_group(cls, writers: Sequence[BlockWriter]) -> None:
        """Seal every block on its nodes (one pipelined exchange per node), then make
        those whose seals all passed visible (one master ``COMMIT`` per client: as
        ``put``'s, the master's first commit of a key wins, a later one is a no-op).
        Every writer is finished afterwards. Raises ``KVPoolError`` when the master
        no longer held a block's allocation (it expired) and ``StaleWriteError`` when
        a node refused a seal, the other blocks committed; on a transfer error the
        blocks not committed yet are revoked."""
        group: list[RemoteBlockWriter] = []
        for writer in writers:
            assert isinstance(writer, RemoteBlockWriter)  # commit_all groups by class
            writer._session.check_open()
            if writer.done:
                raise KVPoolError("this block writer is already committed or aborted")
            group.append(writer)
        for writer in group:
            writer.done = True
        refused: Placement | None = None
        try:
            sealed = cls._seal(group)
            refused = next((p for p in sealed.values() if p is not None), None)
            lost = cls._commit_sealed([w_ for w_ in group if sealed[id(w_)] is None])
        except BaseException:
            for writer in group:
                writer._revoke()  # a no-op at the master for a block it committed
            raise
        if lost:
            raise KVPoolError(
                f"{lost} block(s) not stored: the master's allocation expired before the "
                "commit (its --alloc-ttl); retry"
            )
        if refused is not None:
            raise StaleWriteError(
                f"node {refused.node_id} refused to seal a block: its reservation is stale "
                "(a newer allocation or master term owns the range); retry"
            )

    @staticmethod
    def _seal(group: Sequence[RemoteBlockWriter]) -> dict[int, Placement | None]:
        """``OP_SEAL`` of every replica, pipelined per node: per writer (by id) None,
        or the placement of a seal the node refused."""
        out: dict[int, Placement | None] = {id(writer): None for writer in group}
        by_node: dict[tuple[int, str], list[tuple[RemoteBlockWriter, Placement, WriteStamp]]]
        by_node = {}
        for writer in group:
            for node, placement, stamp in writer._replicas():
                by_node.setdefault(node, []).append((writer, placement, stamp))
        for (_, node_id), items in by_node.items():
            control = items[0][0]._session.control(node_id)
            statuses = fenced.ops(control, w.OP_SEAL, [stamp for _, _, stamp in items])
            for (writer, placement, _), status in zip(items, statuses, strict=True):
                if status != fenced.OK and out[id(writer)] is None:
                    out[id(writer)] = placement
        return out

    @staticmethod
    def _commit_sealed(group: Sequence[RemoteBlockWriter]) -> int:
        """One master ``COMMIT`` per client, of every replica of ``group``; how many
        blocks the master made visible on no replica while their key is not stored:
        their allocation expired before the commit (a key stored by another writer's
        earlier commit is the contract's first-commit-wins, not a loss). The keys of
        blocks answered False are looked up in one more round trip, only then."""
        by_session: dict[int, list[RemoteBlockWriter]] = {}
        for writer in group:
            by_session.setdefault(id(writer._session), []).append(writer)
        lost = 0
        for writers in by_session.values():
            rpc = writers[0]._session.rpc
            answers = iter(rpc.call(COMMIT, IdsRequest([a for w_ in writers for a in w_._ids])))
            refused = [w_.key for w_ in writers if True not in [next(answers) for _ in w_._ids]]
            if refused:
                lost += rpc.call(EXISTS, KeysRequest(refused)).count(False)
        return lost

    def abort(self) -> None:
        """Revoke the allocation; after the pool closed, the master's TTL does it."""
        if not self.done:
            self.done = True
            self._revoke()

    def _revoke(self) -> None:
        if not self._session.closed:
            with contextlib.suppress(KVPoolError):
                self._session.rpc.submit(REVOKE, IdsRequest(self._ids))


class RemoteLease(Lease):
    """Blocks pinned on the master; reads of them need no further round trip.

    ``sizes[i]`` and ``nodes[i]`` are the size and replica nodes of
    ``keys[i]`` (the cluster's extra over ``kvpool.api.Lease``). Releasing
    calls ``unpin``, which hands the lease to the client's lease cache; the
    cache gives it back to the master shortly after
    (kvpool.cluster.client.lease_cache).
    """

    def __init__(
        self,
        keys: Sequence[bytes],
        sizes: Sequence[int],
        nodes: Sequence[list[str]],
        unpin: Callable[[], None],
    ) -> None:
        self.keys, self.sizes, self.nodes = list(keys), list(sizes), list(nodes)
        self._unpin: Callable[[], None] | None = unpin

    def release(self) -> None:
        unpin, self._unpin = self._unpin, None
        if unpin is not None:
            unpin()

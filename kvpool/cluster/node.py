"""``kvpool node``: contributes a DRAM arena to the pool and serves its bytes.

The node owns a shared-memory arena (same-host clients map it directly) and
a TCP data server over it (other hosts). It does not place blocks: the
master allocates ranges of the arena. But every write names its allocation
and block (a ``WriteStamp``), and the node's ``BlockTable``
(kvpool.cluster.block_table) checks it under its lock: writes from another
master term, or into a range a newer allocation owns, are refused. Once a
write is acknowledged the node knows the block's key, so when the master
restarts (or another takes over) the node registers again with every whole
block it holds, acknowledged puts included, after checking each block's
bytes against its checksum. Heartbeat replies tell it which blocks were
committed and which ranges were freed.

Same-host puts sealed in shared memory may leave their master commit to
the node: its ``SealCommitter`` thread (kvpool.cluster.node_commits) adopts
those seals and commits them on a connection of its own.

Terms: the node registers with the master's epoch and accepts only that
term's writes and control calls; a master of a lower term than one the node
served is refused (``StaleEpochError``) and the node tries the next address.

With ``--ssd DIR`` the node also has an SSD tier (kvpool.storage.ssd_tier) and a
small RPC server of its own: the master asks it to copy DRAM blocks to SSD
(``ssd.store``, ahead of eviction) and to load SSD blocks back into DRAM
ranges it allocated (``ssd.load``). The node evicts its own SSD (least
recently stored or loaded first) and reports what it dropped. SSD blocks
survive a node restart and are registered again.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import secrets
import socket
import threading
from dataclasses import dataclass
from typing import Any

import xxhash

from kvpool.cluster.block_table import BlockTable
from kvpool.cluster.link import MasterLink
from kvpool.cluster.metrics import Metrics
from kvpool.cluster.node_commits import ORPHAN_MARGIN_S, SealCommitter
from kvpool.cluster.node_ssd import NodeSsd
from kvpool.cluster.wire import (
    EVENT_COMMIT,
    EVENT_FREE,
    EVENT_SSD_DROP,
    HEARTBEAT,
    NODE_HELLO,
    REGISTER,
    SSD_LOAD,
    SSD_STORE,
    Heartbeat,
    HeartbeatReply,
    RegisterNode,
)
from kvpool.errors import KVPoolError, StaleEpochError
from kvpool.rpc.server import RpcServer, ServerConfig
from kvpool.storage.arena import SharedArena
from kvpool.transport.base import RegionInfo
from kvpool.transport.peers import expose_region
from kvpool.transport.shm import shm_path
from kvpool.transport.shm_ident import ALIGN, BlockIdents, ident_name
from kvpool.transport.shm_seal import SealRecords, seal_name
from kvpool.transport.tcp_read_gate import ReadGate

log = logging.getLogger("kvpool.cluster.node")


@dataclass(frozen=True)
class NodeConfig:
    master: str | tuple[str, int]  # "host:port[,host:port...]" or (host, port)
    dram_bytes: int
    host: str = "127.0.0.1"  # where the TCP data server listens
    data_port: int = 0
    token: str | None = None
    node_id: str | None = None
    heartbeat_interval: float = 1.0
    rpc_timeout: float = 5.0
    metrics_port: int | None = None
    ssd_path: str | None = None
    ssd_bytes: int = 0


class StorageNode:
    """Arena + data server + registration/heartbeat loop; ``start()`` runs it in threads."""

    def __init__(self, config: NodeConfig) -> None:
        self.config = config
        self.node_id = (
            config.node_id or f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"
        )
        self.arena = SharedArena(config.dram_bytes)
        try:  # published beside the arena: same-host readers check their block there
            self.idents = BlockIdents(
                shm_path(ident_name(self.arena.name)), self.arena.size, create=True
            )
        except BaseException:
            self.arena.close()
            raise
        try:  # same-host writers seal claims taken ahead there (kvpool.transport.shm_seal)
            self.seals = SealRecords(
                shm_path(seal_name(self.arena.name)),
                self.arena.size,
                create=True,
                node_commits=True,
            )
        except BaseException:
            self.idents.close()
            self.arena.close()
            raise
        # checked TCP reads served natively, held by counts (kvpool.transport.tcp_read_gate)
        self.read_gate = ReadGate(self.idents, self.arena.view)
        self.table = BlockTable(
            self._checksum, idents=self.idents, seals=self.seals, read_gate=self.read_gate
        )
        # blocks no commit event confirmed within a heartbeat (+ margin) of their seal: the
        # node commits them for their writer (kvpool.cluster.unconfirmed)
        orphan_age = config.heartbeat_interval + ORPHAN_MARGIN_S
        self.committer = SealCommitter(self.table, self.seals, self._commit_link, orphan_age)
        try:
            self.exposed = expose_region(
                self.arena.view,
                node_id=self.node_id,
                shm_name=self.arena.name,
                host=config.host,
                port=config.data_port,
                token=config.token,
                fence=self.table,
                commits=self.committer,
                read_gate=self.read_gate,
            )
        except BaseException:
            self.seals.close()
            self.idents.close()
            self.arena.close()
            raise
        try:
            self.ssd = (
                NodeSsd(config.ssd_path, config.ssd_bytes, self.arena.view)
                if (config.ssd_path)
                else None
            )
            self.control = RpcServer(
                ServerConfig(host=config.host, port=0, token=config.token, name="kvpool-node")
            )
        except BaseException:
            self.exposed.close()
            self.seals.close()
            self.idents.close()
            self.arena.close()
            raise
        if self.ssd is not None:
            self.control.register(SSD_STORE, self._this_term(self.ssd.store))
            self.control.register(SSD_LOAD, self._this_term(self._load_from_ssd))
        self.metrics = Metrics("node")
        self.metrics_port: int | None = None
        self.registered = threading.Event()
        self._checksums: list[list[Any]] = []  # computed, not yet reported
        self._joined_before = False
        self._client: MasterLink | None = None
        self._commits_link: MasterLink | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="kvpool-heartbeat", daemon=True)

    def region(self) -> RegionInfo:
        """What the node advertises: data transports, control port, SSD capacity."""
        return dataclasses.replace(
            self.exposed.info,
            control_port=self.control.address[1],
            ssd_bytes=0 if self.ssd is None else self.ssd.tier.capacity,
        )

    def start(self) -> None:
        self.control.start()
        if self.config.metrics_port is not None:
            self.metrics_port = self.metrics.serve(self.config.host, self.config.metrics_port)
        self.metrics.capacity.labels(self.node_id).set(self.arena.size)
        self._thread.start()
        self.committer.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(self.config.rpc_timeout + self.config.heartbeat_interval)
        self.committer.close()
        for link in (self._client, self._commits_link):
            if link is not None:
                link.close()
        self.control.close()
        self.exposed.close()
        if self.ssd is not None:
            self.ssd.close()
        self.metrics.close()
        self.seals.close()
        self.idents.close()
        self.arena.close()

    # -- the loop ---------------------------------------------------------------

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                if not self.registered.is_set():
                    self._register()
                self._heartbeat()
            except (KVPoolError, OSError) as exc:
                log.warning("master %s unreachable: %s (retrying)", self.config.master, exc)
                self.registered.clear()
                if isinstance(exc, StaleEpochError):
                    self._rpc().skip()  # a deposed master: try the next address
            self._stop.wait(self.config.heartbeat_interval)

    def _this_term(self, handler: Any) -> Any:
        """A master-to-node handler that refuses calls from another master term."""

        def checked(params: dict[str, Any]) -> Any:
            if params.get("epoch") != self.table.epoch:
                raise StaleEpochError(
                    f"call from master term {params.get('epoch')}; this node serves "
                    f"term {self.table.epoch}"
                )
            return handler(params["items"])

        return checked

    def _load_from_ssd(self, items: list[list[Any]]) -> list[bool]:
        """Promote SSD blocks into the DRAM ranges the master chose; the table learns
        each at once (checked reads of it may follow before the next heartbeat)."""
        assert self.ssd is not None
        for key, offset, *_ in items:  # the master chose these ranges: nothing else is there
            found = self.ssd.describe(key)
            if found is not None:  # the load writes whole pages
                self.table.take_over(offset, -(-found[0] // ALIGN) * ALIGN)
        loaded = self.ssd.load(items)
        for (key, offset, *rest), ok in zip(items, loaded, strict=True):
            found = self.ssd.describe(key) if ok else None
            if found is not None:
                alloc_id = rest[0] if rest else 0
                self.table.promoted(key, offset, found[0], found[1], alloc_id)
        return loaded

    def _rpc(self) -> MasterLink:
        if self._client is None:
            name = f"{NODE_HELLO} {self.node_id}"
            self._client = self._new_link(name, self.config.heartbeat_interval)
        return self._client

    def _commit_link(self) -> MasterLink:
        """The committer's own connection to the master (kvpool.cluster.node_commits):
        its calls ride a restart or failover (the failover deadline), as a client's do."""
        if self._commits_link is None:
            name = f"kvpool-node-commits {self.node_id}"
            self._commits_link = self._new_link(name, None)
        return self._commits_link

    def _new_link(self, name: str, deadline: float | None) -> MasterLink:
        """``deadline``: how long a call retries (None: the failover deadline)."""
        c = self.config
        return MasterLink(
            c.master,
            token=c.token,
            timeout=c.rpc_timeout,
            name=name,
            deadline=deadline,
            connect=False,
        )

    def _register(self) -> None:
        table = self.table
        table.suspend()  # no write completes between the listing and the new term
        held = table.listing()
        ssd_blocks = [] if self.ssd is None else self.ssd.listing()
        message = RegisterNode(
            self.region(), held, ssd_blocks, rejoin=self._joined_before, epoch=table.highest
        )
        reply = self._rpc().call(REGISTER, message)
        epoch = int(reply.get("epoch", 0))
        if epoch < table.highest:
            raise StaleEpochError(f"master term {epoch} is older than {table.highest}")
        table.new_term(epoch)
        for offset in reply.get("refused", []):  # nobody will read them: drop them
            table.freed(offset)
        self._checksums.clear()
        self._joined_before = True
        self.registered.set()
        log.info(
            "registered with %s as %s in term %d (%d blocks kept)",
            self.config.master,
            self.node_id,
            epoch,
            reply.get("restored", 0),
        )

    def _heartbeat(self) -> None:
        beat = Heartbeat(self.node_id, self._checksums, epoch=self.table.epoch)
        reply = self._rpc().call(HEARTBEAT, beat, response_type=HeartbeatReply)
        if reply.epoch < self.table.highest:
            raise StaleEpochError(f"master term {reply.epoch} is older than {self.table.highest}")
        self._checksums = []
        if not reply.known:
            log.warning(
                "master %s does not know this node (restarted?): registering again",
                self.config.master,
            )
            self.registered.clear()
            self._register()
            return
        self._apply(reply.events)

    def _apply(self, events: list[list[Any]]) -> None:
        """Replay commits and frees in order; checksum the blocks that survive the batch."""
        committed = []
        for event in events:
            if event[0] == EVENT_COMMIT:
                _, key, offset, size, parent, *rest = event  # alloc_id: absent from old masters
                entry = self.table.committed(key, offset, size, parent, rest[0] if rest else 0)
                if entry is not None:
                    committed.append(entry)
            elif event[0] == EVENT_FREE:
                self.table.freed(event[1], event[2] if len(event) > 2 else 0)
            elif event[0] == EVENT_SSD_DROP and self.ssd is not None:
                self.ssd.drop(event[1])
        for entry in committed:
            self._checksums.append([entry.stamp.key, self.table.set_checksum(entry)])
        used, count = self.table.used_bytes()
        self.metrics.used.labels(self.node_id).set(used)
        self.metrics.blocks.set(count)
        self._count_served()

    def _count_served(self) -> None:
        """Move the data servers' byte counters (TCP, UCX) into the Prometheus counters."""
        for transport, (out, into) in self.exposed.served().items():
            self.metrics.count_moved(transport, "out", out)
            self.metrics.count_moved(transport, "in", into)

    def _checksum(self, offset: int, size: int) -> int:
        return xxhash.xxh3_64_intdigest(self.arena.view[offset : offset + size].data)

"""``kvpool node``: contributes a DRAM arena to the pool and serves its bytes.

The node owns a shared-memory arena (same-host clients map it directly) and
a TCP data server over it (other hosts). It knows nothing about placement:
the master allocates ranges of the arena and tells the node, through
heartbeat replies, which blocks were committed and which ranges were freed.
The node keeps that list so that, when the master restarts and no longer
knows it, the node registers again with every block it still holds, after
checking each block's bytes against the checksum it took at commit.

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

from kvpool.cluster.metrics import Metrics
from kvpool.cluster.node_ssd import NodeSsd
from kvpool.cluster.wire import (
    EVENT_COMMIT,
    EVENT_FREE,
    EVENT_SSD_DROP,
    HEARTBEAT,
    REGISTER,
    SSD_LOAD,
    SSD_STORE,
    Heartbeat,
    HeartbeatReply,
    RegisterNode,
)
from kvpool.errors import KVPoolError
from kvpool.rpc.client import RpcClient
from kvpool.rpc.server import RpcServer, ServerConfig
from kvpool.storage.arena import SharedArena
from kvpool.transport.base import RegionInfo
from kvpool.transport.peers import expose_region

log = logging.getLogger("kvpool.cluster.node")


@dataclass(frozen=True)
class NodeConfig:
    master: str | tuple[str, int]  # "host:port" or (host, port)
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


@dataclass
class HeldBlock:
    key: bytes
    offset: int
    size: int
    parent: bytes | None
    checksum: int

    def wire(self) -> list[Any]:
        return [self.key, self.offset, self.size, self.checksum, self.parent]


class StorageNode:
    """Arena + data server + registration/heartbeat loop; ``start()`` runs it in threads."""

    def __init__(self, config: NodeConfig) -> None:
        self.config = config
        self.node_id = (
            config.node_id or f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"
        )
        self.arena = SharedArena(config.dram_bytes)
        try:
            self.exposed = expose_region(
                self.arena.view,
                node_id=self.node_id,
                shm_name=self.arena.name,
                host=config.host,
                port=config.data_port,
                token=config.token,
            )
        except BaseException:
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
            self.arena.close()
            raise
        if self.ssd is not None:
            self.control.register(SSD_STORE, self.ssd.store)
            self.control.register(SSD_LOAD, self.ssd.load)
        self.metrics = Metrics("node")
        self.metrics_port: int | None = None
        self.blocks: dict[int, HeldBlock] = {}  # by offset
        self.registered = threading.Event()
        self._checksums: list[list[Any]] = []  # computed, not yet reported
        self._joined_before = False
        self._client: RpcClient | None = None
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

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(self.config.rpc_timeout + self.config.heartbeat_interval)
        if self._client is not None:
            self._client.close()
        self.control.close()
        self.exposed.close()
        if self.ssd is not None:
            self.ssd.close()
        self.metrics.close()
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
                self._drop_client()
            self._stop.wait(self.config.heartbeat_interval)

    def _rpc(self) -> RpcClient:
        if self._client is None:
            self._client = RpcClient(
                self.config.master,
                token=self.config.token,
                timeout=self.config.rpc_timeout,
                name=f"node {self.node_id}",
            )
        return self._client

    def _drop_client(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

    def _register(self) -> None:
        held = [b for b in self.blocks.values() if self._intact(b)]
        self.blocks = {b.offset: b for b in held}
        ssd_blocks = [] if self.ssd is None else self.ssd.listing()
        message = RegisterNode(
            self.region(), [b.wire() for b in held], ssd_blocks, rejoin=self._joined_before
        )
        reply = self._rpc().call(REGISTER, message)
        self._checksums.clear()
        self._joined_before = True
        self.registered.set()
        log.info(
            "registered with %s as %s (%d blocks kept)",
            self.config.master,
            self.node_id,
            reply.get("restored", 0),
        )

    def _heartbeat(self) -> None:
        beat = Heartbeat(self.node_id, self._checksums)
        reply = self._rpc().call(HEARTBEAT, beat, response_type=HeartbeatReply)
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
        committed: list[HeldBlock] = []
        for event in events:
            if event[0] == EVENT_COMMIT:
                _, key, offset, size, parent = event
                block = HeldBlock(key, offset, size, parent, 0)
                self._forget_overlaps(offset, size)
                self.blocks[offset] = block
                committed.append(block)
            elif event[0] == EVENT_FREE:
                self.blocks.pop(event[1], None)
            elif event[0] == EVENT_SSD_DROP and self.ssd is not None:
                self.ssd.drop(event[1])
        for block in committed:
            if self.blocks.get(block.offset) is block:
                block.checksum = self._checksum(block)
                self._checksums.append([block.key, block.checksum])
        used = sum(b.size for b in self.blocks.values())
        self.metrics.used.labels(self.node_id).set(used)
        self.metrics.blocks.set(len(self.blocks))
        self._count_served()

    def _count_served(self) -> None:
        """Move the data servers' byte counters (TCP, UCX) into the Prometheus counters."""
        for transport, (out, into) in self.exposed.served().items():
            self.metrics.count_moved(transport, "out", out)
            self.metrics.count_moved(transport, "in", into)

    def _forget_overlaps(self, offset: int, size: int) -> None:
        for other in [
            b
            for b in self.blocks.values()
            if b.offset < offset + size and offset < b.offset + b.size
        ]:
            del self.blocks[other.offset]

    def _checksum(self, block: HeldBlock) -> int:
        return xxhash.xxh3_64_intdigest(
            self.arena.view[block.offset : block.offset + block.size].data
        )

    def _intact(self, block: HeldBlock) -> bool:
        return block.checksum != 0 and self._checksum(block) == block.checksum

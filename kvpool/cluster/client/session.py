"""One cluster client's shared state: the master connection, node regions, transports.

A ``RemotePool`` is a thin facade over parts that each need the same three
things: the RPC client to the master (metadata), the regions the nodes
advertise (where a placement's offset points) and the data-plane transport
to each node (shm, UCX or TCP; kvpool.transport.select). ``ClientSession``
holds exactly those, and the puts, reads and handles take the session
instead of the pool, so none of them reaches into another's private state.

Invariants:
- ``regions[node_id]`` is the newest region the master reported for the
  node; a transport is reused only while its node's region is unchanged
  (a restarted node's new arena gets a new transport);
- listeners registered with ``on_region_change`` hear of every node whose
  region changed (grants on the old region must not be used);
- ``check_open`` raises ``PoolClosedError`` once ``close`` began, and no
  transport, control transport or seal records are made after that (the
  connect-time warm-up, kvpool.cluster.client.warm_up, may be building one).
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from kvpool.bindings.buffers import Region
from kvpool.cluster.client import fenced
from kvpool.cluster.client.suspects import Suspects
from kvpool.cluster.link import MasterLink
from kvpool.errors import PoolClosedError, StaleReadError, StaleWriteError
from kvpool.transport.base import RegionInfo, Transport, host_identity
from kvpool.transport.fencing import WriteStamp
from kvpool.transport.peers import PeerTransports
from kvpool.transport.shm import ShmTransport, shm_path
from kvpool.transport.shm_seal import SealRecords, seal_name
from kvpool.transport.tcp import TcpTransport
from kvpool.transport.ucx import UcxTransport

#: What a failed data-plane transfer raises (the node died, restarted, or is unreachable,
#: or it refused a stale write or a read of a block that moved).
TRANSFER_ERRORS = (ConnectionError, TimeoutError, OSError, StaleWriteError, StaleReadError)

#: A checked read, as the transports take it (``TcpTransport.read_blocks``): (offset in
#: the node's region, destination, the block's key, the block's offset); the bytes
#: [offset, offset + len(destination)) lie inside that block.
Read = tuple[int, Region, bytes, int]


@dataclass(frozen=True)
class Placement:
    """One replica of a block: ``size`` bytes at ``offset`` of ``node_id``'s region."""

    node_id: str
    offset: int
    size: int = 0


class ClientSession:
    """The RPC client, the nodes' regions and the transports of one cluster client."""

    def __init__(
        self,
        master: str,
        *,
        token: str | None,
        timeout: float,
        transport: str | None,
        failover_s: float | None = None,
    ) -> None:
        self.token, self.timeout = token, timeout
        self.rpc = MasterLink(
            master, token=token, timeout=timeout, name="kvpool-client", deadline=failover_s
        )
        self.regions: dict[str, RegionInfo] = {}
        self.peers = PeerTransports(token=token, timeout=timeout, override=transport)
        self.counts: Counter[str] = Counter()  # the client's own counters, for stats()
        self.suspects = Suspects()  # nodes seen failing: avoided in allocations asked for
        self.closed = False
        self._by_region: dict[str, tuple[RegionInfo, Transport]] = {}  # skips peers' lock
        self._controls: dict[str, TcpTransport] = {}  # fenced-write side channel per node
        self._seals: dict[str, tuple[RegionInfo, SealRecords | None]] = {}
        self._shm_seals = os.environ.get("KVPOOL_SHM_SEAL", "1") != "0"  # 0: TCP seals only
        self._listeners: list[Callable[[str], None]] = []
        # Held while a control transport or seal records are made, and by close(): one
        # thread makes each (a put and the warm-up may ask at once), none after close
        self._making = threading.Lock()

    def on_region_change(self, listener: Callable[[str], None]) -> None:
        """Call ``listener(node_id)`` whenever a known node's region changes."""
        self._listeners.append(listener)

    def check_open(self) -> None:
        if self.closed:
            raise PoolClosedError("the pool is closed")

    def learn(self, nodes: dict[str, RegionInfo]) -> None:
        """Take in the regions a master reply names (maybe restarted nodes)."""
        regions = self.regions
        for node_id, region in nodes.items():
            old = regions.get(node_id)
            if old is not None and old == region:
                continue  # the same object stays: the hot paths compare identities
            regions[node_id] = region  # a restarted node's new region replaces its transport
            if old is not None:  # what failed was the old incarnation
                self.suspects.cleared(node_id)
                for listener in self._listeners:
                    listener(node_id)

    def region_dicts(self, node_ids: set[str]) -> dict[str, dict[str, object]]:
        """The known regions of ``node_ids`` as plain, wire-safe data."""
        return {n: self.regions[n].to_dict() for n in node_ids}

    def transport(self, node_id: str) -> Transport:
        """The transport to ``node_id``'s current region (connected on demand)."""
        region = self.regions[node_id]
        known = self._by_region.get(node_id)
        if known is not None and known[0] is region:  # the common case: nothing changed
            return known[1]
        transport = self.peers.get(region)
        self._by_region[node_id] = (region, transport)
        return transport

    def control(self, node_id: str) -> TcpTransport:
        """A TCP transport to ``node_id`` for the write fence's claims and seals
        (the data transport itself when that is TCP)."""
        data = self.transport(node_id)
        if isinstance(data, TcpTransport):
            return data
        region = self.regions[node_id]
        known = self._controls.get(node_id)
        if known is not None and (known.info is region or known.info == region):
            return known
        with self._making:
            self.check_open()
            known = self._controls.get(node_id)
            if known is not None and (known.info is region or known.info == region):
                return known  # another thread made it meanwhile
            fresh = TcpTransport(region, token=self.token, timeout=self.timeout, max_connections=2)
            self._controls[node_id] = fresh
        if known is not None:
            known.close()
        return fresh

    def write_blocks(
        self,
        node_id: str,
        items: Sequence[tuple[WriteStamp, Region]],
        claimed: Mapping[int, int] | frozenset[int] = frozenset(),
    ) -> tuple[list[int], Callable[[], list[int]] | None]:
        """Whole blocks under the node's write fence: (a tcp_wire status per item,
        None or the call that waits for the last round trip; see
        ``fenced.write_blocks_begin``). ``claimed``: indices whose claim was taken
        ahead (kvpool.cluster.client.claims), with the clock read before it was sent."""
        stamped = [(stamp, stamp.offset, src) for stamp, src in items]
        data, control = self.transport(node_id), self.control(node_id)
        seals = self.seals(node_id) if claimed and not isinstance(data, TcpTransport) else None
        return fenced.write_blocks_begin(data, control, stamped, claimed, seals, self.counts)

    def seals(self, node_id: str) -> SealRecords | None:
        """The seal records beside ``node_id``'s arena (same host; None: the node
        publishes none, so every seal goes over TCP)."""
        if not self._shm_seals:
            return None
        region = self.regions[node_id]
        known = self._seals.get(node_id)
        if known is not None and (known[0] is region or known[0] == region):
            if known[0] is not region:  # an equal region from a newer reply: same file
                self._seals[node_id] = (region, known[1])
            return known[1]
        with self._making:
            self.check_open()
            known = self._seals.get(node_id)
            if known is not None and (known[0] is region or known[0] == region):
                return known[1]  # another thread made them meanwhile
            records = None
            with contextlib.suppress(OSError, ValueError):
                if region.shm_name and region.host_id == host_identity():
                    path = shm_path(seal_name(region.shm_name))
                    records = SealRecords(path, region.size, create=False)
            self._seals[node_id] = (region, records)
        if known is not None and known[1] is not None:
            known[1].close()
        return records

    def straight_writer(
        self, node_id: str, granted: RegionInfo
    ) -> tuple[ShmTransport, SealRecords] | TcpTransport | None:
        """How a put writes a grant's block to ``node_id`` with no master frame, while
        the node's region is still ``granted`` (a grant's) and the node commits such
        writes (kvpool.cluster.node_commits): its shared-memory transport and seal
        records (the put seals there), its TCP transport (the put's ``WRITE_COMMIT``
        asks the node to commit), or None. One look-up of the node's transport
        for either way (the straight path's hot path)."""
        data = self._granted_transport(node_id, granted)
        if type(data) is ShmTransport:
            seals = self.seals(node_id)
            return None if seals is None or not seals.node_commits else (data, seals)
        return data if type(data) is TcpTransport and data.info.tcp_node_commits else None

    def _granted_transport(self, node_id: str, granted: RegionInfo) -> Transport | None:
        """``node_id``'s transport while its region is still ``granted``; None once the
        node restarted since the grant (the grant is no use then)."""
        region = self.regions.get(node_id)
        if region is None or (region is not granted and region != granted):
            return None
        return self.transport(node_id)

    def write_block(self, node_id: str, stamp: WriteStamp, src: Region) -> None:
        """One whole block; ``StaleWriteError`` when the node refuses its stamp."""
        statuses, rest = self.write_blocks(node_id, [(stamp, src)])
        status = (statuses if rest is None else rest())[0]
        if status != fenced.OK:
            raise StaleWriteError(f"node {node_id} refused the write (status {status})")

    def read_many(self, node_id: str, items: Sequence[Read]) -> None:
        """Reads (offset, destination, key, block offset) from one node, pipelined;
        ``StaleReadError`` if any block no longer holds its range."""
        transport = self.transport(node_id)
        if isinstance(transport, (TcpTransport, UcxTransport)):  # the node checks
            if not all(transport.read_blocks(items)):
                raise StaleReadError(f"node {node_id} holds other blocks there now")
        else:
            transport.read_many([(offset, dst) for offset, dst, _, _ in items])

    def read_checked(self, node_id: str, items: Sequence[Read]) -> None:
        """``read_many`` over the node's TCP control connection, checked by the node
        whatever the data path: a same-host read whose identity record is not
        published yet (a put sealed in shared memory the node has not adopted yet,
        kvpool.transport.shm_seal) is served, and the node adopts that seal."""
        if not all(self.control(node_id).read_blocks(items)):
            raise StaleReadError(f"node {node_id} holds other blocks there now")

    def node_alive(self, node_id: str) -> bool:
        """Whether the node's data port still takes a connection (False: refused or no
        answer within 0.25 s: its process is gone); True where it serves no TCP port."""
        region = self.regions.get(node_id)
        if region is None or not region.tcp_port:
            return True
        try:
            socket.create_connection((region.tcp_host, region.tcp_port), timeout=0.25).close()
        except OSError:
            return False
        return True

    def preferred(self, placements: list[Placement]) -> Placement:
        """The replica to read first: one on this host, else the master's first
        (least loaded); either way one on a node not seen failing lately, if any
        (``suspects``: a dead host's connect can take the whole timeout)."""
        if len(placements) > 1:
            avoid = self.suspects.current()
            if avoid:
                placements = [p for p in placements if p.node_id not in avoid] or placements
            here = host_identity()
            for placement in placements:
                if self.regions[placement.node_id].host_id == here:
                    return placement
        return placements[0]

    def close(self) -> None:
        """Refuse further calls and drop the transports and the master connection."""
        with self._making:
            self.closed = True
        for control in list(self._controls.values()):
            control.close()
        for _, records in list(self._seals.values()):
            if records is not None:
                records.close()
        self.peers.close()
        self.rpc.close()

"""``kvpool.connect(url)``: the cluster-wide pool, implementing ``kvpool.api.KVStore``.

Metadata goes to the master (one round trip per batch and phase); bytes go
straight between this process and the nodes over the fastest transport per
node (shared memory on the same host, else UCX or TCP; see
kvpool.transport.select). ``RemotePool`` is a thin facade: it checks every
argument (``kvpool.args``, the same checks as the embedded pool) and hands
the work to the parts that share one ``ClientSession``:

- ``puts.RemotePutter``: allocate (or use a grant), write, commit;
- ``reads.LeasedReads``: leases, the lease cache, replica fall-back;
- ``reservations``: reserved blocks (``handles.RemoteBlockWriter``), one
  allocation round trip per batch, or adopted from another process;
- ``handles``: ``RemoteLease``.

Reads run under a lease, so the master cannot free or reuse a block's range
while it is copied; a read that outlives its lease, or whose node fails, is
answered from another replica or as a miss, never with wrong bytes.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlparse

import numpy as np

from kvpool.api import Buffer
from kvpool.args import (
    check_batch,
    check_client_options,
    check_key,
    check_keys,
    check_parent,
    check_read_range,
    check_read_ranges,
    check_reserve_batch,
    check_reserve_size,
    data_region,
    out_region,
)
from kvpool.bindings.buffers import plain_host
from kvpool.cluster.client import at_exit
from kvpool.cluster.client.grants import grant_budget
from kvpool.cluster.client.handles import RemoteBlockWriter, RemoteLease, ReservationTicket
from kvpool.cluster.client.lease_cache import DEFAULT_HOLD_S, DEFAULT_MAX_BYTES
from kvpool.cluster.client.put_modes import pipelined_default
from kvpool.cluster.client.puts import RemotePutter
from kvpool.cluster.client.reads import LeasedReads
from kvpool.cluster.client.replica_reads import read_replicas
from kvpool.cluster.client.reservations import adopt, reserve_blocks
from kvpool.cluster.client.session import TRANSFER_ERRORS, ClientSession
from kvpool.cluster.client.warm_up import TransportWarmUp
from kvpool.cluster.wire import (
    COMMIT,
    EXISTS,
    LOCATE,
    PREFIX,
    REMOVE,
    REPLICATE,
    REVOKE,
    STATS,
    IdsRequest,
    KeysRequest,
    ReplicateReply,
    ReplicateRequest,
)
from kvpool.config import DEFAULT_PORT
from kvpool.errors import KVPoolError, PoolFullError, PutCommitError
from kvpool.index.keys import KEY_BYTES
from kvpool.layerwise.api import LayerwiseMethods
from kvpool.transport.fencing import WriteStamp


def connect(url: str, *, token: str | None = None, timeout: float = 10.0, **kw: Any) -> RemotePool:
    """A pool backed by the cluster whose master is at ``kvpool://HOST:PORT``; with
    HA masters, name them all: ``kvpool://H1:P1,H2:P2,H3:P3`` (calls follow the
    leader and ride through failovers, kvpool.cluster.link)."""
    masters = []
    for part in (url if "://" in url else f"kvpool://{url}").split(","):
        parsed = urlparse(part if "://" in part else f"kvpool://{part}")
        if parsed.scheme != "kvpool" or not parsed.hostname:
            raise ValueError(f"expected kvpool://HOST:PORT[,HOST:PORT...], got {url!r}")
        masters.append(f"{parsed.hostname}:{parsed.port or DEFAULT_PORT}")
    return RemotePool(",".join(masters), token=token, timeout=timeout, **kw)


class RemotePool(LayerwiseMethods):
    """put/get/get_into/exists/prefix_match/remove/stats, batch forms, reserve, lease."""

    def __init__(
        self,
        master: str,
        *,
        token: str | None = None,
        timeout: float = 10.0,
        transport: str | None = None,
        contribute_dram: int = 0,
        lease_cache_s: float = DEFAULT_HOLD_S,
        lease_cache_bytes: int = DEFAULT_MAX_BYTES,
        put_grant_bytes: int | None = None,
        failover_s: float | None = None,
        pipelined_puts: bool | None = None,
    ) -> None:
        """``failover_s``: how long a call waits for a master through a restart or
        failover before it raises ``MasterUnavailableError`` (default 10 s,
        ``$KVPOOL_FAILOVER_S``). ``pipelined_puts``: a put returns once its node
        holds the block, its master commit answered in the background (default
        True, ``$KVPOOL_PUT_PIPELINE=0`` turns it off; kvpool.cluster.client.commits)."""
        check_client_options(
            timeout, lease_cache_s, lease_cache_bytes, contribute_dram, put_grant_bytes
        )
        self.token, self.timeout = token, timeout
        pipelined = pipelined_default(pipelined_puts)  # bad settings fail before connecting
        budget = grant_budget(put_grant_bytes)
        self._session = ClientSession(
            master, token=token, timeout=timeout, transport=transport, failover_s=failover_s
        )
        self._reads = LeasedReads(self._session, lease_cache_s, lease_cache_bytes)
        self._putter = RemotePutter(self._session, budget, pipelined)
        self._stop = threading.Event()
        self._janitor = threading.Thread(
            target=self._hand_back_loop, name="kvpool-lease-cache", daemon=True
        )
        self._janitor.start()
        self._node = self._contribute(master, contribute_dram) if contribute_dram else None
        self._warm_up = TransportWarmUp(self._session)  # same-host nodes' transports, now
        at_exit.track(self)  # acknowledged puts get their commits out before the process ends

    # -- writes -------------------------------------------------------------------

    def put(
        self, key: bytes, data: Buffer, *, parent: bytes | None = None, replicas: int = 1
    ) -> bool:
        """Store ``data`` under ``key``; False if it is already stored. Raises
        ``PutFailedError`` if its writes kept failing until the failover deadline
        (nodes died, or master failovers cut them): then nothing is visible for it."""
        if type(key) is not bytes or len(key) != KEY_BYTES:  # a good key costs no call
            check_key(key)
        if parent is not None:
            check_parent(parent)
        if not (plain_host(data) and data.nbytes):  # else data_region's checks hold already
            return self._put_regions([key], [data_region(data)], [parent], replicas)[0]
        if replicas == 1 and self._putter.sealed.put(key, data, parent):
            return True  # the straight path (kvpool.cluster.client.sealed_put)
        return self._put_regions([key], [data], [parent], replicas)[0]

    def put_batch(
        self,
        keys: Sequence[bytes],
        datas: Sequence[Buffer],
        parents: Sequence[bytes | None] | None = None,
        *,
        replicas: int = 1,
    ) -> list[bool]:
        """Store each block. Same host, blocks whose grants hold their claims go the
        single put's straight path (kvpool.cluster.client.sealed_put); the rest share
        one commit round trip, plus one allocation round trip for blocks that found no
        grant (kvpool.cluster.client.puts). ``replicas`` > 1 places copies on distinct
        nodes (best effort)."""
        filled = check_batch(keys, datas, parents)
        regions = [data_region(d) for d in datas]
        return self._putter.sealed.put_batch(keys, regions, filled, replicas, self._put_regions)

    def _put_regions(
        self,
        keys: Sequence[bytes],
        regions: Sequence[Any],
        parents: Sequence[bytes | None],
        replicas: int,
    ) -> list[bool]:
        self._session.check_open()
        stored, full, error = self._putter.put(keys, regions, parents, replicas)
        if full and self._reads.release_cached():  # our own cached leases may block it
            retry = [keys[i] for i in full], [regions[i] for i in full], [parents[i] for i in full]
            again, still, error = self._putter.put_once(*retry, replicas)
            for i, ok in zip(full, again, strict=True):
                stored[i] = ok
            full = [full[j] for j in still]
        self._session.counts["puts"] += sum(stored)
        if full:
            raise PoolFullError(error)
        return stored

    def flush(self) -> None:
        """Wait until every put this client acknowledged is visible to all clients
        (its pipelined commit answered); ``PutCommitError`` names puts that could
        not be made visible. Read-side calls and ``close`` flush first."""
        self._session.check_open()
        self._putter.commits.flush()

    def reserve(
        self, key: bytes, size: int, *, parent: bytes | None = None, device: bool = False
    ) -> RemoteBlockWriter | None:
        """Reserve a block to fill piecewise (see ``Pool.reserve``); None if already stored."""
        check_key(key)
        check_parent(parent)
        check_reserve_size(size)
        return reserve_blocks(self._session, [key], [size], [parent])[0]

    def reserve_batch(
        self,
        keys: Sequence[bytes],
        sizes: Sequence[int],
        parents: Sequence[bytes | None] | None = None,
        *,
        device: bool = False,
    ) -> list[RemoteBlockWriter | None]:
        """``reserve`` for each item in one master round trip; all or nothing
        (kvpool.cluster.client.reservations)."""
        filled = check_reserve_batch(keys, sizes, parents)
        return reserve_blocks(self._session, keys, sizes, filled)

    def adopt(self, ticket: ReservationTicket) -> RemoteBlockWriter:
        """A writer onto a reservation another process exported
        (``RemoteBlockWriter.export``; kvpool.cluster.client.reservations)."""
        return adopt(self._session, ticket)

    # -- reads --------------------------------------------------------------------

    def get(self, key: bytes) -> bytes | None:
        """A copy of the block's bytes, or None on a miss."""
        check_key(key)
        self.flush()
        with self._reads.reading([key]) as found:
            if key not in found:
                return None
            out = np.empty(found[key][1], np.uint8)
            got = self._reads.read_range(key, found[key], out, 0, None)
        return None if got is None else out.tobytes()

    def get_into(
        self, key: bytes, out: Buffer, *, offset: int = 0, length: int | None = None
    ) -> int | None:
        """Copy the block (or bytes [offset, offset+length)) into ``out``; None on a miss."""
        if type(key) is not bytes or len(key) != KEY_BYTES:  # a good key costs no call
            check_key(key)
        dst = out if plain_host(out, writable=True) else out_region(out)  # common: as it is
        if type(offset) is not int or offset or length is not None:  # defaults need no check
            check_read_range(offset, length)
        self.flush()
        return self._reads.read_into(key, dst, offset, length)

    def get_into_batch(
        self,
        keys: Sequence[bytes],
        outs: Sequence[Buffer],
        *,
        offsets: Sequence[int] | None = None,
        lengths: Sequence[int | None] | None = None,
    ) -> list[int | None]:
        """``KVStore.get_into_batch``: one lease round trip at most, one exchange per node."""
        check_batch(keys, outs, what="outs")
        ranges = check_read_ranges(len(keys), offsets, lengths)
        self.flush()
        return self._reads.read_batch(keys, outs, ranges)

    def lease(self, keys: Sequence[bytes], *, prefix: bool = True) -> RemoteLease:
        """Pin the stored prefix of ``keys`` (or every stored key) until released."""
        check_keys(keys)
        self.flush()
        return self._reads.lease(keys, prefix)

    def locate(self, keys: Sequence[bytes]) -> list[list[str]]:
        """Node ids holding each key (empty where the key is not stored)."""
        check_keys(keys)
        self.flush()
        return [list(nodes) for nodes in self._session.rpc.call(LOCATE, KeysRequest(list(keys)))]

    def replicate(self, keys: Sequence[bytes], node: str | None = None) -> int:
        """Copy stored blocks to ``node`` (or the emptiest node lacking them) as extra
        replicas; returns how many were added. The conductor uses this to move a
        prefix next to the prefill worker it routes a request to."""
        check_keys(keys)
        session = self._session
        self.flush()
        request = ReplicateRequest(list(keys), node or "")
        reply = session.rpc.call(REPLICATE, request, response_type=ReplicateReply)
        session.learn(reply.nodes)
        added: list[int] = []
        failed: list[int] = []
        with self._reads.reading(keys) as found:
            for key, alloc in zip(keys, reply.allocations, strict=True):
                if alloc is None:
                    continue
                alloc_id, node_id, offset = alloc
                hit = found.get(key)
                staging = np.empty(hit[1] if hit else 0, np.uint8)
                if hit is None or read_replicas(session, key, hit[0], staging, 0, hit[1]) is None:
                    failed.append(alloc_id)
                    continue
                stamp = WriteStamp(reply.epoch, alloc_id, offset, staging.size, key)
                try:
                    session.write_block(node_id, stamp, staging)
                    added.append(alloc_id)
                except TRANSFER_ERRORS:
                    failed.append(alloc_id)
        if failed:
            session.rpc.submit(REVOKE, IdsRequest(failed))
        return sum(session.rpc.call(COMMIT, IdsRequest(added))) if added else 0

    # -- keys -----------------------------------------------------------------------

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        """For each key, whether a committed block is stored under it."""
        check_keys(keys)
        self.flush()
        return list(self._session.rpc.call(EXISTS, KeysRequest(list(keys))))

    def prefix_match(self, keys: Sequence[bytes]) -> int:
        """Number of leading ``keys`` stored (the reusable prefix, in blocks)."""
        check_keys(keys)
        self.flush()
        return int(self._session.rpc.call(PREFIX, KeysRequest(list(keys))))

    def remove(self, key: bytes) -> bool:
        """Forget the block; False if it was not stored."""
        check_key(key)
        self.flush()
        self._putter.forget_key(key)
        self._reads.forget(key)
        return bool(self._session.rpc.call(REMOVE, KeysRequest([key]))[0])

    def stats(self) -> dict[str, Any]:
        """The cluster's counters (from the master) plus this client's own."""
        session = self._session
        self.flush()
        stats = dict(session.rpc.call(STATS))
        commits = self._putter.commits
        stats["client"] = {
            **session.counts,
            **self._putter.grants.counters(),
            "put_commits_pipelined": commits.sent,
            "put_duplicates_late": commits.duplicates,  # pipelined puts of keys stored already
            "put_commits_recovered": commits.recovered,
            "master_waits": session.rpc.failovers,  # calls that waited through a failover
            "warmed_nodes": self._warm_up.nodes,  # same-host transports made at connect
            "avoided_nodes": session.suspects.current(),  # seen failing lately
        }
        stats["transports"] = session.peers.stats()
        stats["transport"] = ",".join(sorted(stats["transports"])) or "-"
        return stats

    def close(self) -> None:
        """Flush pipelined commits, give back grants and leases, then drop every
        connection. Idempotent. Raises ``PutCommitError`` (after closing) if
        acknowledged puts could not be made visible."""
        if self._session.closed:
            return
        at_exit.untrack(self)
        self._stop.set()
        lost: PutCommitError | None = None
        try:
            self._putter.close()  # before the waited release: same connection, in order
        except PutCommitError as exc:
            lost = exc
        except KVPoolError:
            pass
        with contextlib.suppress(KVPoolError):
            self._reads.hand_back_due(everything=True)
        self._session.close()
        self._warm_up.close(self.timeout)
        if self._node is not None:
            self._node.close()
        if lost is not None:
            raise lost

    def __enter__(self) -> RemotePool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- background -------------------------------------------------------------------

    def _hand_back_loop(self) -> None:
        """Give expired cached leases back even while the client is idle, and renew
        the hot ones first: each tick re-leases, in one round trip, the blocks read
        under a lease that ends within two ticks (one tick of margin for the round
        trip), so a block read at least once per tick never lapses."""
        interval = max(0.05, self._reads.cache.hold_s / 2)
        while not self._stop.wait(interval):
            with contextlib.suppress(KVPoolError, OSError):
                self._reads.renew_hot(2 * interval)
                self._reads.hand_back_due()
                self._putter.supply.revoke_stale()
                self._putter.commits.settle()  # refused commits: visible within a tick

    def _contribute(self, master: str, dram_bytes: int) -> Any:
        from kvpool.cluster.node import NodeConfig, StorageNode

        node = StorageNode(NodeConfig(master=master, dram_bytes=dram_bytes, token=self.token))
        node.start()
        if not node.registered.wait(self.timeout):
            node.close()
            raise KVPoolError(f"could not register this process's capacity with {master}")
        return node

"""One put on its shortest path: a copy and a seal record, or one TCP write; no commit (issue 17).

A single put of a new key whose grant's claim was taken ahead, on a node
that commits the blocks sealed in shared memory (kvpool.cluster.node_commits),
needs no message at all: copy the bytes into the grant's range, write the
seal record that asks the node to commit the block, read the clock. Inside
the claim's deadline (kvpool.transport.shm_seal) the put is acknowledged,
and watched until its node answers (kvpool.cluster.client.node_watch). A
claim that grew old in the stock (within ``RENEW_SLACK_NS`` of its deadline:
an idle spell) is not used: the stock's claims past half their window are
claimed again in the background, which restarts their deadline on the node
(kvpool.cluster.sealed_claims), and the put waits for its own (``CLAIM_WAIT_S``).

``SealedPutter.put`` is that path alone, in a straight line, called by
``RemotePool.put`` before anything else; ``SealedPutter.put_batch`` sends a
same-host batch's leading blocks down it (a batch of 8 x 64 KiB went from twice
the time of 8 single puts to 1.02-1.07x; bench/RESULTS.md, session 30).

What the straight path skips was measured (issue 17, bench/RESULTS.md): the
batch bookkeeping of ``fenced.write_blocks_begin`` and
``RemotePutter._acknowledge`` cost a 1 MiB put ~16 us (session 8); the
single-key dispatch of ``RemotePool._put_regions`` and ``RemotePutter.put``,
and a grant taken and its claim looked up in two lock sections, ~1.7 us of a 64
KiB put and ~1 us of a 1 MiB one (session 20). What is left (~6 us over the
copy at 64 KiB, ~10 us at 1 MiB) is this function's own Python, slower after a
large copy has pushed the interpreter's state out of the CPU caches.

Over TCP (``_put_tcp``), when the next grant in stock is on a node that commits
the TCP writes asking it to (kvpool.cluster.node_commits): one ``WRITE_COMMIT``
of the block, acknowledged once the node holds it whole and owes its commit,
then watched until the node answers. What it skips is the same bookkeeping:
measured at 64 KiB, ~16 us of a ~145 us put (bench/RESULTS.md, session 25). The
grant's claim was usually taken ahead (kvpool.cluster.client.claims): the write
finds its range held, and the node skips a fresh claim (session 43).

Anything else answers False with nothing done: no grant in stock whose claim
was taken ahead and no TCP node that commits, own duplicates, puts not
pipelined. So does a failed copy, a range without a record or a clock past the
deadline: the grant goes back, oldest first with its claim, and the general path
(``RemotePutter.put``) takes it next -- it copies the same bytes again and seals
over TCP (a record written here is then early news). A failed or refused TCP
write releases its claim taken ahead, revokes its grant (the range may hold part
of the bytes) and answers False: the general path puts the block again on another.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import numpy as np

from kvpool.bindings.buffers import Region, plain_host
from kvpool.cluster.client import fenced
from kvpool.cluster.client.acked import Acked
from kvpool.cluster.client.commits import CommitPipe
from kvpool.cluster.client.grant_supply import GrantSupply
from kvpool.cluster.client.grants import CLAIM_WAIT_S, Grant
from kvpool.cluster.client.session import TRANSFER_ERRORS, ClientSession
from kvpool.transport import tcp_wire as w
from kvpool.transport.fencing import WriteStamp
from kvpool.transport.shm_seal import now_ns
from kvpool.transport.tcp import TcpTransport

#: A claim taken ahead this close to its seal deadline (ns) is renewed before the copy
#: (``GrantSupply.renew_claims``) instead of being used: a copy that ended past the
#: deadline would send the put the general way. Claims held in stock through an idle
#: spell of 0.5-1 s (the deadline 0.49 s, the grants' window 1 s) sent every put of
#: the next burst the general way: ~100 us each instead of ~10 (issue 17, session 37).
RENEW_SLACK_NS = 50_000_000

# ``RemotePool``'s general put of (keys, regions, parents, replicas): stored per key
PutRest = Callable[[Sequence[bytes], Sequence[Region], Sequence[bytes | None], int], list[bool]]


class SealedPutter:
    """The straight paths of one client's single puts, same host and TCP (see the
    module docstring); ``enabled`` False (puts not pipelined, or the node's commits
    turned off) sends every put the general way."""

    def __init__(
        self,
        session: ClientSession,
        supply: GrantSupply,
        commits: CommitPipe,
        mine: dict[bytes, None],
        remember: Callable[[list[bytes]], None],
        commit_late: Callable[[], None],
        *,
        enabled: bool,
    ) -> None:
        self._session, self._supply, self._commits = session, supply, commits
        self._stock = supply.stock
        self._mine, self._remember = mine, remember  # keys this client put (RemotePutter's)
        self._commit_late = commit_late
        self.enabled = enabled

    def put(
        self, key: bytes, region: np.ndarray, parent: bytes | None, *, tcp: bool = True
    ) -> bool:
        """Store ``region`` (a plain host array, ``buffers.plain_host``) under the new
        ``key``: True once acknowledged; False if nothing was done (the caller
        takes the general path). ``tcp`` False: the same-host path alone. Raises
        ``PutCommitError`` first for earlier puts known lost, as every put does."""
        session, commits = self._session, self._commits
        if not self.enabled or session.closed or key in self._mine:
            return False
        commits.check()
        size = region.nbytes
        for renewed in (False, True):
            taken = self._stock.take_claimed(size, CLAIM_WAIT_S)
            if taken is None:
                return tcp and self._put_tcp(key, region, parent, size)
            grant, claimed_at, low = taken
            try:
                writer = session.straight_writer(grant.node_id, grant.region)
            except BaseException:  # no transport reaches that node from here: give it back
                self._supply.revoke([grant.alloc_id])
                raise
            if writer is None or isinstance(writer, TcpTransport):
                if tcp and writer is not None:  # a TCP grant claimed ahead (cluster.client.claims)
                    return self._write_tcp(key, region, parent, size, grant, writer, claimed_at)
                self._stock.put_back(grant, size, claimed_at)
                return False
            data, seals = writer
            window = seals.deadline.hold_ns - seals.deadline.margin_ns
            now = now_ns()
            if renewed or now + RENEW_SLACK_NS < claimed_at + window:
                break
            # The stock's claims grew too old to seal here (an idle spell): renew the
            # ones past half their window, and wait for this one's (take_claimed).
            self._stock.put_back(grant, size, claimed_at)
            self._supply.renew_claims(now - window // 2)
        try:  # the copy, then the seal record (one native call: kvpool.transport.shm_copy)
            sealed = data.write_sealed(
                region, grant.offset, seals, grant.epoch, grant.alloc_id, key, parent
            )
        except TRANSFER_ERRORS:
            sealed = False
        # the clock is read after the record: in time, the node's abort comes later
        if not sealed or not seals.deadline.writer_in_time(claimed_at, now_ns()):
            self._stock.put_back(grant, size, claimed_at)
            return False
        acked = Acked(key, parent, grant.alloc_id, grant.node_id, grant.offset, size, True)
        commits.watch(acked, seals)
        self._remember([key])
        counts = session.counts
        counts["seals_shm"] += 1
        counts["puts"] += 1
        if low:
            self._supply.top_up(size)
        if time.monotonic() > grant.expires:  # as ``RemotePutter._acknowledge``
            self._commit_late()
        return True

    def put_batch(
        self,
        keys: Sequence[bytes],
        regions: Sequence[Region],
        parents: Sequence[bytes | None],
        replicas: int,
        put_rest: PutRest,
    ) -> list[bool]:
        """``RemotePool.put_batch``: the leading blocks go ``put``'s same-host path one
        by one while it takes them (a grant whose claim was taken ahead in stock; no
        master frame, the node commits them); from the first it declines, the rest go
        to ``put_rest`` together (the general path: one commit round trip; over TCP
        its writes pipeline, where the straight path would wait a round trip per
        block). A batch that found no grant costs one declined look-up. Raises what
        ``put_rest`` raises; the blocks acknowledged before it stay stored."""
        stored: list[bool] = []
        if replicas == 1:
            for key, region, parent in zip(keys, regions, parents, strict=True):
                if not (plain_host(region) and self.put(key, region, parent, tcp=False)):
                    break
                stored.append(True)
        if not stored:
            return put_rest(keys, regions, parents, replicas)
        n = len(stored)
        if n < len(keys):
            stored += put_rest(keys[n:], regions[n:], parents[n:], replicas)
        return stored

    def _put_tcp(self, key: bytes, region: np.ndarray, parent: bytes | None, size: int) -> bool:
        """The TCP straight path: the next grant of ``size`` bytes is on a node that
        commits the TCP writes asking it to; one ``WRITE_COMMIT``, nothing to the
        master. False with nothing taken if not; False with the grant given back if
        the write failed or was refused (the general path puts the block again)."""
        grant = self._stock.oldest(size)
        if grant is None:
            return False
        data = self._session.straight_writer(grant.node_id, grant.region)
        if not isinstance(data, TcpTransport):
            return False
        claimed_at = self._stock.take_this(size, grant)
        if claimed_at is None:
            return False
        return self._write_tcp(key, region, parent, size, grant, data, claimed_at)

    def _write_tcp(
        self,
        key: bytes,
        region: np.ndarray,
        parent: bytes | None,
        size: int,
        grant: Grant,
        data: TcpTransport,
        claimed_at: int,
    ) -> bool:
        """``_put_tcp``'s write of the taken ``grant`` (``claimed_at``: its claim taken
        ahead, 0: none), and its acknowledgement. A failed or refused write releases
        that claim (another connection holds it) and revokes the grant: False.

        The stock's refill, if due, is asked for while the node lands the bytes. What
        that request raises is this client's, not the node's: it is held until the
        write's answer was read and handled, then raised, so it neither breaks the
        exchange nor makes the node a suspect (the block stays acknowledged)."""
        session, supply = self._session, self._supply
        stamp = WriteStamp(grant.epoch, grant.alloc_id, grant.offset, size, key, parent)
        refill_error: list[BaseException] = []

        def refill() -> None:
            try:
                supply.top_up(size)
            except BaseException as exc:
                refill_error.append(exc)

        try:
            status = data.stamped_one(w.OP_WRITE_COMMIT, stamp.pack(), grant.offset, region, refill)
        except TRANSFER_ERRORS:
            status = None
            supply.node_failed(grant.node_id)
        if status != w.ST_OK:  # as ``RemotePutter._put_one``: no use any more
            if claimed_at:
                fenced.release_quietly(data, [stamp])
            supply.revoke([grant.alloc_id])
            if refill_error:
                raise refill_error[0]
            return False
        acked = Acked(key, parent, grant.alloc_id, grant.node_id, grant.offset, size, True)
        self._commits.watch(acked, data)
        self._remember([key])
        session.counts["puts"] += 1
        if time.monotonic() > grant.expires:  # as ``RemotePutter._acknowledge``
            self._commit_late()
        if refill_error:
            raise refill_error[0]
        return True

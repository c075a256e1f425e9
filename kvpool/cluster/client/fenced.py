"""Stamped (fenced) writes from the client side: every block write names its allocation.

Over TCP the stamp rides in the write itself (``OP_WRITE_FINAL`` for a whole
block, ``OP_WRITE_PART`` for a piece of a reserved block): one round trip,
and when it is acknowledged the node knows the block is whole.

Shared memory and UCX move the bytes without the node's data server seeing
them, so the node is asked around the copy, on its TCP data port: ``CLAIM``
(the node checks the stamp and holds the range for this write) -> copy ->
``SEAL`` (the node records the block as whole) or ``RELEASE``. A claim is
held by its connection: a writer that dies never blocks the range.

Statuses are tcp_wire's ``ST_OK``, ``ST_STALE`` (a newer allocation or master
term owns the range: never retry the same allocation) and ``ST_BUSY`` (an
older write is still in flight there).
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Callable, Mapping, Sequence

from kvpool.bindings.buffers import Region, region_nbytes
from kvpool.transport import tcp_wire as w
from kvpool.transport.base import Transport
from kvpool.transport.fencing import WriteStamp
from kvpool.transport.shm_seal import SealRecords, now_ns
from kvpool.transport.tcp import TcpTransport

OK = w.ST_OK


def write_blocks_begin(
    data: Transport,
    control: TcpTransport,
    items: Sequence[tuple[WriteStamp, int, Region]],
    claimed: Mapping[int, int] | frozenset[int] | set[int] = frozenset(),
    seals: SealRecords | None = None,
    counts: Counter[str] | None = None,
    clock: Callable[[], int] = now_ns,
    node_commits: set[int] | None = None,
) -> tuple[list[int], Callable[[], list[int]] | None]:
    """Write each (stamp, offset, bytes) as a whole block. ``data`` moves the
    bytes, ``control`` is a TCP transport to the same node (the same object
    when the data path is TCP); ``claimed`` items hold their claim already
    (taken ahead for a grant: over TCP the write claims its range itself, and
    finds it held; one that fails or is refused has that claim released). The
    last round trip (the seals of an out-of-band copy) is left in flight:
    (statuses so far, None or a call that waits for the seals and returns the
    final statuses). The bytes are all in place when this returns, so the
    caller may overlap the master's commit with the seals.

    With ``seals`` (the node's records beside its arena) and ``claimed``
    mapping an item to the clock read before its claim was sent, the item is
    sealed in shared memory and done without a round trip if the clock, read
    after its record was written, is still inside the claim's deadline
    (kvpool.transport.shm_seal); otherwise its seal goes over TCP as before.
    With ``node_commits`` (a set) and a node that commits sealed blocks, each
    record asks the node to send the block's master commit (over TCP: each write,
    ``WRITE_COMMIT``, where the node takes those), and the indices so asked are
    added to the set: once sealed (either way), the caller must not commit them
    itself (kvpool.cluster.node_commits).
    """
    if isinstance(data, TcpTransport):
        op = w.OP_WRITE_FINAL
        if node_commits is not None and data.info.tcp_node_commits:
            op = w.OP_WRITE_COMMIT  # the node commits each block once it is whole
            node_commits.update(range(len(items)))
        ahead = [i for i in claimed if not isinstance(claimed, Mapping) or claimed[i]]
        try:
            statuses = data.stamped([(op, s.pack(), off, d) for s, off, d in items])
        except BaseException:  # claims taken ahead are held by another pooled connection
            release_quietly(control, [items[i][0] for i in ahead])
            raise
        release_quietly(control, [items[i][0] for i in ahead if statuses[i] != OK])
        return statuses, None
    need = [i for i in range(len(items)) if i not in claimed]
    claims = [OK] * len(items)
    try:
        statuses = ops(control, w.OP_CLAIM, [items[i][0] for i in need])
    except BaseException:
        # The claims taken ahead are held by another (pooled) connection: without
        # this release they would outlive the put, whose allocations the caller
        # revokes, and keep every later claim of those ranges BUSY (seen under load:
        # one timed-out CLAIM pipeline leaked its batch's claims, which made more
        # claims time out).
        release_quietly(control, [s for s, _, _ in items])
        raise
    for i, status in zip(need, statuses, strict=True):
        claims[i] = status
    held = [i for i, st in enumerate(claims) if st == OK]
    if not held:
        return claims, None
    try:
        data.write_many([(items[i][1], items[i][2]) for i in held])
    except BaseException:
        ops(control, w.OP_RELEASE, [items[i][0] for i in held])
        raise
    if seals is not None and isinstance(claimed, Mapping):
        ask = node_commits is not None and seals.node_commits
        written = [i for i in held if claimed.get(i, 0) > 1 and seals.write(items[i][0], ask)]
        if ask and node_commits is not None:
            node_commits.update(written)
        if written:
            now, deadline = clock(), seals.deadline  # read after the records were written
            done = {i for i in written if deadline.writer_in_time(claimed[i], now)}
            held = [i for i in held if i not in done]
            if counts is not None and done:
                counts["seals_shm"] += len(done)
            if counts is not None and len(done) < len(written):
                counts["seals_shm_late"] += len(written) - len(done)
            if not held:
                return claims, None
    try:
        sealing = control.stamped_later([(w.OP_SEAL, items[i][0].pack(), 0, None) for i in held])
    except BaseException:
        release_quietly(control, [items[i][0] for i in held])
        raise

    def sealed() -> list[int]:
        final = list(claims)
        for i, status in zip(held, sealing(), strict=True):
            final[i] = status
        return final

    return claims, sealed


def write_parts(
    data: Transport, control: TcpTransport, items: Sequence[tuple[WriteStamp, int, Region]]
) -> list[int]:
    """Pieces of reserved blocks on one node, (stamp, offset absolute in the node's
    region, bytes): each piece's status. Over TCP every piece carries its stamp, all
    in one pipelined exchange, and a run of adjacent pieces of one block (a layer's
    K then V) goes as one write (``adjacent_runs``). Another transport's copies are
    bracketed by a claim and a release of each distinct stamp, pipelined (two round
    trips for the lot), held only while these bytes move, so a writer that idles
    between calls never keeps a newer allocation off the range; pieces of a refused
    stamp are not copied."""
    if isinstance(data, TcpTransport):
        runs = adjacent_runs(items)
        statuses = data.stamped([(w.OP_WRITE_PART, s.pack(), off, srcs) for s, off, srcs in runs])
        return [status for (_, _, srcs), status in zip(runs, statuses, strict=True) for _ in srcs]
    stamps = list(dict.fromkeys(stamp for stamp, _, _ in items))
    try:
        claims = dict(zip(stamps, ops(control, w.OP_CLAIM, stamps), strict=True))
    except BaseException:
        release_quietly(control, stamps)  # which claims the node took is unknown
        raise
    try:
        for stamp, offset, src in items:
            if claims[stamp] == OK:
                data.write(offset, src)
    finally:
        ops(control, w.OP_RELEASE, [s for s in stamps if claims[s] == OK])
    return [claims[stamp] for stamp, _, _ in items]


def adjacent_runs(
    items: Sequence[tuple[WriteStamp, int, Region]],
) -> list[tuple[WriteStamp, int, list[Region]]]:
    """``items`` as runs (stamp, offset, pieces): consecutive pieces of one stamp,
    each starting where the one before it ended, in one run; order kept.

    Why: a stamped write costs the node mostly per request (the header's receive,
    the fence's claim and seal, the answer): a layer-wise store of 128 KiB K and V
    pieces over loopback moved 3.1 GB/s one request a piece, 3.7-3.8 one a block's
    K and V (issue 17, session 47). A run's one status is each of its pieces' (the
    fence decides by stamp)."""
    runs: list[tuple[WriteStamp, int, list[Region]]] = []
    end = -1
    for stamp, offset, src in items:
        if offset == end and runs[-1][0] == stamp:
            runs[-1][2].append(src)
        else:
            runs.append((stamp, offset, [src]))
        end = offset + region_nbytes(src)
    return runs


def ops(control: TcpTransport, op: int, stamps: Sequence[WriteStamp]) -> list[int]:
    """``OP_CLAIM`` / ``OP_SEAL`` / ``OP_RELEASE`` for each stamp, pipelined."""
    return control.stamped([(op, s.pack(), 0, None) for s in stamps]) if stamps else []


def release_quietly(control: TcpTransport, stamps: Sequence[WriteStamp]) -> None:
    """Best-effort ``OP_RELEASE`` of claims a failed write may hold (a claim held
    by a connection that broke is released by the node anyway)."""
    with contextlib.suppress(Exception):
        ops(control, w.OP_RELEASE, stamps)

"""``kvpool bench remote``: the distributed pool end to end, against raw baselines.

Starts a real cluster as separate processes -- ``kvpool master`` and one
``kvpool node`` whose DRAM arena holds the working set and every client's full
stock of put grants (the master's ``--grant-share`` is set to fit them) -- plus the raw-socket
baseline server of ``kvpool.bench.remote_transport`` (request = op, offset,
length; reply = the bytes by ``sendall``; puts = ``recv_into`` + 1-byte ack).
This process is the client: ``kvpool.connect(url, transport=T)`` for each
transport T, measuring per size

- put / get_into: one block per call (put = allocate round trip to the
  master, bytes to the node, commit round trip; get_into = lease round trip,
  bytes, release without waiting);
- get_into_leased: get_into of keys covered by one lease held over the whole
  working set (what a layer-wise reader does), so no master round trip per
  call: the data path through the client alone;
- put_batch / get_into_batch of ``--batch`` blocks per call (one master round
  trip per phase for the whole batch), reported per block.

Baselines, measured in the same run and interleaved op by op with ours (so a
burst from another tenant of this shared machine hits both): ``np.copyto``
between pre-faulted buffers for shm; for tcp and ucx, the raw Python socket on
loopback doing the same request/response ops (puts, gets), ``--batch`` of
them back to back (put_batch), or one request streaming ``--batch`` blocks
(get_into_batch: the socket's bandwidth ceiling). GB/s come from median
latencies. The client runs on one half of the CPUs and master, node and
baseline server on the other (when there are two or more CPUs), as in
``remote_transport``. Keys rotate over ``--working-set`` bytes per size (at
least two batches, at most 2048 blocks), every buffer is pre-faulted, and puts
are timed into freshly freed ranges (the keys are removed, untimed, before
every round).

``--peer mooncake`` adds rows for Mooncake Store (``kvpool.bench.mooncake_peer``:
its master plus a second process over TCP; this process reads and writes
through its TCP transfer engine) when ``mooncake-transfer-engine-non-cuda`` is
importable, with the same sizes, ops and raw-socket baseline, each size's rows
right after ours of that size; otherwise it prints why it skipped.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, closing, contextmanager
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from kvpool.api import KVStore
from kvpool.args import positive_int, size_arg, sizes_arg
from kvpool.bench.common import PAGE, count_for, faulted, page_rounded, paired, write_json
from kvpool.bench.machine import CpuTimes, steal_since
from kvpool.bench.mooncake_peer import mooncake_peer
from kvpool.bench.remote_procs import connect_client, local_cluster, raw_server
from kvpool.bench.remote_rows import Baselines, RemoteRow, print_rows, remote_row
from kvpool.bench.remote_transport import RawClient, pinned, split_cpus
from kvpool.bench.veth import LOOPBACK, Link, Where, add_link_args, link_of, tcp_only, veth_peer
from kvpool.cluster.client.grants import DEFAULT_GRANT_BYTES

WORKING_SET = 64 << 20
TRANSPORTS = ("shm", "tcp", "ucx")


def _count(size: int, batch: int, working_set: int = WORKING_SET) -> int:
    """Blocks to rotate through: the working set, at least two batches, whole batches."""
    count = max(2 * batch, count_for(size, working_set))
    return count - count % batch


# --- kvpool rows ------------------------------------------------------------------


@dataclass
class _Buffers:
    """Pre-faulted client buffers for one size, shared by every transport."""

    size: int
    count: int
    srcs: list[np.ndarray]
    outs: list[np.ndarray]
    peer: list[np.ndarray]  # the numpy-copy baseline's "remote" side

    @classmethod
    def make(cls, size: int, count: int) -> _Buffers:
        return cls(
            size,
            count,
            [faulted(size) for _ in range(count)],
            [faulted(size, fill=0) for _ in range(count)],
            [faulted(size, fill=1) for _ in range(count)],
        )


OPS = ("put", "get_into", "get_into_leased", "put_batch", "get_into_batch")


def ops_arg(text: str) -> tuple[str, ...]:
    """``--ops``: a comma list of OPS."""
    ops = tuple(o.strip() for o in text.split(",") if o.strip())
    unknown = sorted(set(ops) - set(OPS))
    if unknown or not ops:
        raise argparse.ArgumentTypeError(f"unknown op(s) {unknown}; choose from {', '.join(OPS)}")
    return ops


def _kvpool_rows(
    pool: KVStore,
    transport: str,
    bufs: _Buffers,
    raw: RawClient | None,
    batch: int,
    rounds: int,
    ops: Sequence[str] = OPS,
    path: str | None = None,
) -> list[RemoteRow]:
    """The rows of one transport and size, named ``path`` (the transport's name if
    None; a veth link's when the bytes crossed one)."""
    from kvpool.index.keys import Namespace, block_keys

    size, count, srcs, outs, peer = bufs.size, bufs.count, bufs.srcs, bufs.outs, bufs.peer
    keys = block_keys(np.arange(count, dtype=np.int32), Namespace(f"bench-{size}"), block_tokens=1)
    groups = [list(range(g, g + batch)) for g in range(0, count, batch)]

    def remove_all() -> None:
        for key in keys:
            pool.remove(key)

    def put(i: int) -> None:
        if not pool.put(keys[i], srcs[i]):
            raise RuntimeError("put found the key already stored")

    def get(i: int) -> None:
        if pool.get_into(keys[i], outs[i]) != size:
            raise RuntimeError("get_into missed a stored key")

    def put_batch(g: int) -> None:
        idx = groups[g]
        if not all(pool.put_batch([keys[i] for i in idx], [srcs[i] for i in idx])):
            raise RuntimeError("put_batch found a key already stored")

    def get_batch(g: int) -> None:
        idx = groups[g]
        got = pool.get_into_batch([keys[i] for i in idx], [outs[i] for i in idx])
        if got != [size] * len(idx):
            raise RuntimeError("get_into_batch missed a stored key")

    if transport == "shm":
        base_ops = Baselines.numpy_copy(srcs, outs, peer, groups)
    else:
        assert raw is not None
        base_ops = Baselines.raw_socket(raw, size, srcs, outs, groups)
    what = base_ops.name
    label = path or transport

    rows = []
    remove_all()
    if "put" in ops:
        base, ours = paired(size, base_ops.put, put, count, rounds, remove_all)
        rows.append(remote_row("put", label, size, ours, base, what))
    else:  # the reads need the keys stored
        for i in range(count):
            put(i)
    if "get_into" in ops:
        base, ours = paired(size, base_ops.get, get, count, rounds)
        rows.append(remote_row("get_into", label, size, ours, base, what))
    # The same reads inside one lease held over the whole working set (as a
    # layer-wise reader holds its prefix): no master round trip per call, so
    # this row is the client's data path alone.
    if "get_into_leased" in ops:
        with pool.lease(keys, prefix=False) as lease:
            if len(lease.keys) != count:
                raise RuntimeError("a stored key could not be leased")
            base, ours = paired(size, base_ops.get, get, count, rounds)
        rows.append(remote_row("get_into_leased", label, size, ours, base, what))
    n = len(groups)
    if "put_batch" in ops:
        base, ours = paired(size * batch, base_ops.put_batch, put_batch, n, rounds, remove_all)
        rows.append(
            remote_row("put_batch", label, size, ours, base, base_ops.put_batch_name, batch)
        )
    if "get_into_batch" in ops:
        base, ours = paired(size * batch, base_ops.get_batch, get_batch, n, rounds)
        rows.append(
            remote_row("get_into_batch", label, size, ours, base, base_ops.get_batch_name, batch)
        )
    remove_all()
    used = pool.stats()["transport"]
    if used != transport:
        raise RuntimeError(f"asked for transport {transport} but the client used {used}")
    for row in rows:
        row.size = size
    return rows


def _usable(transports: Sequence[str], url: str) -> list[str]:
    """The transports that can run here; prints why the others are skipped."""
    keep = []
    for name in transports:
        if name == "ucx":
            from kvpool.transport.ucx import ucx_available

            if not ucx_available():
                print("ucx: skipped (ucxx is not importable: pip install 'kvpool[ucx]')")
                continue
            with _connect_quiet(url, "ucx") as why:
                if why:
                    print(f"ucx: skipped ({why})")
                    continue
        keep.append(name)
    return keep


@contextmanager
def _connect_quiet(url: str, transport: str) -> Iterator[str]:
    """Yields '' when a tiny put/get over ``transport`` works, else the reason."""
    from kvpool.errors import KVPoolError
    from kvpool.index.keys import Namespace, block_keys

    key = block_keys(np.arange(1, dtype=np.int32), Namespace("bench-probe"), block_tokens=1)[0]
    try:
        pool = connect_client(url, transport)
    except (KVPoolError, OSError, RuntimeError) as exc:
        yield str(exc)
        return
    try:
        try:
            pool.put(key, np.zeros(PAGE, np.uint8))
            pool.get_into(key, np.empty(PAGE, np.uint8))
            pool.remove(key)
            why = ""
        except (KVPoolError, OSError) as exc:
            why = f"{type(exc).__name__}: {exc}"
        yield why
    finally:
        pool.close()


def run_remote(
    sizes: Sequence[int],
    transports: Sequence[str] = ("shm", "tcp"),
    batch: int = 8,
    rounds: int = 5,
    pin: bool = True,
    peer: str | None = None,
    working_set: int = WORKING_SET,
    ops: Sequence[str] = OPS,
    link: Link | None = None,
) -> list[RemoteRow]:
    """Start the cluster and the baseline server, measure every (size, transport).

    With a ``link`` master, node and baseline server run in a network namespace
    behind a veth pair like it (kvpool.bench.veth; root only): another host, so
    only TCP is measured, its rows named after the link (``veth1500``)."""
    unknown = set(transports) - set(TRANSPORTS)
    if unknown:
        raise ValueError(f"unknown transport(s) {sorted(unknown)}; choose from shm, tcp, ucx")
    if batch < 1 or rounds < 1:
        raise ValueError("--batch and --rounds must be at least 1")
    if peer not in (None, "mooncake"):
        raise ValueError(f"unknown peer {peer!r} (supported: mooncake)")
    if link is not None:
        if peer is not None:
            raise ValueError("--peer runs on loopback only: leave out --veth or --peer")
        transports = tcp_only(transports)
    counts = {s: _count(s, batch, working_set) for s in sizes}
    region = max(counts[s] * page_rounded(s) for s in sizes)
    # Headroom, plus room for the put grants of every client (one per transport):
    # each stocks up to DEFAULT_GRANT_BYTES per block size, and right after a size
    # change still holds the previous size's for up to grants.MAX_USE_S. With the
    # master's default share (1/16 of a 1 GiB node) two clients took turns for 64
    # MiB of grants: at 4 MiB a same-host client refilled 79 times in 96 puts and
    # sealed 66 of them over TCP in one run (issue 17, session 7), so the rows
    # measured a small bench cluster's grant budget, not the put path.
    room = 2 * len(transports) * DEFAULT_GRANT_BYTES
    dram = region + region // 4 + (16 << 20) + room
    split = split_cpus() if pin else None
    client_cpus, server_cpus = split if split else (None, None)
    rows: list[RemoteRow] = []
    with ExitStack() as running:
        where = LOOPBACK
        if link is not None:
            where = Where.beyond(running.enter_context(veth_peer(link, rx_cpus=split)))
        url = running.enter_context(local_cluster(dram, server_cpus, room / dram, where))
        raw_port = running.enter_context(raw_server(region, server_cpus, where))
        usable = _usable(transports, url)
        pools = {t: running.enter_context(closing(connect_client(url, t, where))) for t in usable}
        mooncake = running.enter_context(mooncake_peer(region, server_cpus)) if peer else None
        raw = RawClient(where.host, raw_port)
        running.callback(raw.sock.close)
        running.enter_context(pinned(client_cpus))
        for size in sizes:
            bufs = _Buffers.make(size, counts[size])
            for t in usable:
                path = t if link is None else link.name
                rows += _kvpool_rows(pools[t], t, bufs, raw, batch, rounds, ops, path)
            del bufs
            if mooncake is not None:  # right after ours of this size (bench/mooncake_peer.py)
                rows += mooncake.rows(size, counts[size], raw, batch, rounds)
    return rows


# --- CLI -------------------------------------------------------------------------------


def register_remote(suites: Any) -> None:
    parser = suites.add_parser(
        "remote", help="distributed pool (master + node processes) per transport vs raw baselines"
    )
    parser.add_argument("--sizes", type=sizes_arg, default="64KiB,1MiB,4MiB,16MiB")
    parser.add_argument("--transport", default="shm,tcp,ucx", help="comma list of shm, tcp, ucx")
    parser.add_argument("--batch", type=positive_int, default=8, help="blocks per batch call")
    parser.add_argument("--rounds", type=positive_int, default=5)
    parser.add_argument("--json", default=None, metavar="F")
    parser.add_argument("--peer", default=None, choices=["mooncake"], help="also measure a peer")
    parser.add_argument(
        "--working-set",
        type=size_arg,
        default="64MiB",
        help="bytes of distinct blocks per size (8-2048 blocks)",
    )
    parser.add_argument("--no-pin", action="store_true", help="do not split CPUs between sides")
    parser.add_argument(
        "--ops", type=ops_arg, default=OPS, help=f"comma list of {', '.join(OPS)} (default all)"
    )
    add_link_args(parser)
    parser.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    transports = [t.strip().lower() for t in args.transport.split(",") if t.strip()]
    before = CpuTimes.now()
    rows = run_remote(
        args.sizes,
        transports,
        args.batch,
        args.rounds,
        not args.no_pin,
        args.peer,
        args.working_set,
        args.ops,
        link_of(args),
    )
    print_rows(rows)
    steal = steal_since(before)
    if steal is not None:  # what a contended VM did to the run (kvpool.bench.machine)
        print(f"CPU steal during the run: {steal}% of CPU time")
    write_json(args.json, [asdict(r) for r in rows])
    return 0

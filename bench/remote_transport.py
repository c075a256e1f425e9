"""Data-path microbenchmark: transports against raw sockets and memcpy, same run.

A node process (``python -m kvpool.bench.remote_transport --node BYTES``)
creates a pre-faulted shared-memory arena and serves it twice: through the
TCP data server, and through a minimal raw-socket server (request = op,
offset, length; reply = the bytes by ``sendall``; puts = ``recv_into`` then a
1-byte ack) -- the least a Python program can do per operation. Its sockets
are opened as kvpool's data path opens its own (kvpool.transport.tcp_congestion:
the same congestion control), so the two differ in what they do, not in how
the kernel paces them. The client (this process) measures, per size:

- tcp get_into / put vs the raw socket doing the same request/response ops;
- tcp get_batch (``read_many`` of 8 ranges) vs a raw back-to-back stream
  (the socket's bandwidth ceiling);
- shm get_into / put vs ``np.copyto`` between buffers of the same kind;
- ucx get_into / put (when ucxx is installed; worker-address endpoints, so
  UCX may use shared memory) vs the raw socket.

Baseline and ours alternate op by op and GB/s comes from median latencies,
so bursts from other processes on this shared machine hit both sides. Every
buffer is pre-faulted before timing. Not wired into the CLI yet:
call ``run_remote_transport`` or run the module.

Loopback is not a network (a 64 KiB MTU; the sender's CPU runs the receive
path). ``--veth`` (root) puts the node in a network namespace of its own
behind a veth pair (kvpool.bench.veth): ``--veth-mtu``, ``--veth-no-gso``
(every packet one MTU, as without segmentation offloads) and ``--veth-rate`` (a
token bucket, ``10gbit``) shape the link, each end's receives run on its
own side's CPUs, and the TCP rows -- ours and the raw socket's -- cross it.
"""

from __future__ import annotations

import argparse
import os
import socket
import struct
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import numpy as np

from kvpool.args import positive_int, sizes_arg
from kvpool.bench.common import (
    Row,
    count_for,
    faulted,
    make_row,
    paired,
    print_table,
    write_json,
)
from kvpool.bench.veth import (
    LOOPBACK,
    Link,
    VethUnavailable,
    Where,
    add_link_args,
    link_of,
    tcp_only,
    veth_peer,
)
from kvpool.procs import stop_by_stdin
from kvpool.transport import tcp_congestion
from kvpool.transport import tcp_wire as w
from kvpool.transport.base import RegionInfo, UcxInfo
from kvpool.transport.shm import ShmTransport
from kvpool.transport.tcp import TcpTransport

# op, offset, length, repeat; 64 bytes, so a put's payload sits at a 64-byte-aligned
# stream offset (sizes here are multiples of 64), as kvpool's own WRITEs do: the
# baseline is the best a raw socket does (a 32-byte header cost ~15% at 1 MiB).
RAW_REQ = struct.Struct("!BxxxxxxxQQQ32x")
RAW_GET, RAW_PUT, RAW_STREAM = 1, 2, 3
WORKING_SET = 64 << 20
BATCH = 8


# --- node process ---------------------------------------------------------------


def _raw_serve(sock: socket.socket, region: memoryview) -> None:
    head = bytearray(RAW_REQ.size)
    try:
        while True:
            w.recv_into_exact(sock, memoryview(head))
            op, offset, length, repeat = RAW_REQ.unpack(head)
            span = region[offset : offset + length]
            if op == RAW_PUT:
                w.recv_into_exact(sock, span)
                sock.sendall(b"\x01")
            elif op == RAW_STREAM:  # ``repeat`` distinct consecutive ranges, one send each
                for k in range(repeat):
                    sock.sendall(region[offset + k * length : offset + (k + 1) * length])
            else:
                sock.sendall(span)
    except Exception:
        sock.close()


def _node(size: int, with_ucx: bool, host: str) -> None:
    from kvpool.storage.arena import SharedArena
    from kvpool.transport.base import host_identity
    from kvpool.transport.tcp_server import TcpDataServer

    arena = SharedArena(size)
    arena.view[:] = np.resize(np.arange(251, dtype=np.uint8), size)
    tcp = TcpDataServer(arena.view, host=host, port=0)
    raw = tcp_congestion.listen(host, 0)  # as kvpool's data server: same algorithm
    region = memoryview(arena.view)  # type: ignore[arg-type]

    def accept() -> None:
        while True:
            sock, _ = raw.accept()
            w.tune(sock)
            threading.Thread(target=_raw_serve, args=(sock, region), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    ucx_port, ucx_addr, ucx = 0, "-", None
    if with_ucx:
        from kvpool.transport.ucx_server import UcxDataServer

        ucx = UcxDataServer(arena.view, host=host)
        ucx_port, ucx_addr = ucx.port, ucx.worker_address.hex()
    tcp_port, raw_port = tcp.start()[1], raw.getsockname()[1]
    print(tcp_port, raw_port, arena.name, host_identity(), ucx_port, ucx_addr, flush=True)
    sys.stdin.read()
    if ucx is not None:
        ucx.close()
    tcp.close()
    arena.close()


# --- client ------------------------------------------------------------------------


class RawClient:
    def __init__(self, host: str, port: int) -> None:
        self.sock = tcp_congestion.connect((host, port), None)
        w.tune(self.sock)
        self.ack = bytearray(1)

    def get(self, offset: int, out: np.ndarray) -> None:
        self.sock.sendall(RAW_REQ.pack(RAW_GET, offset, out.nbytes, 1))
        w.recv_into_exact(self.sock, memoryview(out))  # type: ignore[arg-type]

    def put(self, offset: int, data: np.ndarray) -> None:
        w.send_parts(self.sock, RAW_REQ.pack(RAW_PUT, offset, data.nbytes, 1), memoryview(data))  # type: ignore[arg-type]
        w.recv_into_exact(self.sock, memoryview(self.ack))

    def stream(self, offset: int, outs: Sequence[np.ndarray]) -> None:
        """``len(outs)`` consecutive ranges from ``offset`` (each ``outs[0].nbytes``
        long) streamed back to back: the socket's ceiling for a batch of reads.
        Distinct ranges, as a batch of kvpool reads moves: streaming one range
        again and again (before session 6) sent cache-hot bytes and cost the
        node ~1 ms less CPU per 8 x 1 MiB than the same bytes from DRAM."""
        self.sock.sendall(RAW_REQ.pack(RAW_STREAM, offset, outs[0].nbytes, len(outs)))
        for out in outs:
            w.recv_into_exact(self.sock, memoryview(out))  # type: ignore[arg-type]


def _sizes_rows(
    size: int,
    info: RegionInfo,
    raw: RawClient,
    transports: Sequence[str],
    rounds: int,
    tcp_path: str = "tcp",
    token: str | None = None,
) -> list[Row]:
    """The rows of one size; TCP's are labelled ``tcp_path`` (the link they crossed)."""
    count = count_for(size, WORKING_SET)
    outs = [faulted(size, fill=0) for _ in range(count)]
    srcs = [faulted(size) for _ in range(count)]
    offs = [i * size for i in range(count)]
    rows: list[Row] = []

    def row(op: str, kind: str, base: Callable[[int], object], ours: Callable[[int], object],
            what: str, n: int = count, nbytes: int = size) -> None:  # fmt: skip
        b, o = paired(nbytes, base, ours, n, rounds)
        r = make_row(op, kind, o, b, what)
        r.size = size
        rows.append(r)

    if "tcp" in transports:
        tcp = TcpTransport(info, token=token, timeout=30)
        row("get_into", tcp_path, lambda i: raw.get(offs[i], outs[i]),
            lambda i: tcp.read_into(offs[i], outs[i]), "raw socket req/resp")  # fmt: skip
        row("put", tcp_path, lambda i: raw.put(offs[i], srcs[i]),
            lambda i: tcp.write(offs[i], srcs[i]), "raw socket req/resp")  # fmt: skip
        groups = [list(range(g, min(count, g + BATCH))) for g in range(0, count, BATCH)]
        row("get_batch", tcp_path,
            lambda g: raw.stream(offs[groups[g][0]], [outs[i] for i in groups[g]]),
            lambda g: tcp.read_many([(offs[i], outs[i]) for i in groups[g]]),
            f"raw socket stream (x{BATCH})", len(groups), size * len(groups[0]))  # fmt: skip
        tcp.close()
    if "ucx" in transports and info.ucx is not None:
        from kvpool.transport.ucx import UcxTransport

        # Worker-address endpoints (same host): UCX picks its shared-memory transports.
        ucx = UcxTransport(info, timeout=30)
        row("get_into", "ucx", lambda i: raw.get(offs[i], outs[i]),
            lambda i: ucx.read_into(offs[i], outs[i]), "raw socket req/resp")  # fmt: skip
        row("put", "ucx", lambda i: raw.put(offs[i], srcs[i]),
            lambda i: ucx.write(offs[i], srcs[i]), "raw socket req/resp")  # fmt: skip
        ucx.close()
    if "shm" in transports:
        shm = ShmTransport(info)
        peer = [faulted(size) for _ in range(count)]
        row("get_into", "shm", lambda i: np.copyto(outs[i], peer[i]),
            lambda i: shm.read_into(offs[i], outs[i]), "numpy copy")  # fmt: skip
        row("put", "shm", lambda i: np.copyto(peer[i], srcs[i]),
            lambda i: shm.write(offs[i], srcs[i]), "numpy copy")  # fmt: skip
        shm.close()
    return rows


def split_cpus() -> tuple[set[int], set[int]] | None:
    """(client CPUs, node CPUs): disjoint halves, or None with fewer than 2 CPUs."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return None
    half = len(cpus) // 2
    return set(cpus[:half]), set(cpus[half:])


@contextmanager
def pinned(cpus: set[int] | None) -> Iterator[None]:
    """This process on ``cpus`` for the block (None or empty: left where it is), its
    CPU set restored afterwards: the client side of ``split_cpus``."""
    saved = os.sched_getaffinity(0)
    if cpus:
        os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, saved)


def run_remote_transport(
    sizes: Sequence[int],
    transports: Sequence[str] = ("tcp", "shm"),
    rounds: int = 5,
    json_path: str | None = None,
    pin: bool = True,
    link: Link | None = None,
) -> list[Row]:
    """Start a node process, measure every (size, transport), return the rows.

    With ``pin`` (and >= 2 CPUs) client and node run on disjoint CPU sets:
    otherwise the scheduler's placement of each server thread (same CPU as
    the client or not) swings small-op results 2x from run to run.

    With a ``link`` the node runs in a network namespace of its own, joined to
    this one by a veth pair like it (its MTU, segmentation, rate; bench/veth.py;
    root only), and TCP -- kvpool's and the raw baseline's alike -- crosses that
    link instead of loopback. The node is then another host: shm and UCX rows are
    left out.
    """
    split = split_cpus() if pin else None
    if link is None:
        return _measure(sizes, transports, rounds, json_path, split)
    with veth_peer(link, rx_cpus=split) as peer:
        where = Where.beyond(peer)
        return _measure(sizes, tcp_only(transports), rounds, json_path, split, where, link.name)


@contextmanager
def node_process(
    region: int, cpus: set[int] | None, where: Where = LOOPBACK, ucx: bool = False
) -> Iterator[list[str]]:
    """A node process (``--node``, serving ``region`` bytes ``where`` it runs, on
    ``cpus``): its ready line's fields (TCP port, raw port, shm name, host id, UCX
    port, UCX address); stopped when the block ends."""
    module = [sys.executable, "-m", "kvpool.bench.remote_transport"]
    popen = subprocess.Popen(
        [*where.prefix, *module, "--node", str(region), "--host", where.host]
        + (["--ucx"] if ucx else []),
        env={**os.environ, **where.env},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None,
    )
    assert popen.stdout is not None
    try:
        fields = popen.stdout.readline().split()
        if len(fields) != 6:
            raise RuntimeError("the benchmark's node process did not start")
        yield fields
    finally:
        stop_by_stdin(popen, 30)


def _measure(
    sizes: Sequence[int],
    transports: Sequence[str],
    rounds: int,
    json_path: str | None,
    split: tuple[set[int], set[int]] | None,
    where: Where = LOOPBACK,
    tcp_path: str = "tcp",
) -> list[Row]:
    """``run_remote_transport`` with the node ``where`` it runs (client and node on
    the CPU sets of ``split``), its TCP rows named ``tcp_path``."""
    region = max(count_for(s, WORKING_SET) * s for s in sizes)
    ucx = False
    if "ucx" in transports:
        from kvpool.transport.ucx import ucx_available

        ucx = ucx_available()
        if not ucx:
            print("ucx: skipped (ucxx is not installed: pip install 'kvpool[ucx]')")
    node_cpus, client_cpus = (split[1], split[0]) if split else (None, None)
    with node_process(region, node_cpus, where, ucx) as fields, pinned(client_cpus):
        tcp_port, raw_port, shm_name, host_id, ucx_port, ucx_addr = fields
        host = where.host
        info = RegionInfo("bench", region, host_id, host, int(tcp_port), shm_name)
        if ucx_addr != "-":
            info.ucx = UcxInfo(host, int(ucx_port), bytes.fromhex(ucx_addr))
        raw = RawClient(host, int(raw_port))
        rows = [
            r
            for s in sizes
            for r in _sizes_rows(s, info, raw, transports, rounds, tcp_path, where.token)
        ]
        raw.sock.close()
    write_json(json_path, rows)
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=sizes_arg, default="64KiB,1MiB,4MiB,16MiB")
    p.add_argument("--transport", default="tcp,shm")
    p.add_argument("--rounds", type=positive_int, default=5)
    p.add_argument("--json")
    p.add_argument("--no-pin", action="store_true", help="do not split CPUs between processes")
    add_link_args(p)
    p.add_argument("--node", type=int, help=argparse.SUPPRESS)
    p.add_argument("--ucx", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--host", default="127.0.0.1", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.node:
        _node(args.node, args.ucx, args.host)
        return 0
    try:
        link = link_of(args)
    except ValueError as exc:
        p.error(str(exc))
    try:
        rows = run_remote_transport(
            args.sizes, args.transport.split(","), args.rounds, args.json, not args.no_pin, link
        )
    except VethUnavailable as exc:
        p.error(f"--veth: {exc}")
    print_table(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())

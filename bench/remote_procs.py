"""The processes ``kvpool bench remote`` measures against, and its clients.

A master and one node (``cluster_processes``), and the raw-socket baseline
server of ``kvpool.bench.remote_transport`` (``raw_server``): on loopback, or
beyond a veth link in a network namespace of their own (``Where``;
kvpool.bench.veth), another "host" whose every byte crosses the link -- kvpool's
and the baseline's alike -- with the token ``Where`` carries for them and their
clients (``connect_client``).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

from kvpool.bench.remote_transport import node_process
from kvpool.bench.veth import LOOPBACK, Where
from kvpool.cluster.client.remote_pool import RemotePool, connect
from kvpool.procs import Child, spawn_kvpool


@contextmanager
def raw_server(region: int, cpus: set[int] | None, where: Where = LOOPBACK) -> Iterator[int]:
    """The raw-socket baseline server of remote_transport's node process; yields its port."""
    with node_process(region, cpus, where) as fields:
        yield int(fields[1])


@contextmanager
def local_cluster(
    dram: int, cpus: set[int] | None, grant_share: float | None = None, where: Where = LOOPBACK
) -> Iterator[str]:
    """A master and one node (``dram`` bytes) as separate processes; yields the URL.
    ``grant_share``: the master's ``--grant-share`` (None: its default)."""
    with cluster_processes(dram, cpus, grant_share, where) as (url, _):
        yield url


@contextmanager
def cluster_processes(
    dram: int, cpus: set[int] | None, grant_share: float | None = None, where: Where = LOOPBACK
) -> Iterator[tuple[str, list[Child]]]:
    """``local_cluster``, yielding the processes too: (URL, [master, node])."""
    master_args = ["master", "--host", where.host, "--port", "0"]
    if grant_share is not None:
        master_args += ["--grant-share", repr(grant_share)]
    master = spawn_kvpool(master_args, prefix=where.prefix, cpus=cpus, env=where.env)
    procs = [master]
    try:
        node_args = ["node", "--master", master.address, "--dram", str(dram), "--host", where.host]
        node = spawn_kvpool(
            [*node_args, "--heartbeat", "0.5"], prefix=where.prefix, cpus=cpus, env=where.env
        )
        procs.append(node)
        yield f"kvpool://{master.address}", procs
    finally:
        for proc in reversed(procs):
            proc.stop()


def connect_client(url: str, transport: str, where: Where = LOOPBACK) -> RemotePool:
    """A client of the bench cluster once its node registered (20 s at most)."""
    pool = connect(url, token=where.token, transport=transport, timeout=30.0)
    deadline = time.monotonic() + 20
    while len(pool.stats()["nodes"]) < 1:
        if time.monotonic() > deadline:
            pool.close()
            raise RuntimeError("no node registered with the master")
        time.sleep(0.05)
    return pool

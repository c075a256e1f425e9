"""``kvpool master`` and ``kvpool node``: run the cluster's servers in the foreground.

Both stop cleanly on SIGINT/SIGTERM (the node unlinks its shared memory).
Binding to anything but loopback requires a shared token (``--token`` or
``KVPOOL_TOKEN``).
"""

from __future__ import annotations

import argparse
import logging
from typing import Any

from kvpool.args import (
    non_negative_float,
    port_arg,
    positive_float,
    positive_int,
    seconds_arg,
    share_arg,
    size_arg,
    size_or_zero_arg,
)
from kvpool.cluster.wire import DEFAULT_ALLOC_TTL
from kvpool.config import DEFAULT_PORT
from kvpool.gc_policy import ServerGc
from kvpool.stop_signals import StopSignals

LOG_LEVELS = ["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"]


def masters_arg(text: str) -> str:
    """``HOST:PORT[,HOST:PORT...]``, checked (kvpool.cluster.link)."""
    from kvpool.cluster.link import parse_masters

    try:
        parse_masters(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def register(subparsers: Any) -> None:
    master = subparsers.add_parser("master", help="run the metadata server")
    master.add_argument("--host", default="127.0.0.1")
    master.add_argument("--port", type=port_arg, default=DEFAULT_PORT)
    master.add_argument("--token", default=None, help="shared token (default $KVPOOL_TOKEN)")
    master.add_argument("--policy", default="lru", help="eviction policy for every node")
    master.add_argument(
        "--node-ttl", type=seconds_arg, default=5.0, help="seconds without heartbeat"
    )
    master.add_argument(
        "--lease-ttl", type=seconds_arg, default=30.0, help="seconds a read lease lasts"
    )
    master.add_argument(
        "--alloc-ttl",
        type=seconds_arg,
        default=DEFAULT_ALLOC_TTL,
        help="seconds a reserved block (or a put) has to commit before the master takes "
        f"its space back (default {DEFAULT_ALLOC_TTL:g})",
    )
    master.add_argument("--metrics-port", type=port_arg, default=None, help="serve /metrics here")
    master.add_argument(
        "--hot-reads",
        type=positive_float,
        default=8.0,
        help="decayed reads that earn a block one more replica",
    )
    master.add_argument(
        "--cool-reads",
        type=non_negative_float,
        default=2.0,
        help="below this a block loses its extra replicas",
    )
    master.add_argument(
        "--grant-share",
        type=share_arg,
        default=None,
        help="share of the cluster's DRAM all clients' put grants may hold together "
        "(default 1/16; 0: lend none, every put asks the master for its space)",
    )
    master.add_argument(
        "--half-life", type=seconds_arg, default=10.0, help="read-heat half-life (s)"
    )
    master.add_argument("--max-replicas", type=positive_int, default=3)
    master.add_argument("--no-auto-replicate", action="store_true")
    master.add_argument(
        "--etcd",
        default="",
        metavar="URLS",
        help="run as leader or hot standby, elected on etcd (http://HOST:PORT[,...])",
    )
    master.add_argument("--cluster", default="default", help="the cluster's name in etcd")
    master.add_argument(
        "--leader-ttl", type=seconds_arg, default=3.0, help="leader lease seconds (HA, >= 1)"
    )
    master.add_argument(
        "--advertise", default="", help="HOST:PORT callers are sent to (HA; default: bind)"
    )
    master.add_argument("--log-level", default="INFO", type=str.upper, choices=LOG_LEVELS)
    master.set_defaults(func=_run_master)

    node = subparsers.add_parser("node", help="contribute DRAM to a pool and serve it")
    node.add_argument(
        "--master",
        required=True,
        type=masters_arg,
        help="HOST:PORT of the master (HA: every master, comma-separated)",
    )
    node.add_argument("--dram", type=size_arg, default="1GiB", help="arena size, e.g. 4GiB")
    node.add_argument("--ssd", default=None, metavar="DIR", help="directory of the SSD tier")
    node.add_argument(
        "--ssd-size", type=size_or_zero_arg, default="0", help="SSD tier size, e.g. 50GiB"
    )
    node.add_argument("--host", default="127.0.0.1", help="address of the TCP data server")
    node.add_argument("--data-port", type=port_arg, default=0)
    node.add_argument("--token", default=None, help="shared token (default $KVPOOL_TOKEN)")
    node.add_argument("--node-id", default=None)
    node.add_argument(
        "--heartbeat", type=seconds_arg, default=1.0, help="seconds between heartbeats"
    )
    node.add_argument("--metrics-port", type=port_arg, default=None, help="serve /metrics here")
    node.add_argument("--log-level", default="INFO", type=str.upper, choices=LOG_LEVELS)
    node.set_defaults(func=_run_node)


def _run_master(args: argparse.Namespace) -> int:
    from kvpool.cluster.master import Master, MasterConfig
    from kvpool.index.heat import ReplicationConfig

    _logging(args.log_level)
    stops = StopSignals()  # before anything starts: a signal from here on stops us cleanly
    replication = ReplicationConfig(
        hot_reads=args.hot_reads,
        cool_reads=args.cool_reads,
        half_life_s=args.half_life,
        max_replicas=args.max_replicas,
        enabled=not args.no_auto_replicate,
    )
    config = MasterConfig(
        host=args.host,
        port=args.port,
        token=args.token,
        policy=args.policy,
        node_ttl=args.node_ttl,
        lease_ttl=args.lease_ttl,
        alloc_ttl=args.alloc_ttl,
        grant_share=MasterConfig.grant_share if args.grant_share is None else args.grant_share,
        metrics_port=args.metrics_port,
        replication=replication,
        etcd=args.etcd,
        cluster=args.cluster,
        leader_ttl=args.leader_ttl,
        advertise=args.advertise,
    )
    master = Master(config)
    host, port = master.start()
    collector = ServerGc()
    collector.start()
    logging.getLogger("kvpool.cluster.master").info(
        "master listening on %s:%d (metrics port %s)", host, port, master.metrics_port
    )
    print(f"kvpool master ready on {host}:{port} (metrics port {master.metrics_port})", flush=True)
    stops.wait()
    collector.stop()
    master.close()
    return 0


def _run_node(args: argparse.Namespace) -> int:
    from kvpool.cluster.node import NodeConfig, StorageNode

    _logging(args.log_level)
    stops = StopSignals()  # before anything starts: a signal from here on stops us cleanly
    config = NodeConfig(
        master=args.master,
        dram_bytes=args.dram,
        host=args.host,
        data_port=args.data_port,
        token=args.token,
        node_id=args.node_id,
        heartbeat_interval=args.heartbeat,
        metrics_port=args.metrics_port,
        ssd_path=args.ssd,
        ssd_bytes=args.ssd_size if args.ssd else 0,
    )
    node = StorageNode(config)
    node.start()
    collector = ServerGc()
    collector.start()
    host, port = node.exposed.tcp.address
    print(
        f"kvpool node {node.node_id} serving {node.arena.size} bytes on {host}:{port} "
        f"(shm {node.arena.name}, metrics port {node.metrics_port})",
        flush=True,
    )
    stops.wait()
    collector.stop()
    node.close()
    return 0


def _logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )

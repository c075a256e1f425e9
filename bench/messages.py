"""``kvpool bench messages``: CPU per control-plane message vs msgpack alone.

Every master call encodes a request on the client (envelope + frame) and
decodes it on the master (frame body -> envelope -> typed message), then the
same for the reply. This times that pair for the real payloads a put and a
read exchange (kvpool.cluster.wire), with realistic contents, against the
floor no codec beats: ``msgpack.packb`` + ``unpackb`` of the same frame body.
Rounds alternate kvpool and baseline; each row is the median over rounds of
the per-message mean. ``ratio`` = baseline / kvpool (higher is better, 1.0 =
no cost beyond msgpack).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import msgpack

from kvpool.args import positive_int
from kvpool.cluster import wire
from kvpool.rpc.frame import HEADER_SIZE, decode_body, encode_frame
from kvpool.rpc.messages import Request, WireMessage, decode_envelope, encode_envelope
from kvpool.transport.base import RegionInfo


@dataclass
class MessageRow:
    message: str
    frame_bytes: int
    kvpool_us: float  # encode + decode, median over rounds
    msgpack_us: float  # packb + unpackb of the same body
    ratio: float  # msgpack_us / kvpool_us


def sample_messages() -> dict[str, WireMessage]:
    """What single puts and reads send, filled the way a 1-node cluster fills them."""

    def key(i: int) -> bytes:
        return i.to_bytes(16, "little")

    region = RegionInfo(
        node_id="node-1",
        size=1 << 30,
        host_id="host/boot/net:[4026531840]",
        tcp_host="127.0.0.1",
        tcp_port=5001,
        shm_name="kvpool-arena-node-1",
        control_port=5002,
        tcp_instance="0123456789abcdef",
    )
    spares = [[1000 + i, "node-1", i << 20] for i in range(16)]
    return {
        "CommitRequest (1 grant)": wire.CommitRequest(ids=[7], keys=[key(1)], parents=[key(0)]),
        "CommitRequest (8 grants)": wire.CommitRequest(
            ids=list(range(8)), keys=[key(i) for i in range(8)], parents=[None] * 8
        ),
        "AllocateRequest (refill)": wire.AllocateRequest(
            keys=[], sizes=[], parents=[], spare=16, spare_size=1 << 20
        ),
        "AllocateReply (16 grants)": wire.AllocateReply(
            placements=[], nodes={"node-1": region}, ttl=120.0, spares=spares, spare_ttl=2.0
        ),
        "LeaseRequest (1 key)": wire.LeaseRequest(keys=[key(1)], prefix=False),
        "LeaseReply (1 block)": wire.LeaseReply(
            lease_id=9, blocks=[[1 << 20, [["node-1", 4096]]]], nodes={"node-1": region}, ttl=5.0
        ),
        "ReleaseRequest": wire.ReleaseRequest(ids=[9]),
    }


def _mean_us(fn: Callable[[], Any], n: int) -> float:
    start = time.process_time()
    for _ in range(n):
        fn()
    return (time.process_time() - start) / n * 1e6


def run_messages(rounds: int = 5, per_round: int = 2000) -> list[MessageRow]:
    if rounds < 1 or per_round < 1:
        raise ValueError("rounds and per_round must be >= 1")
    rows = []
    for name, msg in sample_messages().items():
        cls = type(msg)

        def ours(msg: WireMessage = msg, cls: type[WireMessage] = cls) -> None:
            frame = encode_frame(encode_envelope(Request(1, "m", msg)))
            request = decode_envelope(decode_body(memoryview(frame)[HEADER_SIZE:]))
            cls.from_dict(request.params)  # type: ignore[union-attr]

        body = encode_envelope(Request(1, "m", msg))

        def floor(body: dict[str, Any] = body) -> None:
            msgpack.unpackb(msgpack.packb(body, use_bin_type=True), raw=False)

        ours()  # builds the class's codec outside the timing
        kvpool_us, msgpack_us = [], []
        for _ in range(rounds):
            kvpool_us.append(_mean_us(ours, per_round))
            msgpack_us.append(_mean_us(floor, per_round))
        k, m = statistics.median(kvpool_us), statistics.median(msgpack_us)
        size = len(encode_frame(body))
        rows.append(MessageRow(name, size, round(k, 2), round(m, 2), round(m / k, 3)))
    return rows


def register_messages(suites: Any) -> None:
    parser = suites.add_parser("messages", help="CPU per control-plane message vs msgpack alone")
    parser.add_argument("--rounds", type=positive_int, default=5)
    parser.add_argument("--per-round", type=positive_int, default=2000)
    parser.add_argument("--json", default=None, metavar="F")
    parser.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    rows = run_messages(args.rounds, args.per_round)
    print(f"{'message':28s} {'bytes':>6s} {'kvpool µs':>10s} {'msgpack µs':>11s} {'ratio':>6s}")
    for r in rows:
        print(
            f"{r.message:28s} {r.frame_bytes:6d} {r.kvpool_us:10.2f} {r.msgpack_us:11.2f}"
            f" {r.ratio:6.2f}"
        )
    if args.json:
        with open(args.json, "w") as fh:
            json.dump([asdict(r) for r in rows], fh, indent=1)
    return 0

"""``kvpool demo``: an embedded pool serving a synthetic multi-turn trace.

For each request, in arrival order: cut its prompt into 512-token blocks,
``prefix_match`` the chained keys, load the cached prefix with ``get_into``
(what a prefill worker does before computing) and ``put`` the blocks it had
to compute. Prints the prefix hit ratio and the bytes-per-second the pool
sustained, so a first run shows the store doing its job.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from typing import Any

from kvpool.args import non_negative_int, size_arg
from kvpool.config import format_size


@dataclass
class DemoResult:
    requests: int
    blocks: int
    hit_blocks: int
    bytes_loaded: int
    bytes_stored: int
    seconds: float

    @property
    def hit_ratio(self) -> float:
        return self.hit_blocks / self.blocks if self.blocks else 0.0


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "demo", help="fill an embedded pool from a synthetic multi-turn trace"
    )
    parser.add_argument("--requests", type=non_negative_int, default=400)
    parser.add_argument(
        "--block-bytes", type=size_arg, default="1MiB", help="KV bytes per 512-token block"
    )
    parser.add_argument("--dram", type=size_arg, default="256MiB", help="DRAM tier size")
    parser.add_argument("--ssd-dir", default=None, help="add an SSD tier in this directory")
    parser.add_argument(
        "--ssd", type=size_arg, default="1GiB", help="SSD tier size (with --ssd-dir)"
    )
    parser.add_argument("--policy", default="lru")
    parser.add_argument("--seed", type=int, default=0)
    parser.set_defaults(func=_main)


def run_demo(
    requests: int,
    block_bytes: int,
    dram_bytes: int,
    ssd_dir: str | None = None,
    ssd_bytes: int = 0,
    policy: str = "lru",
    seed: int = 0,
) -> DemoResult:
    import numpy as np

    from kvpool.embedded.pool import Pool
    from kvpool.index.keys import Namespace, block_keys
    from kvpool.workload.synth import synthesize
    from kvpool.workload.tokens import tokens_for_request

    trace = synthesize(requests=requests, seed=seed)
    namespace = Namespace("demo-model")
    kv = np.random.default_rng(seed).integers(0, 255, block_bytes, dtype=np.uint8)
    out = np.empty(block_bytes, np.uint8)
    result = DemoResult(len(trace), 0, 0, 0, 0, 0.0)
    pool = Pool.embedded(
        dram_bytes=dram_bytes,
        ssd_path=ssd_dir,
        ssd_bytes=ssd_bytes if ssd_dir else 0,
        policy=policy,
    )
    with pool:
        start = time.perf_counter()
        for record in trace:
            keys = block_keys(tokens_for_request(record), namespace)
            hit = pool.prefix_match(keys)
            for key in keys[:hit]:
                result.bytes_loaded += pool.get_into(key, out) or 0
            parents = [keys[i - 1] if i else None for i in range(hit, len(keys))]
            stored = pool.put_batch(keys[hit:], [kv] * (len(keys) - hit), parents)
            result.bytes_stored += block_bytes * sum(stored)
            result.blocks += len(keys)
            result.hit_blocks += hit
        result.seconds = time.perf_counter() - start
        stats = pool.stats()
    _print(result, stats, block_bytes)
    return result


def _print(result: DemoResult, stats: dict[str, Any], block_bytes: int) -> None:
    moved = result.bytes_loaded + result.bytes_stored
    print(f"requests            {result.requests}")
    print(f"prompt blocks       {result.blocks} x {format_size(block_bytes)}")
    print(f"prefix hit ratio    {result.hit_ratio:.3f} ({result.hit_blocks} blocks reused)")
    print(
        f"loaded / stored     {result.bytes_loaded / 1e9:.2f} GB / "
        f"{result.bytes_stored / 1e9:.2f} GB"
    )
    print(
        f"throughput          {moved / result.seconds / 1e9:.2f} GB/s "
        f"({result.requests / result.seconds:.0f} requests/s, {result.seconds:.2f} s)"
    )
    for name, tier in stats["tiers"].items():
        print(
            f"tier {name:<5}          {tier['blocks']} blocks, "
            f"{tier['used_bytes'] / 2**20:.0f}/{tier['capacity_bytes'] / 2**20:.0f} MiB used, "
            f"{tier['evictions']} evictions"
        )


def _main(args: argparse.Namespace) -> int:
    run_demo(
        requests=args.requests,
        block_bytes=args.block_bytes,
        dram_bytes=args.dram,
        ssd_dir=args.ssd_dir,
        ssd_bytes=args.ssd,
        policy=args.policy,
        seed=args.seed,
    )
    return 0

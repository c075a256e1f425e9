"""``kvpool calibrate``: time real prefill and fit the conductor's cost model.

For each prompt length on a grid and each cached fraction (0, 1/4, 1/2,
3/4 of the prompt, whole blocks), a fresh prompt (random token ids, so
nothing else is shared) is first prefilled up to the cached length (which
stores those blocks in an embedded pool), then the whole prompt is
prefilled and its compute time (``PrefillResult.timings["compute_s"]``
plus the prefix match and load, ``total_s`` less the store wait) is
recorded. The fit (``cost_model.fit_prefill``) is a quadratic in the length:
``t = c0 + c_token * new + c_pair * pairs(new, cached) + c_cached * cached``.

It also measures the pool's copy bandwidth (put + get of block-sized
values: in the embedded pool, or with ``--pool kvpool://HOST:PORT`` in a
running cluster), which the conductor loads as its transfer bandwidth.

The JSON written (``--out``, default ``cost_model_<model>.json``)::

    {"prefill": {c0, c_token, c_pair, c_cached, model, source, meta},
     "transfer": {"bandwidth_Bps": ..., "latency_s": ...},
     "samples": [[new, cached, seconds], ...], "threads": n}

``PrefillCostModel.load`` reads it; ``kvpool serve --router conductor
--router-opt cost_model=FILE`` uses it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from kvpool.api import KVStore
from kvpool.args import non_negative_int, pool_url_arg, positive_int
from kvpool.serve.sched.cost_model import PrefillCostModel, fit_prefill, grid, summarize_fit


def measure_bandwidth(pool: KVStore, block_bytes: int, blocks: int = 16) -> float:
    """Bytes per second of put + get round trips of ``block_bytes`` values (median)."""
    import os

    import numpy as np

    payload = np.frombuffer(os.urandom(block_bytes), dtype=np.uint8)
    rates = []
    for i in range(blocks):
        key = i.to_bytes(4, "little") + b"kvpool-calib-bw"
        key = key[:16].ljust(16, b"\0")
        t0 = time.perf_counter()
        pool.put(key, payload.tobytes())
        data = pool.get(key)
        dt = time.perf_counter() - t0
        if data is not None and dt > 0:
            rates.append(2 * block_bytes / dt)
        pool.remove(key)
    rates.sort()
    return rates[len(rates) // 2] if rates else 1e9


def calibrate(
    model_name: str = "tiny",
    *,
    max_tokens: int = 4096,
    points: int = 6,
    block_tokens: int = 64,
    repeats: int = 3,
    threads: int | None = 1,
    seed: int = 0,
    progress: bool = True,
    pool_url: str | None = None,
) -> dict[str, Any]:
    """Time prefill over the grid; returns the JSON-ready calibration dict."""
    import numpy as np
    import torch

    import kvpool
    from kvpool.serve.runtime.model import build_model
    from kvpool.serve.runtime.prefill import PrefillWorker

    if threads:
        torch.set_num_threads(threads)
    model = build_model(model_name, seed=seed, block_tokens=block_tokens)
    cfg = model.cfg
    max_tokens = min(max_tokens, cfg.max_context)
    lengths = grid(max_tokens, points, block_tokens)
    rng = np.random.default_rng(seed)
    block_bytes = cfg.kv_bytes_per_token * block_tokens
    need = sum(lengths) * 4 * repeats * cfg.kv_bytes_per_token * 2 + (64 << 20)
    samples: list[tuple[int, int, float]] = []
    with kvpool.Pool.embedded(dram_bytes=need) as pool:
        worker = PrefillWorker(model, pool, chunk_tokens=512)
        try:
            # warm-up: first calls pay allocation and kernel selection
            warm = rng.integers(0, cfg.vocab_size, size=min(256, max_tokens)).tolist()
            worker.prefill(warm)
            for n in lengths:
                for frac in (0.0, 0.25, 0.5, 0.75):
                    cached = int(n * frac) // block_tokens * block_tokens
                    if frac and cached == 0:
                        continue
                    best = float("inf")
                    got = 0
                    for _ in range(repeats):
                        tokens = rng.integers(0, cfg.vocab_size, size=n).tolist()
                        if cached:
                            worker.prefill(tokens[:cached])
                        res = worker.prefill(tokens)
                        t = res.timings["total_s"] - res.timings.get("store_wait_s", 0.0)
                        best = min(best, t)
                        got = res.cached_tokens
                    samples.append((n - got, got, best))
                    if progress:
                        print(
                            f"  prompt {n:>6}  cached {got:>6}  {best * 1e3:8.2f} ms",
                            file=sys.stderr,
                        )
            if pool_url is None:
                bandwidth = measure_bandwidth(pool, block_bytes)
        finally:
            worker.close()
    if pool_url is not None:
        with kvpool.connect(pool_url) as remote:
            bandwidth = measure_bandwidth(remote, block_bytes)
    fit = fit_prefill(samples, model=cfg.name, source="kvpool calibrate")
    fit.meta.update(
        {"block_tokens": block_tokens, "threads": torch.get_num_threads(), "grid": lengths}
    )
    return {
        "prefill": fit.to_dict(),
        "transfer": {"bandwidth_Bps": bandwidth, "latency_s": 200e-6},
        "samples": [list(s) for s in samples],
        "threads": torch.get_num_threads(),
    }


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "calibrate",
        help="time real prefill and fit the conductor's cost model (JSON)",
        description="Time PrefillWorker over a grid of prompt and cached lengths, fit "
        "t = c0 + c_token*new + c_pair*pairs + c_cached*cached, and measure pool bandwidth.",
    )
    p.add_argument("--model", default="tiny", help="preset (tiny on a CPU)")
    p.add_argument("--out", default=None, help="JSON file (default cost_model_<model>.json)")
    p.add_argument(
        "--max-tokens", type=positive_int, default=4096, help="longest prompt on the grid"
    )
    p.add_argument("--points", type=positive_int, default=6, help="prompt lengths on the grid")
    p.add_argument("--block-tokens", type=positive_int, default=64)
    p.add_argument(
        "--repeats", type=positive_int, default=3, help="timings per point (min is kept)"
    )
    p.add_argument(
        "--threads",
        type=non_negative_int,
        default=1,
        help="torch threads (default 1: stable timings on a shared 2-core machine; "
        "0 keeps torch's default)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--pool",
        type=pool_url_arg,
        default=None,
        help="kvpool://HOST:PORT: measure this cluster's bandwidth",
    )
    p.set_defaults(func=_run_cli)


def _run_cli(args: argparse.Namespace) -> int:
    result = calibrate(
        args.model,
        max_tokens=args.max_tokens,
        points=args.points,
        block_tokens=args.block_tokens,
        repeats=args.repeats,
        threads=args.threads,
        seed=args.seed,
        pool_url=args.pool,
    )
    out = args.out or f"cost_model_{args.model}.json"
    with open(out, "w", encoding="utf-8") as fh:
        json.dump(result, fh, indent=2)
        fh.write("\n")
    model = PrefillCostModel.from_dict(result["prefill"])
    samples = [(int(n), int(c), float(t)) for n, c, t in result["samples"]]
    print(summarize_fit(model, samples))
    print(f"pool bandwidth {result['transfer']['bandwidth_Bps'] / 1e9:.2f} GB/s")
    print(f"wrote {out}")
    return 0

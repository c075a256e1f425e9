"""``kvpool bench serve``: concurrent streaming completions against ``kvpool serve``.

This process is the load: ``--concurrency`` client tasks (one asyncio loop,
httpx) send ``--requests`` streaming ``/v1/completions`` requests in all,
each with ``max_tokens`` = ``--max-tokens`` and ``ignore_eos`` (so every
request produces exactly that many tokens). Prompts are token ids: a shared
prefix of ``--shared-prefix`` tokens (a system prompt every request starts
with) followed by ``--prompt-tokens`` - ``--shared-prefix`` tokens unique to
the request, so the pool's prefix reuse is part of what is measured.

Per request it records TTFT (send to the first token's event) and every TBT
(gap between consecutive token events), as the client sees them. Reports
output tokens/s over the wall time of the run, TTFT and TBT p50/p90/p99,
and the cached prompt tokens the server reported.

Without ``--url`` it starts ``kvpool serve`` itself (``--model``,
``--prefill``, ``--decode``, ``--block-tokens`` ...) on a free port and stops
it afterwards.

``--checkpoint PATH`` (or ``tiny``) measures something else: kvpool serve
against ``transformers`` and vLLM on one Hugging Face checkpoint
(``kvpool.bench.serve_peers``).
"""

from __future__ import annotations

import argparse
import itertools
import time
from dataclasses import asdict
from typing import Any

from kvpool import procs
from kvpool.args import non_negative_int, positive_int
from kvpool.bench.common import write_json
from kvpool.bench.serve_peers import ENGINE_PYTHON
from kvpool.serve.runtime.http.load import (
    LoadResult,
    RequestStats,
    common_prefix,
    format_result,
    make_prompts,
    percentiles,
    run_load,
)


def run_colocated(
    prompts: list[list[int]],
    *,
    concurrency: int,
    max_tokens: int,
    model: str = "tiny",
    block_tokens: int = 64,
    seed: int = 0,
) -> LoadResult:
    """Same-run baseline: the same requests through one process, no HTTP, no RPC.

    One ``PrefillWorker`` and one ``DecodeEngine`` share a thread and an
    embedded pool (what a colocated engine does): a client slot that frees up
    sends its next prompt at once, the prompt is prefilled between decode
    steps (stalling the batch, the interference disaggregation removes), and
    the batch holds at most ``concurrency`` requests. Times are taken where
    the HTTP client would take them: the first token when prefill returns,
    the others as the decode steps emit them.
    """
    from collections import deque

    import torch

    from kvpool.embedded.pool import Pool
    from kvpool.serve.runtime.decode import DecodeEngine
    from kvpool.serve.runtime.model import build_model
    from kvpool.serve.runtime.prefill import PrefillWorker

    torch.set_num_threads(1)
    m = build_model(model, seed, block_tokens=block_tokens)
    page = 16
    longest = max(len(p) for p in prompts) + max_tokens
    pages = concurrency * -(-longest // page) + concurrency
    pending = deque(enumerate(prompts))
    sent: dict[str, float] = {}
    times: dict[str, list[float]] = {}
    cached = 0
    with (
        Pool.embedded(dram_bytes=256 << 20) as pool,
        PrefillWorker(m, pool) as pw,
        DecodeEngine(
            m,
            pool,
            num_pages=pages,
            page_tokens=page,
            max_batch=concurrency,
            overlap_loads=False,
        ) as engine,
    ):
        start = time.perf_counter()
        outstanding = 0
        while pending or outstanding:
            freed = time.perf_counter()  # clients whose requests just finished send now
            while pending and outstanding < concurrency:
                i, prompt = pending.popleft()
                rid = f"r{i}"
                sent[rid] = freed  # so waiting behind other prefills counts in TTFT
                result = pw.prefill(prompt, request_id=rid)
                times[rid] = [time.perf_counter()]
                cached += result.cached_tokens
                engine.submit(result, max_tokens)
                outstanding += 1
            for ev in engine.step():
                if ev.index > 0:
                    times[ev.request_id].append(time.perf_counter())
                if ev.finished:
                    outstanding -= 1
        wall = time.perf_counter() - start
    stats = [
        RequestStats(
            ts[0] - sent[rid], [b - a for a, b in itertools.pairwise(ts)], len(ts), 0, None
        )
        for rid, ts in times.items()
    ]
    tokens = sum(s.tokens for s in stats)
    return LoadResult(
        requests=len(stats),
        concurrency=concurrency,
        max_tokens=max_tokens,
        prompt_tokens=round(sum(len(p) for p in prompts) / len(prompts)),
        shared_prefix=common_prefix(prompts) if len(prompts) > 1 else 0,
        errors=0,
        wall_s=round(wall, 3),
        output_tokens=tokens,
        tokens_per_s=round(tokens / wall, 1),
        requests_per_s=round(len(stats) / wall, 2),
        ttft_ms=percentiles([s.ttft for s in stats]),
        tbt_ms=percentiles([t for s in stats for t in s.tbt]),
        cached_tokens=cached,
        url="in-process colocated (no HTTP/RPC)",
    )


def ratios(serve: LoadResult, base: LoadResult) -> dict[str, float]:
    """serve / colocated: tokens/s, and TTFT and TBT p50/p99."""
    out = {"tokens_per_s": round(serve.tokens_per_s / base.tokens_per_s, 3)}
    for name in ("ttft_ms", "tbt_ms"):
        for q in ("p50", "p99"):
            a, b = getattr(serve, name).get(q), getattr(base, name).get(q)
            if a and b:
                out[f"{name[:-3]}_{q}"] = round(a / b, 3)
    return out


def start_server(extra: list[str], timeout: float = 120.0) -> procs.Child:
    """``kvpool serve --port 0 EXTRA`` as a child, ready (its URL is ``.url``)."""
    return procs.spawn(
        "kvpool serve", procs.kvpool_args("serve", "--port", "0", *extra), timeout=timeout
    )


def register_serve(suites: Any) -> None:
    p = suites.add_parser("serve", help="concurrent streaming completions against kvpool serve")
    p.add_argument("--url", default=None, help="a running server (default: start one)")
    p.add_argument("--concurrency", type=positive_int, default=8)
    p.add_argument("--requests", type=positive_int, default=None, help="64 (--checkpoint: 8)")
    p.add_argument("--max-tokens", type=positive_int, default=32)
    p.add_argument("--prompt-tokens", type=positive_int, default=256)
    p.add_argument(
        "--shared-prefix", type=non_negative_int, default=None, help="128 (--checkpoint: 1024)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default="tiny", help="(own server) model preset")
    p.add_argument("--prefill", type=positive_int, default=1, help="(own server) prefill workers")
    p.add_argument("--decode", type=positive_int, default=1, help="(own server) decode workers")
    p.add_argument(
        "--block-tokens", type=positive_int, default=64, help="(own server) pool block size"
    )
    p.add_argument(
        "--no-baseline",
        action="store_true",
        help="skip the same-run in-process colocated baseline (same prompts, one process)",
    )
    peers = p.add_argument_group(
        "peers on a checkpoint (--checkpoint): kvpool serve vs transformers generate vs vLLM"
    )
    peers.add_argument(
        "--checkpoint",
        default=None,
        metavar="PATH",
        help="a Hugging Face checkpoint directory, or 'tiny' (written to a temp dir): "
        "compare the peers on it instead of loading one server",
    )
    peers.add_argument("--peers", default="kvpool,transformers,vllm", help="comma list")
    peers.add_argument("--levels", default="1,4", help="concurrencies (comma list)")
    peers.add_argument("--rounds", type=positive_int, default=2, help="interleaved rounds")
    peers.add_argument("--unique-tokens", type=positive_int, default=64, help="after the prefix")
    peers.add_argument(
        "--threads", type=positive_int, default=None, help="transformers' torch threads (1)"
    )
    peers.add_argument(
        "--vllm-python", default=str(ENGINE_PYTHON), help="a python with vllm (the engine venv)"
    )
    p.add_argument("--json", default=None, metavar="F")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    if args.checkpoint is not None:
        from kvpool.bench.serve_peers import run_peers

        return run_peers(args)
    args.requests = args.requests or 64
    args.shared_prefix = 128 if args.shared_prefix is None else args.shared_prefix
    prompts = make_prompts(args.requests, args.prompt_tokens, args.shared_prefix, args.seed)
    base = None
    if not args.no_baseline:  # before our own server starts, so it has the machine alone
        base = run_colocated(
            prompts,
            concurrency=args.concurrency,
            max_tokens=args.max_tokens,
            model=args.model,
            block_tokens=args.block_tokens,
            seed=0,
        )
    server = None
    url = args.url
    if url is None:
        server = start_server(
            [
                "--model",
                args.model,
                "--prefill",
                str(args.prefill),
                "--decode",
                str(args.decode),
                "--block-tokens",
                str(args.block_tokens),
            ]
        )
        url = server.url
    try:
        result = run_load(
            url, concurrency=args.concurrency, requests=args.requests, max_tokens=args.max_tokens,
            prompts=prompts,
        )  # fmt: skip
    finally:
        if server is not None:
            server.stop(30.0)
    print(f"kvpool serve ({url}):")
    print(format_result(result))
    payload: dict[str, Any] = {"serve": asdict(result)}
    if base is not None:
        print("baseline, same prompts in one process (prefill between decode steps):")
        print(format_result(base))
        payload["colocated"] = asdict(base)
        payload["ratio"] = ratios(result, base)
        print("serve / colocated: " + ", ".join(f"{k} {v}" for k, v in payload["ratio"].items()))
    write_json(args.json, payload)
    return 0 if result.errors == 0 else 1

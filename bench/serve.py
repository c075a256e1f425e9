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
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from kvpool import procs
from kvpool.bench.common import write_json


@dataclass
class RequestStats:
    ttft: float
    tbt: list[float]
    tokens: int
    cached_tokens: int
    error: str | None = None


@dataclass
class LoadResult:
    requests: int
    concurrency: int
    max_tokens: int
    prompt_tokens: int
    shared_prefix: int
    errors: int
    wall_s: float
    output_tokens: int
    tokens_per_s: float
    requests_per_s: float
    ttft_ms: dict[str, float] = field(default_factory=dict)
    tbt_ms: dict[str, float] = field(default_factory=dict)
    cached_tokens: int = 0
    url: str = ""


def percentiles(values: list[float], scale: float = 1000.0) -> dict[str, float]:
    if not values:
        return {}
    xs = sorted(values)

    def pick(q: float) -> float:
        return round(xs[min(len(xs) - 1, int(q * len(xs)))] * scale, 3)

    return {
        "p50": pick(0.50),
        "p90": pick(0.90),
        "p99": pick(0.99),
        "mean": round(sum(xs) / len(xs) * scale, 3),
    }


def make_prompts(count: int, prompt_tokens: int, shared: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    shared = min(shared, prompt_tokens - 1)
    prefix = [rng.randrange(256) for _ in range(shared)]
    return [
        prefix + [rng.randrange(256) for _ in range(prompt_tokens - shared)] for _ in range(count)
    ]


async def _one(client: Any, url: str, prompt: Any, max_tokens: int) -> RequestStats:
    body = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "stream": True,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    times: list[float] = []
    cached = 0
    error = None
    async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            text = (await resp.aread()).decode(errors="replace")
            return RequestStats(0.0, [], 0, 0, f"HTTP {resp.status_code}: {text[:200]}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                break
            event = json.loads(data)
            if "error" in event:
                error = str(event["error"].get("message"))
                continue
            if event.get("usage"):
                cached = int(
                    event["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0)
                )
            for choice in event.get("choices", []):
                times.extend(time.perf_counter() for _ in choice.get("token_ids", []))
    ttft = times[0] - start if times else 0.0
    tbt = [b - a for a, b in itertools.pairwise(times)]
    return RequestStats(ttft, tbt, len(times), cached, error)


async def _load(
    url: str, prompts: list[Any], concurrency: int, max_tokens: int
) -> tuple[list[RequestStats], float]:
    import httpx

    queue: asyncio.Queue[Any] = asyncio.Queue()
    for p in prompts:
        queue.put_nowait(p)
    out: list[RequestStats] = []
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0), limits=limits) as client:

        async def worker() -> None:
            while True:
                try:
                    prompt = queue.get_nowait()
                except asyncio.QueueEmpty:
                    return
                try:
                    out.append(await _one(client, url, prompt, max_tokens))
                except httpx.HTTPError as exc:
                    out.append(RequestStats(0.0, [], 0, 0, f"{type(exc).__name__}: {exc}"))

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - start
    return out, wall


def run_load(
    url: str,
    *,
    concurrency: int,
    requests: int,
    max_tokens: int,
    prompt_tokens: int = 256,
    shared_prefix: int = 128,
    prompts: list[Any] | None = None,
    seed: int = 0,
) -> LoadResult:
    url = url.rstrip("/")
    if prompts is None:
        prompts = make_prompts(requests, prompt_tokens, shared_prefix, seed)
    else:  # describe the given prompts (token-id lists)
        prompt_tokens = round(sum(len(p) for p in prompts) / max(len(prompts), 1))
        shared_prefix = _common_prefix(prompts) if len(prompts) > 1 else 0
    stats, wall = asyncio.run(_load(url, prompts, concurrency, max_tokens))
    ok = [s for s in stats if s.error is None]
    tokens = sum(s.tokens for s in ok)
    return LoadResult(
        requests=len(stats),
        concurrency=concurrency,
        max_tokens=max_tokens,
        prompt_tokens=prompt_tokens,
        shared_prefix=shared_prefix,
        errors=len(stats) - len(ok),
        wall_s=round(wall, 3),
        output_tokens=tokens,
        tokens_per_s=round(tokens / wall, 1) if wall else 0.0,
        requests_per_s=round(len(ok) / wall, 2) if wall else 0.0,
        ttft_ms=percentiles([s.ttft for s in ok]),
        tbt_ms=percentiles([t for s in ok for t in s.tbt]),
        cached_tokens=sum(s.cached_tokens for s in ok),
        url=url,
    )


def _common_prefix(prompts: list[Any]) -> int:
    first = prompts[0]
    n = min(len(p) for p in prompts)
    for i in range(n):
        if any(p[i] != first[i] for p in prompts):
            return i
    return n


def format_result(r: LoadResult) -> str:
    def pct(d: dict[str, float]) -> str:
        return " / ".join(f"{d.get(k, 0):.1f}" for k in ("p50", "p90", "p99"))

    return (
        f"{r.requests} requests ({r.errors} failed), concurrency {r.concurrency}, "
        f"{r.max_tokens} tokens each, prompt {r.prompt_tokens} tokens "
        f"({r.shared_prefix} shared)\n"
        f"  throughput  {r.tokens_per_s:.1f} output tokens/s, {r.requests_per_s:.2f} requests/s "
        f"({r.wall_s:.2f} s)\n"
        f"  TTFT ms     p50 / p90 / p99  {pct(r.ttft_ms)}\n"
        f"  TBT ms      p50 / p90 / p99  {pct(r.tbt_ms)}\n"
        f"  prefix hit  {r.cached_tokens} prompt tokens served from the pool"
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
            m, pool, num_pages=pages, page_tokens=page, max_batch=concurrency, overlap_loads=False
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
        shared_prefix=_common_prefix(prompts) if len(prompts) > 1 else 0,
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
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--shared-prefix", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default="tiny", help="(own server) model preset")
    p.add_argument("--prefill", type=int, default=1, help="(own server) prefill workers")
    p.add_argument("--decode", type=int, default=1, help="(own server) decode workers")
    p.add_argument("--block-tokens", type=int, default=64, help="(own server) pool block size")
    p.add_argument(
        "--no-baseline",
        action="store_true",
        help="skip the same-run in-process colocated baseline (same prompts, one process)",
    )
    p.add_argument("--json", default=None, metavar="F")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
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

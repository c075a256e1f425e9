"""A load generator for ``kvpool serve``: concurrent streaming completions, as a client sees them.

``run_load`` sends ``requests`` streaming ``/v1/completions`` requests from
``concurrency`` client tasks (one asyncio loop, httpx), each with
``ignore_eos`` so every reply has exactly ``max_tokens`` tokens, and records
per request the TTFT (send to the first token's event), every TBT (gap
between token events) and the cached prompt tokens the server reported.
``make_prompts`` builds token-id prompts sharing a ``shared``-token prefix,
so the pool's prefix reuse is part of what is measured. Used by ``kvpool
serve --demo`` and ``kvpool bench serve``.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any


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


async def _sse_lines(resp: Any) -> AsyncIterator[str]:
    """The event stream's lines, split at ``\n`` only: a server that writes JSON
    without escaping non-ASCII (vLLM) may send U+2028 or U+0085 inside a string,
    where ``aiter_lines`` (``str.splitlines``) would cut the event."""
    pending = ""
    async for text in resp.aiter_text():
        pending += text
        *lines, pending = pending.split("\n")
        for line in lines:
            yield line.rstrip("\r")
    if pending:
        yield pending


async def _one(
    client: Any, url: str, prompt: Any, max_tokens: int, extra: dict[str, Any] | None = None
) -> RequestStats:
    body = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "stream": True,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
        **(extra or {}),
    }
    start = time.perf_counter()
    times: list[float] = []
    cached = 0
    error = None
    async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            text = (await resp.aread()).decode(errors="replace")
            return RequestStats(0.0, [], 0, 0, f"HTTP {resp.status_code}: {text[:200]}")
        async for line in _sse_lines(resp):
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                break
            try:
                event = json.loads(data)
            except json.JSONDecodeError as exc:
                error = f"malformed event {data[:80]!r}: {exc}"
                continue
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
    url: str,
    prompts: list[Any],
    concurrency: int,
    max_tokens: int,
    extra: dict[str, Any] | None = None,
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
                    out.append(await _one(client, url, prompt, max_tokens, extra))
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
    extra_body: dict[str, Any] | None = None,
) -> LoadResult:
    """``extra_body``: more request fields (another server's own, e.g. vLLM's
    ``return_token_ids``, so its chunks carry ``token_ids`` as kvpool's do)."""
    url = url.rstrip("/")
    if prompts is None:
        prompts = make_prompts(requests, prompt_tokens, shared_prefix, seed)
    else:  # describe the given prompts (token-id lists)
        prompt_tokens = round(sum(len(p) for p in prompts) / max(len(prompts), 1))
        shared_prefix = common_prefix(prompts) if len(prompts) > 1 else 0
    stats, wall = asyncio.run(_load(url, prompts, concurrency, max_tokens, extra_body))
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


def common_prefix(prompts: list[Any]) -> int:
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

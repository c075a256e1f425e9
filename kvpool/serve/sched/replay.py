"""``kvpool replay``: replay a trace against a live OpenAI-compatible server.

Each record is sent at its timestamp (divided by ``--speed``) as a streaming
``POST /v1/completions`` whose prompt is a list of token ids from
``kvpool.workload.tokens.tokens_for_request`` — same hash id => same block of tokens,
so the server's own block hashing sees exactly the trace's prefix sharing —
and ``max_tokens`` = the record's output length (``ignore_eos`` so the reply
has that length).

Scaling for small models: ``--block-tokens`` is the block size the prompt is
built with (use the server's pool block size, e.g. 64 for ``tiny``); by
default each trace block (512 tokens) becomes one such block, so prompt
lengths scale by ``block_tokens / 512`` and the sharing is unchanged
(``--scale-input`` overrides the factor). ``--scale-output`` scales reply
lengths; ``--max-input``/``--max-output`` cap them.

Measured per request: TTFT (send -> first token chunk), the gaps between
token chunks (TBT), HTTP 429 rejections, other failures, and the cached
prompt tokens the server reports (``usage.prompt_tokens_details`` in the
final usage chunk). SLOs are multiples of a request's unloaded latency, as
in the conductor: before the replay one probe request is sent alone (a
prompt no other request shares); TTFT SLO = ``--ttft-slo`` x the probe's
TTFT scaled linearly to the request's prompt length (or, with
``--cost-model FILE`` from ``kvpool calibrate``, x the model's unloaded
prefill time), TBT SLO = ``--tbt-slo`` x the probe's median gap. A request
meets the TBT SLO when the P90 of its gaps and their mean are within it
(as in ``kvpool sim``). Goodput: requests within both SLOs per second of the
trace's (scaled) span.

``--json F`` writes the summary; ``--plot DIR`` writes ``ttft_cdf.png`` and
``tbt_cdf.png`` (matplotlib, imported only then).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvpool.serve.sched.cost_model import PrefillCostModel
from kvpool.serve.sched.replay_results import (
    Outcome,
    ReplayError,
    apply_slos,
    plot_cdfs,
    summarize,
)
from kvpool.workload.tokens import tokens_for_request


@dataclass
class ReplayPlan:
    """What to send: one entry per record (arrival s, token ids, max_tokens)."""

    arrivals: list[float]
    prompts: list[list[int]]
    max_tokens: list[int]


def build_plan(
    records: Sequence[Any],
    *,
    speed: float = 1.0,
    block_tokens: int = 512,
    trace_block_tokens: int = 512,
    scale_input: float | None = None,
    scale_output: float = 1.0,
    max_input: int = 0,
    max_output: int = 0,
    vocab_size: int = 256,
) -> ReplayPlan:
    """Token ids and send times for ``records`` (see the module doc for the scaling)."""
    if speed <= 0:
        raise ValueError("speed must be > 0")
    factor = block_tokens / trace_block_tokens if scale_input is None else scale_input
    t0 = records[0].timestamp if records else 0
    plan = ReplayPlan([], [], [])
    for rec in records:
        cap = len(rec.hash_ids) * block_tokens
        n = max(1, min(cap, round(rec.input_length * factor)))
        if max_input:
            n = min(n, max_input)
        scaled = dataclasses.replace(rec, input_length=n)
        tokens = tokens_for_request(scaled, block_tokens, vocab_size)
        out = max(1, round(rec.output_length * scale_output))
        if max_output:
            out = min(out, max_output)
        plan.arrivals.append((rec.timestamp - t0) / 1000.0 / speed)
        plan.prompts.append([int(t) for t in tokens])
        plan.max_tokens.append(out)
    return plan


class Progress:
    """A one-line progress bar on stderr (no dependency); silent when disabled."""

    def __init__(self, total: int, enabled: bool = True, width: int = 30) -> None:
        self.total, self.enabled, self.width = total, enabled, width
        self.done = self.rejected = self.failed = 0
        self._last = 0.0
        self._t0 = time.monotonic()

    def update(self, outcome: Outcome) -> None:
        self.done += 1
        self.rejected += outcome.rejected
        self.failed += (not outcome.ok) and not outcome.rejected
        now = time.monotonic()
        if self.enabled and (now - self._last > 0.2 or self.done == self.total):
            self._last = now
            frac = self.done / self.total if self.total else 1.0
            bar = "#" * int(frac * self.width)
            sys.stderr.write(
                f"\r[{bar:<{self.width}}] {self.done}/{self.total} "
                f"rejected {self.rejected} failed {self.failed} {now - self._t0:6.1f}s"
            )
            if self.done == self.total:
                sys.stderr.write("\n")
            sys.stderr.flush()


async def _send(client: Any, url: str, prompt: list[int], max_tokens: int, out: Outcome) -> None:
    body = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
        "temperature": 0,
    }
    t0 = time.perf_counter()
    last: float | None = None
    try:
        async with client.stream("POST", url, json=body) as resp:
            out.status = resp.status_code
            if resp.status_code != 200:
                await resp.aread()
                out.error = f"HTTP {resp.status_code}"
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                msg = json.loads(data)
                if "error" in msg:
                    out.error = str(msg["error"].get("message", msg["error"]))
                    continue
                now = time.perf_counter()
                if msg.get("choices"):
                    n = max(1, len(msg["choices"][0].get("token_ids") or [None]))
                    if last is None:
                        out.ttft = now - t0
                    else:
                        out.gaps.append(now - last)
                    last = now
                    out.output_tokens += n
                usage = msg.get("usage")
                if usage:
                    details = usage.get("prompt_tokens_details") or {}
                    if "cached_tokens" in details:
                        out.cached_tokens = int(details["cached_tokens"])
    except Exception as exc:  # network errors count as failures, not crashes
        out.error = f"{type(exc).__name__}: {exc}"


async def _probe(client: Any, url: str, tokens: int, max_tokens: int, vocab: int) -> Outcome:
    import numpy as np

    rng = np.random.default_rng(int.from_bytes(os.urandom(4), "little"))
    prompt = [int(t) for t in rng.integers(0, vocab, size=tokens)]
    out = Outcome(-1, tokens, max_tokens)
    await _send(client, url, prompt, max_tokens, out)
    return out


async def _replay(
    url: str,
    plan: ReplayPlan,
    *,
    progress: bool,
    timeout: float,
    probe: bool,
    vocab_size: int,
) -> tuple[list[Outcome], Outcome | None, float]:
    import httpx

    endpoint = url.rstrip("/") + "/v1/completions"
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        probe_out = None
        if probe and plan.prompts:
            lengths = sorted(len(p) for p in plan.prompts)
            outs = sorted(plan.max_tokens)
            probe_out = await _probe(
                client,
                endpoint,
                lengths[len(lengths) // 2],
                max(2, min(32, outs[len(outs) // 2])),
                vocab_size,
            )
            if not probe_out.ok:
                raise ReplayError(f"probe request failed: {probe_out.error}")
        bar = Progress(len(plan.prompts), progress)
        outcomes = [
            Outcome(i, len(p), m)
            for i, (p, m) in enumerate(zip(plan.prompts, plan.max_tokens, strict=True))
        ]
        start = time.perf_counter()

        async def one(i: int) -> None:
            delay = plan.arrivals[i] - (time.perf_counter() - start)
            if delay > 0:
                await asyncio.sleep(delay)
            outcomes[i].sent = time.perf_counter() - start
            await _send(client, endpoint, plan.prompts[i], plan.max_tokens[i], outcomes[i])
            bar.update(outcomes[i])

        await asyncio.gather(*(one(i) for i in range(len(outcomes))))
        wall = time.perf_counter() - start
    return outcomes, probe_out, wall


def replay(
    url: str,
    records: Sequence[Any],
    *,
    speed: float = 1.0,
    block_tokens: int = 512,
    scale_input: float | None = None,
    scale_output: float = 1.0,
    max_input: int = 0,
    max_output: int = 0,
    vocab_size: int = 256,
    ttft_mult: float = 10.0,
    tbt_mult: float = 5.0,
    ttft_slo_s: float | None = None,
    tbt_slo_s: float | None = None,
    cost_model: PrefillCostModel | None = None,
    probe: bool = True,
    progress: bool = True,
    timeout: float = 600.0,
    plot_dir: str | None = None,
) -> dict[str, Any]:
    """Replay ``records`` against ``url``; the summary dict (see ``summarize``)."""
    plan = build_plan(
        records,
        speed=speed,
        block_tokens=block_tokens,
        scale_input=scale_input,
        scale_output=scale_output,
        max_input=max_input,
        max_output=max_output,
        vocab_size=vocab_size,
    )
    need_probe = probe and (ttft_slo_s is None or tbt_slo_s is None)
    outcomes, probe_out, wall = asyncio.run(
        _replay(
            url, plan, progress=progress, timeout=timeout, probe=need_probe, vocab_size=vocab_size
        )
    )
    basis = apply_slos(
        outcomes,
        probe_out,
        ttft_mult=ttft_mult,
        tbt_mult=tbt_mult,
        cost_model=cost_model,
        ttft_slo_s=ttft_slo_s,
        tbt_slo_s=tbt_slo_s,
    )
    span = plan.arrivals[-1] - plan.arrivals[0] if len(plan.arrivals) > 1 else 0.0
    result = summarize(outcomes, span, wall)
    result["slo"] = basis
    result["config"] = {
        "url": url,
        "speed": speed,
        "block_tokens": block_tokens,
        "scale_input": scale_input if scale_input is not None else block_tokens / 512,
        "scale_output": scale_output,
        "mean_prompt_tokens": sum(map(len, plan.prompts)) / len(plan.prompts)
        if plan.prompts
        else 0,
        "mean_max_tokens": sum(plan.max_tokens) / len(plan.max_tokens) if plan.max_tokens else 0,
    }
    if plot_dir:
        result["plots"] = plot_cdfs(outcomes, plot_dir)
    return result

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

import argparse
import asyncio
import dataclasses
import json
import math
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

PERCENTILES = (50, 90, 99)


@dataclass
class Outcome:
    """One replayed request."""

    index: int
    prompt_tokens: int
    max_tokens: int
    sent: float = 0.0  # seconds since the replay started
    status: int = 0
    ttft: float | None = None
    gaps: list[float] = field(default_factory=list)
    output_tokens: int = 0
    cached_tokens: int | None = None
    error: str | None = None
    ttft_slo: float = math.inf
    tbt_slo: float = math.inf

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None and self.ttft is not None

    @property
    def rejected(self) -> bool:
        return self.status == 429

    def ttft_ok(self) -> bool:
        return self.ok and self.ttft is not None and self.ttft <= self.ttft_slo

    def tbt_ok(self, percentile: float = 90.0) -> bool:
        if not self.ok:
            return False
        if not self.gaps:
            return True
        return (
            percentile_of(self.gaps, percentile) <= self.tbt_slo
            and sum(self.gaps) / len(self.gaps) <= self.tbt_slo
        )


def percentile_of(values: Sequence[float], p: float) -> float:
    """Nearest-rank percentile (0 for no values)."""
    if not values:
        return 0.0
    xs = sorted(values)
    return xs[min(len(xs) - 1, max(0, math.ceil(p / 100.0 * len(xs)) - 1))]


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
    from kvpool.workload.tokens import tokens_for_request

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
                raise RuntimeError(f"probe request failed: {probe_out.error}")
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


def apply_slos(
    outcomes: Sequence[Outcome],
    probe: Outcome | None,
    *,
    ttft_mult: float,
    tbt_mult: float,
    cost_model: Any = None,
    ttft_slo_s: float | None = None,
    tbt_slo_s: float | None = None,
) -> dict[str, Any]:
    """Fill each outcome's SLOs; returns how they were derived."""
    basis: dict[str, Any] = {"ttft_mult": ttft_mult, "tbt_mult": tbt_mult}
    probe_tbt = percentile_of(probe.gaps, 50) if probe and probe.gaps else None
    if probe is not None:
        basis["probe"] = {
            "prompt_tokens": probe.prompt_tokens,
            "ttft_s": probe.ttft,
            "median_gap_s": probe_tbt,
        }
    for o in outcomes:
        if ttft_slo_s is not None:
            o.ttft_slo = ttft_slo_s
        elif cost_model is not None:
            o.ttft_slo = ttft_mult * cost_model.unloaded_ttft(o.prompt_tokens)
        elif probe is not None and probe.ttft is not None:
            o.ttft_slo = ttft_mult * probe.ttft * max(o.prompt_tokens, 1) / probe.prompt_tokens
        if tbt_slo_s is not None:
            o.tbt_slo = tbt_slo_s
        elif probe_tbt:
            o.tbt_slo = tbt_mult * probe_tbt
    basis["ttft"] = (
        "absolute"
        if ttft_slo_s is not None
        else "cost model"
        if cost_model is not None
        else "probe (linear in prompt length)"
        if probe is not None
        else "none"
    )
    basis["tbt"] = "absolute" if tbt_slo_s is not None else "probe" if probe_tbt else "none"
    return basis


def summarize(outcomes: Sequence[Outcome], span_s: float, wall_s: float) -> dict[str, Any]:
    ok = [o for o in outcomes if o.ok]
    ttfts = [o.ttft for o in ok if o.ttft is not None]
    gaps = [g for o in ok for g in o.gaps]
    good = sum(1 for o in ok if o.ttft_ok() and o.tbt_ok())
    prompt = sum(o.prompt_tokens for o in ok if o.cached_tokens is not None)
    cached = sum(o.cached_tokens or 0 for o in ok if o.cached_tokens is not None)
    span = span_s if span_s > 0 else wall_s
    out: dict[str, Any] = {
        "requests": len(outcomes),
        "completed": len(ok),
        "rejected": sum(1 for o in outcomes if o.rejected),
        "failed": sum(1 for o in outcomes if not o.ok and not o.rejected),
        "ttft_slo_attainment": sum(o.ttft_ok() for o in ok) / len(ok) if ok else 0.0,
        "tbt_slo_attainment": sum(o.tbt_ok() for o in ok) / len(ok) if ok else 0.0,
        "goodput_rps": good / span if span > 0 else 0.0,
        "mean_ttft_s": sum(ttfts) / len(ttfts) if ttfts else 0.0,
        "hit_ratio": cached / prompt if prompt else None,
        "good": good,
        "output_tokens": sum(o.output_tokens for o in ok),
        "duration_s": span_s,
        "wall_s": wall_s,
    }
    for p in PERCENTILES:
        out[f"ttft_p{p}_s"] = percentile_of(ttfts, p)
    for p in PERCENTILES:
        out[f"tbt_p{p}_s"] = percentile_of(gaps, p)
    errors = sorted({o.error for o in outcomes if o.error and not o.rejected})
    if errors:
        out["errors"] = errors[:5]
    return out


def plot_cdfs(outcomes: Sequence[Outcome], directory: str) -> list[str]:
    """``ttft_cdf.png`` and ``tbt_cdf.png`` in ``directory``; returns the paths."""
    try:
        import matplotlib
    except ImportError:
        raise RuntimeError("--plot needs matplotlib: pip install 'kvpool[plot]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(directory, exist_ok=True)
    ok = [o for o in outcomes if o.ok]
    series = {
        "ttft": ([o.ttft for o in ok if o.ttft is not None], "TTFT (s)"),
        "tbt": ([g for o in ok for g in o.gaps], "time between tokens (s)"),
    }
    paths = []
    for name, (values, label) in series.items():
        fig, ax = plt.subplots(figsize=(5, 3.5))
        xs = sorted(values)
        if xs:
            ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post")
        ax.set_xlabel(label)
        ax.set_ylabel("CDF")
        ax.set_ylim(0, 1.01)
        ax.grid(True, alpha=0.3)
        ax.set_title(f"{name.upper()} CDF ({len(xs)} samples)")
        fig.tight_layout()
        path = os.path.join(directory, f"{name}_cdf.png")
        fig.savefig(path, dpi=100)
        plt.close(fig)
        paths.append(path)
    return paths


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
    cost_model: Any = None,
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


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "replay",
        help="replay a trace against a running server (TTFT/TBT, SLOs, goodput)",
        description="Send each trace request at its (scaled) timestamp to an OpenAI-compatible "
        "/v1/completions endpoint, streaming, and report latency percentiles, SLO attainment, "
        "goodput, rejections (429) and the prefix hit ratio.",
    )
    p.add_argument("trace", help="JSON-lines trace (kvpool trace synth)")
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--speed", type=float, default=1.0, help="arrival rate multiplier")
    p.add_argument("--limit", type=int, default=0, help="first N requests only")
    p.add_argument("--block-tokens", type=int, default=512, help="tokens per trace block sent")
    p.add_argument("--trace-block-tokens", type=int, default=512)
    p.add_argument(
        "--scale-input",
        type=float,
        default=None,
        help="prompt length factor (default block-tokens / trace-block-tokens)",
    )
    p.add_argument("--scale-output", type=float, default=1.0, help="reply length factor")
    p.add_argument("--max-input", type=int, default=0, help="cap prompt tokens (0: none)")
    p.add_argument("--max-output", type=int, default=0, help="cap max_tokens (0: none)")
    p.add_argument("--vocab-size", type=int, default=256, help="token ids drawn below this")
    p.add_argument("--ttft-slo", type=float, default=10.0, help="x unloaded TTFT")
    p.add_argument("--tbt-slo", type=float, default=5.0, help="x unloaded TBT")
    p.add_argument("--ttft-slo-s", type=float, default=None, help="absolute TTFT SLO (s)")
    p.add_argument("--tbt-slo-s", type=float, default=None, help="absolute TBT SLO (s)")
    p.add_argument("--cost-model", default=None, help="kvpool calibrate JSON for TTFT SLOs")
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout (s)")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--json", default=None, help="write the summary here")
    p.add_argument("--plot", default=None, metavar="DIR", help="write latency CDF PNGs here")
    p.set_defaults(func=_run_cli)


def _run_cli(args: argparse.Namespace) -> int:
    from kvpool.serve.sched.cost_model import PrefillCostModel
    from kvpool.workload.traces import load_for_command

    records = load_for_command(
        args.trace,
        "replay",
        block_tokens=args.trace_block_tokens,
        limit=args.limit,
        allow_empty=False,
    )
    if records is None:
        return 2
    model = PrefillCostModel.load(args.cost_model) if args.cost_model else None
    try:
        result = replay(
            args.url,
            records,
            speed=args.speed,
            block_tokens=args.block_tokens,
            scale_input=args.scale_input,
            scale_output=args.scale_output,
            max_input=args.max_input,
            max_output=args.max_output,
            vocab_size=args.vocab_size,
            ttft_mult=args.ttft_slo,
            tbt_mult=args.tbt_slo,
            ttft_slo_s=args.ttft_slo_s,
            tbt_slo_s=args.tbt_slo_s,
            cost_model=model,
            progress=not args.no_progress,
            timeout=args.timeout,
            plot_dir=args.plot,
        )
    except (RuntimeError, ValueError) as exc:
        print(f"kvpool replay: {exc}", file=sys.stderr)
        return 1
    text = json.dumps(result, indent=2)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            fh.write(text + "\n")
    print(text)
    return 0

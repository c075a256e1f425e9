"""``kvpool trace synth --profile conversation``: a look-alike of a production chat trace.

The shape it aims at (a public 59-minute conversation trace, 12,031 requests;
the trace itself stays outside the repository so nothing here is fitted to
it request by request): prompt tokens heavy-tailed (mean 12,035, p50 6,909,
p90 27,367, p99 85,399, max 126,195: p90/p50 ~4, p99/p50 ~12, mean/p50
~1.7, i.e. lognormal-like with shape ~1.1); replies light-tailed (mean 343,
p50 350, p90 597); 3.4 requests/s; 76 % of the 512-token blocks used by one
request only while one block is shared by every request; an infinite-cache
prefix-hit ratio over full blocks of 0.38.

How the generator gets that shape (structure, not fitted constants):

- **one preamble block** every prompt starts with (a platform-wide
  instruction), then one of a **few very popular system prompts**
  (``system_prompts``, Zipf ``zipf`` popularity);
- **sessions**: the first prompt carries a heavy-tailed body (lognormal:
  pasted documents, retrieved context); every later turn is the previous
  prompt + the previous reply + a new user message (itself heavy-tailed:
  tool output, another paste), so consecutive turns share every full block
  of the previous prompt. Turns per session are geometric with a small mean,
  as in chat services (most sessions are one or two turns), which is why
  most blocks are used once and the infinite-cache hit ratio stays far
  below the multi-turn share;
- **non-IID think times**: each session has its own pace (a lognormal
  multiplier, some users are fast, some leave for minutes), successive
  think times are correlated (an AR(1) process in log space) and grow with
  the reply the user reads;
- sessions start as a Poisson process whose rate gives ``rate`` requests per
  second overall; a session whose context would pass ``max_input_tokens``
  ends (the model's window).

``shape_stats`` measures the quantities above on any trace (``kvpool trace
stats`` prints them), and ``tests/test_conversation_profile.py`` checks
their shape on a generated trace.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvpool.workload.traces import DEFAULT_BLOCK_TOKENS, TraceRecord


@dataclass
class ConversationConfig:
    """Knobs of the conversation profile (token counts: lognormal medians and shapes)."""

    requests: int = 2000
    seed: int = 0
    rate: float = 3.4  # requests per second
    mean_turns: float = 1.4  # geometric turns per session
    system_prompts: int = 6
    zipf: float = 1.3
    system_blocks: tuple[int, int] = (2, 6)  # range of system prompt lengths, in blocks
    first_median: float = 4000.0  # first prompt's own body (after the system prompt)
    first_sigma: float = 1.3
    user_median: float = 1500.0  # a later turn's new user message
    user_sigma: float = 1.8
    reply_mean: float = 345.0  # truncated normal replies
    reply_sd: float = 200.0
    think_median_s: float = 40.0
    pace_sigma: float = 1.0  # per-session pace multiplier (lognormal shape)
    think_sigma: float = 0.6  # within-session noise (lognormal shape)
    think_rho: float = 0.6  # AR(1) correlation of successive think times (log space)
    read_tokens_per_s: float = 20.0  # reading the reply adds reply / this seconds
    max_input_tokens: int = 128_000
    block_tokens: int = DEFAULT_BLOCK_TOKENS

    def validate(self) -> None:
        if self.requests < 0:
            raise ValueError("requests must be >= 0")
        if self.rate <= 0:
            raise ValueError("rate must be > 0")
        if self.mean_turns < 1:
            raise ValueError("mean_turns must be >= 1")
        if self.system_prompts < 1:
            raise ValueError("system_prompts must be >= 1")
        lo, hi = self.system_blocks
        if not 1 <= lo <= hi:
            raise ValueError("system_blocks must be 1 <= low <= high")
        if not -1.0 < self.think_rho < 1.0:
            raise ValueError("think_rho must be in (-1, 1)")
        if self.block_tokens < 1 or self.max_input_tokens < (hi + 2) * self.block_tokens:
            raise ValueError("max_input_tokens must hold the system prompt and a turn")


def _lognormal(g: np.random.Generator, median: float, sigma: float) -> int:
    return round(median * math.exp(sigma * float(g.standard_normal())))


def conversation_trace(
    config: ConversationConfig | None = None, **overrides: Any
) -> list[TraceRecord]:
    """A deterministic look-alike trace (same config => identical records), sorted by time."""
    cfg = config if config is not None else ConversationConfig()
    if overrides:
        cfg = ConversationConfig(**{**cfg.__dict__, **overrides})
    cfg.validate()
    n, bt = cfg.requests, cfg.block_tokens
    if n == 0:
        return []
    sys_rng, sess_rng, arr_rng = (np.random.default_rng([cfg.seed, 7, i]) for i in range(3))
    next_id = 1  # id 0: the preamble block every prompt starts with

    def take(k: int) -> list[int]:
        nonlocal next_id
        out = list(range(next_id, next_id + k))
        next_id += k
        return out

    lo, hi = cfg.system_blocks
    sys_ids = [[0, *take(int(sys_rng.integers(lo, hi + 1)) - 1)] for _ in range(cfg.system_prompts)]
    weights = 1.0 / np.arange(1, cfg.system_prompts + 1, dtype=float) ** cfg.zipf
    weights /= weights.sum()

    def reply(g: np.random.Generator) -> int:
        while True:
            v = round(g.normal(cfg.reply_mean, cfg.reply_sd))
            if v >= 1:
                return int(v)

    horizon = n / cfg.rate
    session_rate = cfg.rate / cfg.mean_turns
    warmup = 20.0 * cfg.think_median_s * cfg.mean_turns
    events: list[tuple[float, int, TraceRecord]] = []
    t = -warmup
    while True:
        t += float(arr_rng.exponential(1.0 / session_rate))
        if t >= horizon and sum(1 for e in events if e[0] < t) >= n:
            break  # every later session starts after the first n requests
        g = sess_rng
        k = int(g.choice(cfg.system_prompts, p=weights))
        ids = list(sys_ids[k])
        tokens = len(ids) * bt + _lognormal(g, cfg.first_median, cfg.first_sigma)
        pace = math.exp(cfg.pace_sigma * g.standard_normal())
        z = float(g.standard_normal())
        now = t
        for _turn in range(int(g.geometric(1.0 / cfg.mean_turns))):
            if tokens > cfg.max_input_tokens:
                break
            need = -(-tokens // bt)
            if need > len(ids):
                ids += take(need - len(ids))
            out = reply(g)
            if now >= 0:
                events.append(
                    (
                        now,
                        len(events),
                        TraceRecord(round(now * 1000), tokens, out, tuple(ids[:need])),
                    )
                )
            # the next prompt: the whole reply and a new user message after this one;
            # the partial tail block is rewritten (a fresh id), full blocks are kept
            ids = ids[: tokens // bt]
            tokens += out + _lognormal(g, cfg.user_median, cfg.user_sigma)
            z = cfg.think_rho * z + math.sqrt(1 - cfg.think_rho**2) * float(g.standard_normal())
            think = cfg.think_median_s * pace * math.exp(cfg.think_sigma * z)
            now += out / cfg.read_tokens_per_s + think
    events.sort(key=lambda e: (e[0], e[1]))
    return [rec for _t, _s, rec in events[:n]]


def shape_stats(
    records: Sequence[TraceRecord], block_tokens: int = DEFAULT_BLOCK_TOKENS
) -> dict[str, Any]:
    """The quantities the profile aims at, on any trace.

    Blocks are prefixes (block ``j`` of a request is its first ``j + 1`` ids;
    equal ids at equal positions after an equal prefix are the same block):
    ``single_use_block_share`` is the share of distinct full blocks that one
    request only uses, ``max_block_share`` the share of requests using the
    most used block, ``infinite_hit_ratio`` the full blocks found in an
    infinite cache over all full blocks.
    """
    n = len(records)
    if n == 0:
        return {"requests": 0}
    node: dict[tuple[int, int], int] = {}
    uses: list[int] = []
    total = 0
    for rec in records:
        parent = -1
        for j in range(rec.input_length // block_tokens):
            key = (parent, rec.hash_ids[j])
            idx = node.get(key)
            if idx is None:
                idx = node[key] = len(uses)
                uses.append(0)
            uses[idx] += 1
            parent = idx
            total += 1
    prompts = np.array([r.input_length for r in records], dtype=float)
    outs = np.array([r.output_length for r in records], dtype=float)
    span = (records[-1].timestamp - records[0].timestamp) / 1000.0

    def q(a: np.ndarray, p: float) -> float:
        return float(np.percentile(a, p))

    return {
        "requests": n,
        "rate_rps": n / span if span > 0 else 0.0,
        "prompt_mean": float(prompts.mean()),
        "prompt_p50": q(prompts, 50),
        "prompt_p90": q(prompts, 90),
        "prompt_p99": q(prompts, 99),
        "prompt_max": float(prompts.max()),
        "output_mean": float(outs.mean()),
        "output_p50": q(outs, 50),
        "output_p90": q(outs, 90),
        "blocks": total,
        "unique_blocks": len(uses),
        "single_use_block_share": sum(1 for u in uses if u == 1) / len(uses) if uses else 0.0,
        "max_block_share": max(uses, default=0) / n,
        "infinite_hit_ratio": (total - len(uses)) / total if total else 0.0,
    }

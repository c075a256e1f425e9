"""``kvpool trace synth --profile conversation``: a look-alike of a production chat trace.

The shape it aims at (a public 59-minute conversation trace, 12,031 requests;
the trace itself stays outside the repository so nothing here is fitted to
it request by request): prompt tokens heavy-tailed (mean 12,035, p50 6,909,
p90 27,367, p99 85,399, max 126,195: p90/p50 ~4, p99/p50 ~12, mean/p50
~1.7, i.e. lognormal-like with shape ~1.1); replies light-tailed (mean 343,
p50 350, p90 597); 3.4 requests/s; 76 % of the 512-token blocks used by one
request only while one block is shared by every request; an infinite-cache
prefix-hit ratio over full blocks of 0.38; at 5,000 blocks LRU reaches
0.34x Belady's hit ratio and the best online policy 0.41x (reuse distances
long enough that recency guesses badly).

How the generator gets that shape (structure, not fitted constants):

- **one preamble block** every prompt starts with (a platform-wide
  instruction), then one of **many system prompts** with Zipf popularity
  (``system_prompts``, ``zipf``), all short (``system_blocks``): a popular
  prefix is a small share of a prompt, the user's own content dominates;
- **sessions**: the first prompt carries a heavy-tailed body (lognormal:
  pasted documents, retrieved context); every later turn is the previous
  prompt + the previous reply + a new user message (itself heavy-tailed:
  tool output, another paste), so consecutive turns share every full block
  of the previous prompt. Turns per session follow a **power law**
  (``P(T >= k) = k^-a``, mean ``mean_turns``): most sessions are one or
  two turns, a few run long; a session whose context would pass
  ``max_input_tokens`` ends (the model's window);
- **think times from what the user does**, not a fixed mean: reading the
  reply (``read_tokens_per_s``), then working on the next message for a
  time that grows with the context (``think_median_s`` at
  ``think_ref_tokens``, times ``(context / ref) ** think_length_exp``:
  someone working through a 60k-token document takes longer per turn than
  someone chatting), scaled by a per-session pace (lognormal) and an AR(1)
  noise in log space (non-IID: successive gaps correlate); after a turn
  the user leaves with probability ``break_prob`` for a heavy-tailed break
  (``break_median_s``). Sessions therefore last minutes to an hour and
  thousands of other requests' blocks pass between two turns of one
  session: reuse distances mostly exceed a few thousand blocks, which is
  what makes recency (LRU) a poor guess of the next reuse on such traces;
- sessions start as a Poisson process (from ``warmup_s`` before the
  window, so it opens on sessions already under way) whose rate gives
  ``rate`` requests per second from the turns sessions actually have.

Reuse distances scale with the request rate: the same trace at rate ``r / k``
with ``k`` times fewer requests covers the same hour and has the same cache
behaviour at ``capacity / k`` blocks (tests use this to stay fast).

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

MAX_TURNS = 200  # a session's turn count is capped here (a power law's far tail)


@dataclass
class ConversationConfig:
    """Knobs of the conversation profile (token counts: lognormal medians and shapes)."""

    requests: int = 2000
    seed: int = 0
    rate: float = 3.4  # requests per second
    mean_turns: float = 1.6  # power-law turns per session (P(T >= k) = k^-a)
    system_prompts: int = 20
    zipf: float = 1.1
    system_blocks: tuple[int, int] = (1, 2)  # range of system prompt lengths, in blocks
    first_median: float = 4000.0  # first prompt's own body (after the system prompt)
    first_sigma: float = 1.2
    user_median: float = 1500.0  # a later turn's new user message
    user_sigma: float = 1.5
    reply_mean: float = 345.0  # truncated normal replies
    reply_sd: float = 200.0
    read_tokens_per_s: float = 5.0  # reading the reply: ~250 words a minute
    think_median_s: float = 60.0  # working on the next message, at think_ref_tokens of context
    think_ref_tokens: float = 8000.0
    think_length_exp: float = 0.5  # ... which grows as context ** this (longer work, longer gaps)
    pace_sigma: float = 1.0  # per-session pace multiplier (lognormal shape)
    think_sigma: float = 0.6  # within-session noise (lognormal shape)
    think_rho: float = 0.6  # AR(1) correlation of successive think times (log space)
    break_prob: float = 0.3  # after a turn the user leaves for a while ...
    break_median_s: float = 600.0  # ... a lognormal break (meetings, other work)
    break_sigma: float = 1.0
    warmup_s: float = 3600.0  # sessions start this long before the window (steady state)
    max_input_tokens: int = 128_000
    block_tokens: int = DEFAULT_BLOCK_TOKENS

    def validate(self) -> None:
        if self.requests < 0:
            raise ValueError("requests must be >= 0")
        if self.rate <= 0:
            raise ValueError("rate must be > 0")
        if not 1 <= self.mean_turns < MAX_TURNS:
            raise ValueError(f"mean_turns must be in [1, {MAX_TURNS})")
        if self.read_tokens_per_s <= 0 or self.think_median_s < 0 or self.think_ref_tokens <= 0:
            raise ValueError(
                "read_tokens_per_s and think_ref_tokens must be > 0, think_median_s >= 0"
            )
        if not 0.0 <= self.break_prob <= 1.0:
            raise ValueError("break_prob must be in [0, 1]")
        if self.warmup_s < 0:
            raise ValueError("warmup_s must be >= 0")
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


def power_alpha(mean: float, cap: int = MAX_TURNS) -> float:
    """The tail index ``a`` of the turn count ``T = min(cap, floor(U ** (-1/a)))``
    (``P(T >= k) = k ** -a``, U uniform on (0, 1]) whose mean is ``mean``.

    ``E[T] = sum_{k=1..cap} k ** -a`` decreases in ``a``, so bisection finds it;
    ``mean`` must be in [1, cap).
    """
    if not 1.0 <= mean < cap:
        raise ValueError(f"mean turns must be in [1, {cap})")
    ks = np.arange(1, cap + 1, dtype=float)
    lo, hi = 1e-6, 60.0
    for _ in range(80):
        mid = (lo + hi) / 2
        if float((ks**-mid).sum()) > mean:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


# one session: (seconds after its start, prompt tokens, reply tokens, block ids)
_Turn = tuple[float, int, int, tuple[int, ...]]


class _Sessions:
    """Session templates drawn in order from one generator (so a session's content
    does not depend on when it starts); block ids are handed out as drawn."""

    def __init__(self, cfg: ConversationConfig) -> None:
        self.cfg = cfg
        sys_rng = np.random.default_rng([cfg.seed, 7, 0])
        self.g = np.random.default_rng([cfg.seed, 7, 1])
        self.next_id = 1  # id 0: the preamble block every prompt starts with
        lo, hi = cfg.system_blocks
        self.sys_ids = [
            [0, *self._take(int(sys_rng.integers(lo, hi + 1)) - 1)]
            for _ in range(cfg.system_prompts)
        ]
        weights = 1.0 / np.arange(1, cfg.system_prompts + 1, dtype=float) ** cfg.zipf
        self.weights = weights / weights.sum()
        self.alpha = power_alpha(cfg.mean_turns)
        self.drawn: list[list[_Turn]] = []

    def _take(self, k: int) -> list[int]:
        out = list(range(self.next_id, self.next_id + k))
        self.next_id += k
        return out

    def __getitem__(self, i: int) -> list[_Turn]:
        while len(self.drawn) <= i:
            self.drawn.append(self._draw())
        return self.drawn[i]

    def _reply(self) -> int:
        while True:
            v = round(self.g.normal(self.cfg.reply_mean, self.cfg.reply_sd))
            if v >= 1:
                return int(v)

    def _draw(self) -> list[_Turn]:
        cfg, g, bt = self.cfg, self.g, self.cfg.block_tokens
        ids = list(self.sys_ids[int(g.choice(cfg.system_prompts, p=self.weights))])
        tokens = len(ids) * bt + _lognormal(g, cfg.first_median, cfg.first_sigma)
        pace = math.exp(cfg.pace_sigma * float(g.standard_normal()))
        z = float(g.standard_normal())
        turns = min(MAX_TURNS, int(float(1.0 - g.random()) ** (-1.0 / self.alpha)))
        now = 0.0
        out: list[_Turn] = []
        for _turn in range(turns):
            if tokens > cfg.max_input_tokens:
                break  # the context window is full: the user starts over elsewhere
            need = -(-tokens // bt)
            if need > len(ids):
                ids += self._take(need - len(ids))
            reply = self._reply()
            out.append((now, tokens, reply, tuple(ids[:need])))
            # the next prompt: the whole reply and a new user message after this one;
            # the partial tail block is rewritten (a fresh id), full blocks are kept
            ids = ids[: tokens // bt]
            tokens += reply + _lognormal(g, cfg.user_median, cfg.user_sigma)
            z = cfg.think_rho * z + math.sqrt(1 - cfg.think_rho**2) * float(g.standard_normal())
            work = cfg.think_median_s * (tokens / cfg.think_ref_tokens) ** cfg.think_length_exp
            gap = (reply / cfg.read_tokens_per_s + work) * pace * math.exp(cfg.think_sigma * z)
            if g.random() < cfg.break_prob:
                gap += cfg.break_median_s * math.exp(cfg.break_sigma * float(g.standard_normal()))
            now += gap
        return out


def conversation_trace(
    config: ConversationConfig | None = None, **overrides: Any
) -> list[TraceRecord]:
    """A deterministic look-alike trace (same config => identical records), sorted by time.

    Sessions start as a Poisson process from ``warmup_s`` before the first
    recorded request (so the window opens on a steady state: sessions already
    under way), at ``rate / realised turns per session`` (turns cut short by
    the context window are not counted, so the request rate is ``rate``).
    """
    cfg = config if config is not None else ConversationConfig()
    if overrides:
        cfg = ConversationConfig(**{**cfg.__dict__, **overrides})
    cfg.validate()
    n = cfg.requests
    if n == 0:
        return []
    sessions = _Sessions(cfg)
    drawn = turns = 0
    while turns < n:  # the realised turns per session, from the sessions to be used
        turns += len(sessions[drawn])
        drawn += 1
    session_rate = cfg.rate * drawn / turns
    arr_rng = np.random.default_rng([cfg.seed, 7, 2])
    horizon = n / cfg.rate
    events: list[tuple[float, int, TraceRecord]] = []
    t = -cfg.warmup_s
    i = 0
    while True:
        t += float(arr_rng.exponential(1.0 / session_rate))
        if t >= horizon and sum(1 for e in events if e[0] < t) >= n:
            break  # every later session starts after the first n requests
        for offset, tokens, reply, ids in sessions[i]:
            at = t + offset
            if at >= 0:
                rec = TraceRecord(round(at * 1000), tokens, reply, ids)
                events.append((at, len(events), rec))
        i += 1
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

"""A seeded, deterministic generator of chat-shaped traces (``kvpool trace synth``).

``synthesize`` builds a trace with the structure of chat traffic: shared
system prompts with Zipf popularity, multi-turn sessions whose next prompt
is the previous prompt + the previous reply + a new user turn, and one-off
long documents; session starts and documents arrive as Poisson processes,
a session's next turn follows an exponential think time (lognormal,
heavy-tailed by default) after the previous one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvpool.workload.traces import DEFAULT_BLOCK_TOKENS, TraceRecord


@dataclass
class SynthConfig:
    """Knobs of the synthetic generator (token counts are lognormal medians).

    ``sessions`` (if set) fixes the number of chat sessions; otherwise it is
    derived from ``mean_turns`` so that about ``1 - doc_fraction`` of the
    requests are session turns.
    """

    requests: int = 2000
    seed: int = 0
    rate: float = 4.0  # mean requests per second
    doc_fraction: float = 0.1  # share of requests that are one-off documents
    sessions: int | None = None
    mean_turns: float = 8.0  # geometric, >= 1
    think_time_s: float = 60.0  # mean gap between a reply and the next turn
    think_sigma: float = 1.0  # > 0: lognormal think times of this shape; 0: exponential
    system_prompts: int = 64
    zipf: float = 1.1  # popularity exponent over system prompts
    system_tokens: int = 1500
    user_tokens: int = 400
    reply_tokens: int = 400
    doc_tokens: int = 6000
    max_input_tokens: int = 32768  # a session ends before exceeding this
    block_tokens: int = DEFAULT_BLOCK_TOKENS
    sigma: float = 0.8  # lognormal shape for every length

    def validate(self) -> None:
        if self.requests < 0:
            raise ValueError("requests must be >= 0")
        if self.rate <= 0:
            raise ValueError("rate must be > 0")
        if not 0.0 <= self.doc_fraction <= 1.0:
            raise ValueError("doc_fraction must be in [0, 1]")
        if self.sessions is not None and self.sessions < 1:
            raise ValueError("sessions must be >= 1")
        if self.mean_turns < 1:
            raise ValueError("mean_turns must be >= 1")
        if not (self.think_time_s >= 0 and self.think_sigma >= 0):  # also refuses nan
            raise ValueError("think_time_s and think_sigma must be >= 0")
        if self.system_prompts < 1:
            raise ValueError("system_prompts must be >= 1")
        if self.block_tokens < 1 or self.max_input_tokens < self.block_tokens:
            raise ValueError("need block_tokens >= 1 and max_input_tokens >= block_tokens")


class _Ids:
    """Allocates fresh hash ids in order."""

    def __init__(self) -> None:
        self.next = 0

    def take(self, n: int) -> list[int]:
        start = self.next
        self.next += n
        return list(range(start, start + n))


def synthesize(config: SynthConfig | None = None, **overrides: Any) -> list[TraceRecord]:
    """A deterministic synthetic trace (same config => identical records).

    Structure: ``system_prompts`` shared prefixes chosen with Zipf(``zipf``)
    popularity; chat sessions (geometric number of turns, each prompt =
    previous prompt + previous reply + new user turn, so consecutive turns
    share every full block of the previous prompt); one-off documents (a
    system prompt plus a long unique body). Records are sorted by timestamp.
    """
    cfg = config if config is not None else SynthConfig()
    if overrides:
        cfg = SynthConfig(**{**cfg.__dict__, **overrides})
    cfg.validate()
    n = cfg.requests
    if n == 0:
        return []
    bt = cfg.block_tokens
    ids = _Ids()
    # Independent streams: system prompts, sessions, documents.
    sys_rng, sess_rng, doc_rng = (np.random.default_rng([cfg.seed, i]) for i in range(3))

    def length(g: np.random.Generator, median: float, lo: int, hi: int) -> int:
        return int(np.clip(round(median * math.exp(cfg.sigma * g.standard_normal())), lo, hi))

    def think(g: np.random.Generator) -> float:
        if cfg.think_sigma <= 0 or cfg.think_time_s == 0:  # (0: every think time is 0)
            return float(g.exponential(cfg.think_time_s))
        mu = math.log(cfg.think_time_s) - cfg.think_sigma**2 / 2  # mean = think_time_s
        return float(g.lognormal(mu, cfg.think_sigma))

    # System prompts: only their full blocks are shareable.
    sys_len = [
        length(sys_rng, cfg.system_tokens, 64, 8 * cfg.system_tokens)
        for _ in range(cfg.system_prompts)
    ]
    sys_ids = [ids.take(L // bt) for L in sys_len]
    weights = 1.0 / np.arange(1, cfg.system_prompts + 1, dtype=float) ** cfg.zipf
    weights /= weights.sum()

    mean_turns = cfg.mean_turns
    if cfg.sessions is not None:
        mean_turns = max(1.0, n * (1.0 - cfg.doc_fraction) / cfg.sessions)
    session_rate = cfg.rate * (1.0 - cfg.doc_fraction) / mean_turns
    doc_rate = cfg.rate * cfg.doc_fraction
    # The trace is a window of steady traffic: sessions start before t = 0
    # (their earlier turns are not in the trace) so the window opens with the
    # steady-state mix of session ages.
    warmup_s = 4.0 * mean_turns * (cfg.think_time_s + 0.02 * cfg.reply_tokens)
    horizon_s = n / cfg.rate
    events: list[tuple[float, int, TraceRecord]] = []

    def emit(t: float, rec: TraceRecord) -> None:
        events.append((t, len(events), rec))

    def session(start: float) -> None:
        g = sess_rng
        turns = int(g.geometric(1.0 / mean_turns))
        k = int(g.choice(cfg.system_prompts, p=weights))
        stream_ids = list(sys_ids[k])  # ids of the session's token-stream blocks
        stream = sys_len[k]  # tokens so far
        now = start
        for _turn in range(turns):
            stream += length(g, cfg.user_tokens, 8, 16 * cfg.user_tokens)
            if stream > cfg.max_input_tokens:
                break
            need = -(-stream // bt)
            if need > len(stream_ids):
                stream_ids += ids.take(need - len(stream_ids))
            reply = length(g, cfg.reply_tokens, 1, 16 * cfg.reply_tokens)
            if now >= 0:
                emit(now, TraceRecord(round(now * 1000), stream, reply, tuple(stream_ids[:need])))
            stream += reply
            # Next turn: the reply streams (~20 ms/token), then the user thinks.
            now += reply * 0.02 + think(g)

    def document(t: float) -> None:
        g = doc_rng
        k = int(g.choice(cfg.system_prompts, p=weights))
        body = length(g, cfg.doc_tokens, bt, 16 * cfg.doc_tokens)
        total = min(sys_len[k] + body, cfg.max_input_tokens)
        need = -(-total // bt)
        own = sys_ids[k][:need]
        doc_ids = own + ids.take(need - len(own))
        reply = length(g, cfg.reply_tokens, 1, 16 * cfg.reply_tokens)
        emit(t, TraceRecord(round(t * 1000), total, reply, tuple(doc_ids)))

    # Generate in windows until n requests lie before the window's end: any
    # later session or document starts after it, so the first n are final.
    next_session = (
        -warmup_s + float(sess_rng.exponential(1.0 / session_rate)) if session_rate else math.inf
    )
    next_doc = float(doc_rng.exponential(1.0 / doc_rate)) if doc_rate else math.inf
    end = horizon_s
    while True:
        while next_session < end:
            session(next_session)
            next_session += float(sess_rng.exponential(1.0 / session_rate))
        while next_doc < end:
            document(next_doc)
            next_doc += float(doc_rng.exponential(1.0 / doc_rate))
        if sum(1 for e in events if e[0] < end) >= n:
            break
        if end > 100 * horizon_s + 1e6:
            raise ValueError("the configuration produces too few requests (check the lengths)")
        end += horizon_s
    events.sort(key=lambda e: (e[0], e[1]))
    return [rec for _t, _s, rec in events[:n]]

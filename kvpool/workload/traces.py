"""Request traces: JSON-lines I/O, validation, token synthesis and a generator.

A trace is one JSON object per line::

    {"timestamp": 27482, "input_length": 6955, "output_length": 52, "hash_ids": [46, 47, ...]}

``timestamp`` is the arrival time in milliseconds, ``input_length`` and
``output_length`` count tokens, and ``hash_ids[i]`` names the i-th block of
``block_tokens`` (512) prompt tokens: equal ids at equal positions mean an
equal prefix. The last id names the (possibly partial) block holding the
prompt's tail, so ``len(hash_ids) == ceil(input_length / block_tokens)``.

``tokens_for_request`` turns a record into concrete token ids (same id =>
same block of tokens; the last block is cut to ``input_length``), so the
pool's own chained hashing (``kvpool.index.keys.block_keys``) reproduces the
trace's sharing exactly: two records that share their first k full blocks'
ids get exactly k equal leading block keys.

``synthesize`` builds a seeded, deterministic trace with the structure of
chat traffic: shared system prompts with Zipf popularity, multi-turn
sessions whose next prompt is the previous prompt + the previous reply + a
new user turn, and one-off long documents; session starts and documents
arrive as Poisson processes, a session's next turn follows an exponential
think time (lognormal, heavy-tailed by default) after the previous one.
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import IO, Any

import numpy as np

DEFAULT_BLOCK_TOKENS = 512
DEFAULT_VOCAB_SIZE = 32000
_MAX_HASH_ID = 2**64 - 1
_FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")


class TraceError(ValueError):
    """A trace line is malformed; ``line`` is its 1-based line number."""

    def __init__(self, message: str, line: int | None = None, source: str | None = None) -> None:
        where = ""
        if source is not None:
            where += f"{source}:"
        if line is not None:
            where += f"line {line}: "
        elif where:
            where += " "
        super().__init__(where + message)
        self.line = line
        self.source = source


@dataclass(frozen=True, slots=True)
class TraceRecord:
    """One request: arrival time (ms), prompt/reply lengths (tokens), block ids."""

    timestamp: int | float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]

    def to_dict(self) -> dict[str, Any]:
        return {
            "timestamp": self.timestamp,
            "input_length": self.input_length,
            "output_length": self.output_length,
            "hash_ids": list(self.hash_ids),
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), separators=(", ", ": "))


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def parse_record(
    obj: Any, block_tokens: int | None = DEFAULT_BLOCK_TOKENS, line: int | None = None
) -> TraceRecord:
    """Validate one decoded JSON object and build a ``TraceRecord``.

    With ``block_tokens`` set, also checks that the number of block ids
    matches ``ceil(input_length / block_tokens)``; pass None to skip that.
    Raises ``TraceError`` naming the field and (if given) the line.
    """
    if not isinstance(obj, Mapping):
        raise TraceError(f"expected a JSON object, got {type(obj).__name__}", line)
    missing = [name for name in _FIELDS if name not in obj]
    if missing:
        raise TraceError(f"missing field(s) {', '.join(map(repr, missing))}", line)
    ts = obj["timestamp"]
    if not isinstance(ts, int | float) or isinstance(ts, bool) or not math.isfinite(ts) or ts < 0:
        raise TraceError(f"'timestamp' must be a non-negative number (ms), got {ts!r}", line)
    for name in ("input_length", "output_length"):
        value = obj[name]
        if not _is_int(value) or value < 0:
            raise TraceError(f"{name!r} must be a non-negative integer, got {value!r}", line)
    ids = obj["hash_ids"]
    if not isinstance(ids, list):
        raise TraceError(f"'hash_ids' must be a list of integers, got {type(ids).__name__}", line)
    for pos, hid in enumerate(ids):
        if not _is_int(hid) or not 0 <= hid <= _MAX_HASH_ID:
            raise TraceError(
                f"'hash_ids'[{pos}] must be an integer in [0, 2**64), got {hid!r}", line
            )
    n_in = obj["input_length"]
    if block_tokens is not None:
        want = -(-n_in // block_tokens)
        if len(ids) != want:
            raise TraceError(
                f"input_length {n_in} needs {want} block id(s) of {block_tokens} tokens, "
                f"got {len(ids)} hash_ids",
                line,
            )
    return TraceRecord(
        timestamp=ts, input_length=n_in, output_length=obj["output_length"], hash_ids=tuple(ids)
    )


def iter_trace(
    source: str | os.PathLike[str] | IO[str],
    block_tokens: int | None = DEFAULT_BLOCK_TOKENS,
) -> Iterator[TraceRecord]:
    """Yield validated records from a JSON-lines file (path or open text file).

    Blank lines are skipped; any other bad line raises ``TraceError`` with
    its 1-based line number.
    """
    if isinstance(source, str | os.PathLike):
        name = os.fspath(source)
        with open(source, encoding="utf-8") as fh:
            yield from _iter_lines(fh, block_tokens, name)
    else:
        yield from _iter_lines(source, block_tokens, getattr(source, "name", None))


def _iter_lines(
    fh: Iterable[str], block_tokens: int | None, name: str | None
) -> Iterator[TraceRecord]:
    for lineno, text in enumerate(fh, start=1):
        if not text.strip():
            continue
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as exc:
            raise TraceError(
                f"invalid JSON: {exc.msg} (column {exc.colno})", lineno, name
            ) from None
        try:
            yield parse_record(obj, block_tokens)
        except TraceError as exc:
            raise TraceError(str(exc), lineno, name) from None


def load_trace(
    source: str | os.PathLike[str] | IO[str],
    block_tokens: int | None = DEFAULT_BLOCK_TOKENS,
) -> list[TraceRecord]:
    """All records of a trace file, validated (see ``iter_trace``)."""
    return list(iter_trace(source, block_tokens))


def load_for_command(
    source: str | os.PathLike[str],
    command: str,
    *,
    block_tokens: int | None = DEFAULT_BLOCK_TOKENS,
    limit: int = 0,
    allow_empty: bool = True,
) -> list[TraceRecord] | None:
    """A trace for a ``kvpool`` subcommand: the first ``limit`` records (0: all), or
    None after printing ``kvpool COMMAND: why`` (unreadable, malformed, or empty when
    ``allow_empty`` is False) to stderr; commands then exit with status 2."""
    try:
        records = load_trace(source, block_tokens)
    except (OSError, TraceError) as exc:
        print(f"kvpool {command}: {exc}", file=sys.stderr)
        return None
    records = records[:limit] if limit else records
    if not records and not allow_empty:
        print(f"kvpool {command}: the trace is empty", file=sys.stderr)
        return None
    return records


def write_trace(
    records: Iterable[TraceRecord | Mapping[str, Any]],
    dest: str | os.PathLike[str] | IO[str],
) -> int:
    """Write records as JSON lines; returns the number written."""
    if isinstance(dest, str | os.PathLike):
        with open(dest, "w", encoding="utf-8") as fh:
            return write_trace(records, fh)
    count = 0
    for rec in records:
        if not isinstance(rec, TraceRecord):
            rec = parse_record(rec, block_tokens=None)
        dest.write(rec.to_json())
        dest.write("\n")
        count += 1
    return count


# -- tokens -----------------------------------------------------------------


def _digits_needed(vocab_size: int) -> int:
    n, span = 0, 1
    while span <= _MAX_HASH_ID:
        span *= vocab_size
        n += 1
    return n


def block_tokens_for_ids(
    hash_ids: Iterable[int],
    block_tokens: int = DEFAULT_BLOCK_TOKENS,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
) -> np.ndarray:
    """A (len(ids), block_tokens) int32 array: the token block named by each id.

    Row i depends only on ``hash_ids[i]``: its first few tokens are the id's
    digits in base ``vocab_size`` (so distinct ids always give distinct
    blocks) and the rest is a splitmix64 stream seeded by the id. All tokens
    lie in ``[0, vocab_size)``.
    """
    if vocab_size < 2:
        raise ValueError(f"vocab_size must be >= 2, got {vocab_size}")
    digits = _digits_needed(vocab_size)
    if block_tokens < digits:
        raise ValueError(
            f"block_tokens={block_tokens} is too small to name 64-bit ids with a "
            f"vocabulary of {vocab_size} (needs >= {digits})"
        )
    ids = np.fromiter((int(h) for h in hash_ids), dtype=np.uint64)
    pos = np.arange(block_tokens, dtype=np.uint64)
    z = ids[:, None] * np.uint64(0x9E3779B97F4A7C15) + (pos[None, :] + np.uint64(1)) * np.uint64(
        0xD1B54A32D192ED03
    )
    z ^= z >> np.uint64(30)
    z *= np.uint64(0xBF58476D1CE4E5B9)
    z ^= z >> np.uint64(27)
    z *= np.uint64(0x94D049BB133111EB)
    z ^= z >> np.uint64(31)
    out = (z % np.uint64(vocab_size)).astype(np.int32)
    rest = ids.copy()
    v = np.uint64(vocab_size)
    for j in range(digits):
        out[:, j] = (rest % v).astype(np.int32)
        rest //= v
    return out


def tokens_for_request(
    record: TraceRecord | Mapping[str, Any],
    block_tokens: int = DEFAULT_BLOCK_TOKENS,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
) -> np.ndarray:
    """The prompt's token ids (int32, length ``input_length``) for a record.

    Block i is ``block_tokens_for_ids([hash_ids[i]])``; the last block is cut
    so the prompt has exactly ``input_length`` tokens. Same id => same
    tokens, so ``block_keys`` over the result shares exactly the full blocks
    whose leading ids are shared.
    """
    if not isinstance(record, TraceRecord):
        record = parse_record(record, block_tokens=None)
    n_in = record.input_length
    capacity = len(record.hash_ids) * block_tokens
    if n_in > capacity:
        raise ValueError(
            f"input_length {n_in} exceeds {len(record.hash_ids)} block(s) of {block_tokens} tokens"
        )
    if n_in == 0:
        return np.empty(0, dtype=np.int32)
    need = -(-n_in // block_tokens)
    blocks = block_tokens_for_ids(record.hash_ids[:need], block_tokens, vocab_size)
    return blocks.reshape(-1)[:n_in]


# -- synthesis --------------------------------------------------------------


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
        if cfg.think_sigma <= 0:
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

"""Request traces: the JSON-lines format, its validation, reading and writing.

A trace is one JSON object per line::

    {"timestamp": 27482, "input_length": 6955, "output_length": 52, "hash_ids": [46, 47, ...]}

``timestamp`` is the arrival time in milliseconds, ``input_length`` and
``output_length`` count tokens, and ``hash_ids[i]`` names the i-th block of
``block_tokens`` (512) prompt tokens: equal ids at equal positions mean an
equal prefix. The last id names the (possibly partial) block holding the
prompt's tail, so ``len(hash_ids) == ceil(input_length / block_tokens)``.

Token ids for a record: ``kvpool.workload.tokens``; a seeded generator of
chat-shaped traces: ``kvpool.workload.synth``.
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import IO, Any

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

"""The connector's counters: per interval for vLLM's metrics, cumulative per process.

``Counters`` is plain data (vLLM ships it from workers to its logger): hit
tokens, bytes and blocks loaded/saved, time the transfers took and the time
the forward pass actually waited for them, so the layer-wise overlap is
``1 - load_wait_s / load_s``. ``process_totals()`` keeps running sums for the
whole process, which is what a single-process engine run reports at the end.
"""

from __future__ import annotations

import threading
from dataclasses import asdict, dataclass, fields

_FIELDS = (
    "hit_tokens",  # tokens the scheduler took from the pool
    "load_ops",
    "loaded_blocks",  # vLLM blocks written into the paged cache
    "loaded_bytes",
    "load_s",  # loader thread busy time
    "load_wait_s",  # forward pass blocked in wait_for_layer_load
    "load_failed_blocks",  # vLLM blocks reported for recompute
    "saved_blocks",  # kvpool blocks committed
    "skipped_blocks",  # kvpool blocks already stored: not written again
    "saved_bytes",
    "save_s",  # saver thread busy time
    "save_wait_s",  # engine blocked in wait_for_save
    "save_failed_blocks",
)


@dataclass
class Counters:
    hit_tokens: int = 0
    load_ops: int = 0
    loaded_blocks: int = 0
    loaded_bytes: int = 0
    load_s: float = 0.0
    load_wait_s: float = 0.0
    load_failed_blocks: int = 0
    saved_blocks: int = 0
    skipped_blocks: int = 0
    saved_bytes: int = 0
    save_s: float = 0.0
    save_wait_s: float = 0.0
    save_failed_blocks: int = 0

    def add(self, other: Counters | dict[str, float]) -> None:
        data = other if isinstance(other, dict) else asdict(other)
        for name in _FIELDS:
            setattr(self, name, getattr(self, name) + data.get(name, 0))

    def to_dict(self) -> dict[str, float]:
        return asdict(self)

    def is_empty(self) -> bool:
        return not any(getattr(self, f.name) for f in fields(self))


class CounterSink:
    """Counters of the current interval, thread-safe; each add also goes to the process totals."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._interval = Counters()

    def add(self, **values: float) -> None:
        with self._lock:
            self._interval.add(values)
        with _totals_lock:
            _totals.add(values)

    def take(self) -> Counters:
        """The interval's counters; the next interval starts at zero."""
        with self._lock:
            taken, self._interval = self._interval, Counters()
        return taken


_totals = Counters()
_totals_lock = threading.Lock()


def process_totals() -> dict[str, float]:
    """Cumulative counters of every connector in this process."""
    with _totals_lock:
        return _totals.to_dict()

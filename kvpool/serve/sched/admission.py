"""Admission: whether the decode side can take one more request (``--rejection``).

Policies (``REJECTIONS``):

- ``none``: admit everything;
- ``now`` (alias ``early``, "early rejection"): at arrival, reject when no
  prefill worker meets the TTFT SLO, or when the decode pool's load *now*
  is at its capacity;
- ``after``: reject when no worker meets the TTFT SLO; otherwise only after
  prefill, when the decode pool cannot take the request (prefill wasted);
- ``predicted``: at arrival, reject when no worker meets the TTFT SLO, or
  when the decode load *predicted for the moment this request's prefill
  finishes* would be at capacity. The prediction is system-level
  (``DecodeLoadPredictor``): every request decodes for one uniform time
  ``D`` (a running mean of observed decode times), so the load at time t is
  the number of admitted requests whose decode interval [start, start + D)
  contains t — requests decoding now that will have finished drop out,
  requests still in prefill queues enter at their predicted prefill end.

The TTFT check is the conductor's (``Conductor.meets_ttft``); this module
decides on the decode side only. The decode pool's capacity
(``decode_capacity``) is the number of requests it can hold at the mean
request size: within its KV memory and with the step time within the TBT
SLO. Admission aims at ``headroom`` (0.9) of it: at full KV memory the
llama2-70b step time is already at the TBT SLO, so admitting up to 100 %
lets the admitted requests miss it.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from kvpool.serve.sched.cost_model import DecodeCostModel

REJECTIONS = ("none", "now", "early", "after", "predicted")


def normalize_rejection(name: str) -> str:
    """Canonical policy name (``early`` is ``now``); ValueError on unknown names."""
    if name not in REJECTIONS:
        raise ValueError(f"unknown rejection policy {name!r}; choose from {', '.join(REJECTIONS)}")
    return "now" if name == "early" else name


class DecodeLoadPredictor:
    """System-level decode load prediction with one uniform decode time per request.

    Requests are registered when admitted with their predicted prefill end
    (``add(rid, start)``: pending, in prefill), moved to the decode side when
    they actually start decoding (``start(rid, t)``), and dropped when they
    finish or are rejected (``remove``). Every request is assumed to decode
    for ``decode_s`` seconds (the mean of the observed decode times,
    ``observe``), so the load predicted for time T is anchored at the load
    measured now and projected forward::

        load(T) = load_now + pending requests whose prefill ends by T
                           - decoding requests whose start + decode_s falls in (now, T]

    Starts are kept sorted, so each prediction is O(log n).
    """

    def __init__(self, decode_s: float) -> None:
        if decode_s <= 0:
            raise ValueError("decode_s must be positive")
        self.decode_s = decode_s
        self.observed = 0
        self._pending: list[tuple[float, int]] = []
        self._running: list[tuple[float, int]] = []
        self._where: dict[int, tuple[bool, float]] = {}  # rid -> (running?, start)

    def __len__(self) -> int:
        return len(self._where)

    def _drop(self, rid: int) -> None:
        entry = self._where.pop(rid, None)
        if entry is None:
            return
        running, t = entry
        lst = self._running if running else self._pending
        i = bisect.bisect_left(lst, (t, rid))
        if i < len(lst) and lst[i] == (t, rid):
            del lst[i]

    def add(self, rid: int, start: float) -> None:
        """``rid`` is in prefill; its decode is predicted to start at ``start``."""
        self._drop(rid)
        self._where[rid] = (False, start)
        bisect.insort(self._pending, (start, rid))

    def start(self, rid: int, t: float) -> None:
        """``rid`` started decoding at ``t``."""
        self._drop(rid)
        self._where[rid] = (True, t)
        bisect.insort(self._running, (t, rid))

    def remove(self, rid: int) -> None:
        self._drop(rid)

    def pending_by(self, t: float) -> int:
        return bisect.bisect_right(self._pending, (t, float("inf")))

    def finishing(self, now: float, t: float) -> int:
        """Decoding requests predicted to finish in (now, t]."""
        d = self.decode_s
        lo = bisect.bisect_right(self._running, (now - d, float("inf")))
        hi = bisect.bisect_right(self._running, (t - d, float("inf")))
        return max(0, hi - lo)

    def predict(self, now: float, t: float, load_now: int) -> int:
        """Decode load predicted for time ``t`` (>= now) given the load measured now."""
        return max(0, load_now + self.pending_by(t) - self.finishing(now, t))

    def observe(self, seconds: float) -> None:
        """Fold one observed decode time into the mean (the prior counts as one sample)."""
        if seconds > 0:
            self.observed += 1
            self.decode_s += (seconds - self.decode_s) / (self.observed + 1)


def decode_capacity(
    decode: DecodeCostModel, nodes: int, mean_context: float, tbt_slo_s: float
) -> int:
    """Requests the decode pool holds at ``mean_context`` tokens each, within its KV
    memory and with the step time within ``tbt_slo_s``."""
    if nodes <= 0:
        return 0
    ctx = max(mean_context, 1.0)
    by_memory = int(decode.kv_capacity_tokens // ctx)
    per = decode.per_request_s + decode.per_token_s * ctx
    by_tbt = int((tbt_slo_s - decode.base_s) / per) if per > 0 else by_memory
    return nodes * max(0, min(by_memory, by_tbt))


@dataclass
class AdmissionState:
    """The decode side's numbers an admission decision needs."""

    load_now: int  # requests decoding or waiting for decode now
    capacity: int  # requests the decode pool holds within SLO
    predicted_load: int | None = None  # at this request's predicted prefill end


def admit_decode(policy: str, state: AdmissionState, *, at_arrival: bool) -> str | None:
    """None to admit, or the reason to reject, for ``policy`` at this point.

    ``at_arrival``: the decision before prefill (``now``/``predicted``), or
    False for the decision after prefill (``after``).
    """
    policy = normalize_rejection(policy)
    if policy == "none":
        return None
    if at_arrival:
        if policy == "now" and state.load_now + 1 > state.capacity:
            return f"decode load {state.load_now} at capacity {state.capacity}"
        if policy == "predicted":
            load = state.predicted_load if state.predicted_load is not None else state.load_now
            if load + 1 > state.capacity:
                return f"predicted decode load {load} at capacity {state.capacity}"
        return None
    if policy == "after" and state.load_now + 1 > state.capacity:
        return f"decode pool full after prefill ({state.load_now}/{state.capacity})"
    return None


# -- the live router --------------------------------------------------------------------

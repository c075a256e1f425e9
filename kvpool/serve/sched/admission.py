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
    (``add(rid, start, weight)``: pending, in prefill), moved to the decode
    side when they actually start decoding (``start(rid, t)``), and dropped
    when they finish or are rejected (``remove``). Every request is assumed
    to decode for ``decode_s`` seconds (the mean of the observed decode
    times, ``observe``), so the load predicted for time T is anchored at the
    load measured now and projected forward::

        load(T) = load_now + pending requests whose prefill ends by T
                           - decoding requests whose start + decode_s falls in (now, T]

    A request counts with its ``weight``: 1 counts requests; the simulator
    and the live router weigh each by its KV tokens (prompt + the mean
    reply), because the decode pool's limits — KV memory and a step time
    that grows with the batch's context — are in tokens, and a count at the
    mean size lets long prompts through where short ones are refused.

    ``predict_peak`` is the admission question: the highest load over the
    interval the new request would decode in, not only at its start.
    """

    def __init__(self, decode_s: float) -> None:
        if decode_s <= 0:
            raise ValueError("decode_s must be positive")
        self.decode_s = decode_s
        self.observed = 0
        self._pending: list[tuple[float, int]] = []
        self._running: list[tuple[float, int]] = []
        self._where: dict[int, tuple[bool, float]] = {}  # rid -> (running?, start)
        self._weight: dict[int, float] = {}

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

    def add(self, rid: int, start: float, weight: float = 1.0) -> None:
        """``rid`` is in prefill; its decode is predicted to start at ``start``."""
        self._drop(rid)
        self._where[rid] = (False, start)
        self._weight[rid] = weight
        bisect.insort(self._pending, (start, rid))

    def start(self, rid: int, t: float) -> None:
        """``rid`` started decoding at ``t`` (its weight as added, else 1)."""
        self._drop(rid)
        self._where[rid] = (True, t)
        self._weight.setdefault(rid, 1.0)
        bisect.insort(self._running, (t, rid))

    def remove(self, rid: int) -> None:
        self._drop(rid)
        self._weight.pop(rid, None)

    def oldest(self, running: bool) -> int | None:
        """The running request that started first, or the pending one due first."""
        lst = self._running if running else self._pending
        return lst[0][1] if lst else None

    def expire(self, before: float) -> int:
        """Drop entries (pending or running) whose start is before ``before``; how many."""
        n = 0
        for lst in (self._pending, self._running):
            while lst and lst[0][0] < before:
                self.remove(lst[0][1])
                n += 1
        return n

    def _sum(self, entries: list[tuple[float, int]]) -> float:
        w = self._weight
        return sum(w[rid] for _, rid in entries)

    def pending_by(self, t: float) -> float:
        """Weight of pending requests whose decode starts by ``t``."""
        return self._sum(self._pending[: bisect.bisect_right(self._pending, (t, float("inf")))])

    def finishing(self, now: float, t: float) -> float:
        """Weight of decoding requests predicted to finish in (now, t]."""
        d = self.decode_s
        lo = bisect.bisect_right(self._running, (now - d, float("inf")))
        hi = bisect.bisect_right(self._running, (t - d, float("inf")))
        return self._sum(self._running[lo:hi]) if hi > lo else 0.0

    def predict(self, now: float, t: float, load_now: float) -> float:
        """Decode load predicted for time ``t`` (>= now) given the load measured now."""
        return max(0.0, load_now + self.pending_by(t) - self.finishing(now, t))

    def predict_peak(self, now: float, t: float, load_now: float) -> float:
        """The highest load predicted over [t, t + decode_s]: the interval a request
        whose prefill ends at ``t`` would decode in.

        ``predict(now, t, ...)`` alone admits a request that fits at its own
        start but overflows once requests admitted earlier, with longer
        prefill queues, land during its decode; the peak counts them.
        Events in the window: pending decode starts (+weight) and predicted
        decode ends ``start + decode_s`` (-weight); walked in time order.
        """
        d, w = self.decode_s, self._weight
        end = t + d
        level = self.predict(now, t, load_now)
        inf = float("inf")
        lo = bisect.bisect_right(self._pending, (t, inf))
        hi = bisect.bisect_right(self._pending, (end, inf))
        events = [(s, w[rid]) for s, rid in self._pending[lo:hi]]
        for lst, after in ((self._pending, t), (self._running, max(now, t))):
            # predicted ends inside the window: starts in (after - d, end - d]
            lo = bisect.bisect_right(lst, (after - d, inf))
            hi = bisect.bisect_right(lst, (end - d, inf))
            events += [(s + d, -w[rid]) for s, rid in lst[lo:hi]]
        peak = level
        for _, dw in sorted(events, key=lambda e: (e[0], e[1])):  # ends before starts at ties
            level += dw
            peak = max(peak, level)
        return max(0.0, peak)

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
    """The decode side's numbers an admission decision needs, in one unit: requests
    (``weight`` 1) or KV tokens (``weight`` = this request's tokens)."""

    load_now: float  # decoding or waiting for decode now
    capacity: float  # what the decode pool holds within SLO
    predicted_load: float | None = None  # over this request's predicted decode interval
    weight: float = 1.0  # this request's share of the load


def admit_decode(policy: str, state: AdmissionState, *, at_arrival: bool) -> str | None:
    """None to admit, or the reason to reject, for ``policy`` at this point.

    ``at_arrival``: the decision before prefill (``now``/``predicted``), or
    False for the decision after prefill (``after``).
    """
    policy = normalize_rejection(policy)
    if policy == "none":
        return None
    if at_arrival:
        if policy == "now" and state.load_now + state.weight > state.capacity:
            return f"decode load {state.load_now:g} at capacity {state.capacity:g}"
        if policy == "predicted":
            load = state.predicted_load if state.predicted_load is not None else state.load_now
            if load + state.weight > state.capacity:
                return f"predicted decode load {load:g} at capacity {state.capacity:g}"
        return None
    if policy == "after" and state.load_now + state.weight > state.capacity:
        return f"decode pool full after prefill ({state.load_now:g}/{state.capacity:g})"
    return None


class LiveDecodeLedger:
    """``DecodeLoadPredictor`` fed by the live front end, which reports events without
    request ids: an admission (``admitted``: the predicted decode start and the
    request's weight), a finished prefill (``prefill_done``) and a finished request
    (``finished``). Prefills are matched to the pending entry due first and
    finishes to the running entry that started first — under the predictor's own
    assumption (one uniform decode time) the oldest is the one to finish.

    ``stale_after`` decode times past its predicted start, an entry whose event
    never came (a front end restarted, an observation lost) is dropped, so a
    missed report cannot hold the prediction up for good.
    """

    def __init__(self, decode_s: float, stale_after: float = 10.0) -> None:
        self.predictor = DecodeLoadPredictor(decode_s)
        self.stale_after = stale_after
        self._next = 0

    def __len__(self) -> int:
        return len(self.predictor)

    def admitted(self, decode_start: float, weight: float) -> None:
        """A request was admitted; its decode is predicted to start at ``decode_start``
        (bookkeeping runs under every policy, so stale entries expire here too)."""
        self._expire(decode_start)
        self._next += 1
        self.predictor.add(self._next, decode_start, weight)

    def _expire(self, now: float) -> None:
        self.predictor.expire(now - self.stale_after * self.predictor.decode_s)

    def prefill_done(self, now: float, ok: bool = True) -> None:
        rid = self.predictor.oldest(running=False)
        if rid is None:
            return
        if ok:
            self.predictor.start(rid, now)
        else:
            self.predictor.remove(rid)

    def finished(self, decode_seconds: float, decoded: bool = True) -> None:
        """A request ended: its decode took ``decode_seconds`` (0: it failed), or it
        ended before its first token (``decoded`` False: still pending here)."""
        rid = self.predictor.oldest(running=decoded)
        if rid is None:
            rid = self.predictor.oldest(running=not decoded)
        if rid is not None:
            self.predictor.remove(rid)
        self.predictor.observe(decode_seconds)

    def predict_peak(self, now: float, t: float, load_now: float) -> float:
        """``DecodeLoadPredictor.predict_peak`` after dropping stale entries."""
        self._expire(now)
        return self.predictor.predict_peak(now, t, load_now)

"""Goodput as a sustainable rate (``kvpool sim --find-rate``, ``kvpool plan``).

The serving literature's definition (DistServe, OSDI '24): a configuration's
goodput is the highest request rate it sustains with at least ``attainment``
(default 90 %) of the requests within both SLOs (TTFT and TBT; a rejected
request counts as missing them). Here the rate is the trace's own arrival
rate times ``--speed`` (timestamps divided by the speed), so the search is
over the speed:

1. probe the starting speed; double it while the attainment holds, or halve
   it until it does (``speed_bounds`` caps both directions);
2. bisect geometrically between the last speed that held and the first that
   did not until they are within ``rel_tol`` (5 %) of each other.

``sustainable_speed`` is the highest probed speed that held and
``sustainable_rps`` = requests / (trace span / speed): requests per second
at that speed. A configuration that misses the target even at the lowest
bound sustains 0. Attainment is not strictly monotonic in the rate on a
finite trace (a lucky burst alignment), so the result is the highest
*probed* speed that held, the usual meaning of such a search; probes are
returned (``rate_search``) so a reader can see the curve around it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from kvpool.serve.sched.sim.config import SimConfig

#: One simulation at a speed: the result dict of ``sim.runner.simulate``.
RunAt = Callable[[float], dict[str, Any]]


@dataclass(frozen=True)
class RateSearch:
    """Knobs of the search (see the module doc)."""

    attainment: float = 0.9
    rel_tol: float = 0.05
    speed_bounds: tuple[float, float] = (1 / 256, 1024.0)

    def validate(self) -> None:
        if not 0.0 < self.attainment <= 1.0:
            raise ValueError("attainment must be in (0, 1]")
        if self.rel_tol <= 0:
            raise ValueError("rel_tol must be > 0")
        lo, hi = self.speed_bounds
        if not 0 < lo < hi:
            raise ValueError("speed bounds must satisfy 0 < low < high")


def trace_rate(records: Sequence[Any]) -> float:
    """Requests per second of the trace at speed 1 (n / span); ValueError if undefined."""
    if len(records) < 2:
        raise ValueError("a sustainable rate needs a trace of at least 2 requests")
    span_s = (records[-1].timestamp - records[0].timestamp) / 1000.0
    if span_s <= 0:
        raise ValueError("the trace's timestamps span no time; no rate to scale")
    return len(records) / span_s


def find_rate(run_at: RunAt, base_rps: float, start: float, search: RateSearch) -> dict[str, Any]:
    """Search the speed (see the module doc); returns the ``sustainable_*`` keys,
    the probes and the result dict at the sustainable speed (``at_sustainable``)."""
    search.validate()
    lo_bound, hi_bound = search.speed_bounds
    probes: dict[float, dict[str, Any]] = {}

    def ok(speed: float) -> bool:
        if speed not in probes:
            probes[speed] = run_at(speed)
        return probes[speed]["slo_attainment_all"] >= search.attainment

    speed = min(max(start, lo_bound), hi_bound)
    good: float | None = None
    bad: float | None = None
    if ok(speed):
        good = speed
        while good < hi_bound:
            nxt = min(good * 2, hi_bound)
            if not ok(nxt):
                bad = nxt
                break
            good = nxt
    else:
        bad = speed
        while bad > lo_bound:
            nxt = max(bad / 2, lo_bound)
            if ok(nxt):
                good = nxt
                break
            bad = nxt
    if good is not None and bad is not None:
        while bad / good > 1 + search.rel_tol:
            mid = math.sqrt(good * bad)
            if ok(mid):
                good = mid
            else:
                bad = mid
    return {
        "sustainable_speed": good or 0.0,
        "sustainable_rps": (good or 0.0) * base_rps,
        "attainment_target": search.attainment,
        "rate_search": [
            {
                "speed": s,
                "rps": s * base_rps,
                "slo_attainment_all": probes[s]["slo_attainment_all"],
                "goodput_rps": probes[s]["goodput_rps"],
            }
            for s in sorted(probes)
        ],
        "at_sustainable": probes[good] if good is not None else None,
    }


def sim_find_rate(
    records: Sequence[Any],
    config: SimConfig,
    search: RateSearch,
    *,
    keys: Sequence[list[bytes]] | None = None,
) -> dict[str, Any]:
    """``find_rate`` over ``sim.runner.simulate`` of ``records`` under ``config``
    (the speed varies; the search starts at ``config.speed``)."""
    from kvpool.serve.sched.sim.runner import simulate
    from kvpool.workload.cachesim import trace_keys

    base = trace_rate(records)
    ks = keys if keys is not None else trace_keys(records, config.block_tokens)
    return find_rate(
        lambda s: simulate(records, replace(config, speed=s), keys=ks), base, config.speed, search
    )

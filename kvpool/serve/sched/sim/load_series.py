"""Prefill and decode load over time (``kvpool sim --load-series F``): the oscillation.

Early rejection on the decode load *now* (``--rejection now``) looks at a
load that lags the admissions by a prefill: requests admitted while a slot
looks free reach decode one TTFT later, all at once (overshoot), and while
the pool is over its capacity every arrival is refused, so a TTFT later the
decode side drains below it (undershoot) — a load that swings around the
capacity with a period of a few prefills (the paper's Figure on "load
fluctuation"). ``--rejection predicted`` asks for the load over the
request's own decode interval instead and damps the swing.

``LoadSampler`` samples, every ``interval_s`` of simulated time, each
prefill node's committed work (seconds queued, the conductor's estimate)
and the decode pool's load (admitted KV tokens over the admission target,
``Cluster.decode_capacity_tokens``: the estimated capacity times
``--decode-headroom``; and the requests waiting for decode memory).
``summary`` reduces a series to the numbers RESULTS compares (mean,
standard deviation and share of time over the target of the decode load;
mean and standard deviation of the prefill queue) over the steady part of
the run (the first and last tenth of the trace are warm-up and drain).
``plot`` draws both (matplotlib, the ``plot`` extra).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvpool.serve.sched.sim.cluster import Cluster


class LoadSampler:
    """Samples a running ``Cluster`` at fixed simulated times (``sample_until``)."""

    def __init__(self, interval_s: float) -> None:
        if interval_s <= 0:
            raise ValueError("load sample interval must be > 0")
        self.interval_s = interval_s
        self.next_t = 0.0
        self.series: dict[str, list[float]] = {
            "t": [],
            "prefill_queue_s": [],
            "decode_load": [],
            "decode_waiting": [],
        }

    def sample_until(self, cluster: Cluster, t: float) -> None:
        """Record every sample time up to ``t`` with the cluster's state before ``t``."""
        while self.next_t <= t:
            now = self.next_t
            nodes = cluster.prefill_nodes
            queue = sum(cluster.queue_seconds(n, now) for n in nodes) / max(1, len(nodes))
            cap = cluster.decode_capacity_tokens()
            s = self.series
            s["t"].append(now)
            s["prefill_queue_s"].append(queue)
            s["decode_load"].append(cluster.decode_tokens / cap if cap > 0 else 0.0)
            s["decode_waiting"].append(
                float(sum(len(n.engine.waiting) for n in cluster.decode_nodes if n.engine))
            )
            self.next_t += self.interval_s


def _mean_std(xs: list[float]) -> tuple[float, float]:
    if not xs:
        return 0.0, 0.0
    m = sum(xs) / len(xs)
    return m, math.sqrt(sum((x - m) ** 2 for x in xs) / len(xs))


def amplitude(xs: list[float]) -> float:
    """Half the spread between the 5th and the 95th percentile (a sine of amplitude
    A gives 0.988 A; robust to single spikes)."""
    if not xs:
        return 0.0
    v = sorted(xs)

    def q(p: float) -> float:
        i = p * (len(v) - 1)
        lo = int(i)
        hi = min(lo + 1, len(v) - 1)
        return v[lo] + (v[hi] - v[lo]) * (i - lo)

    return (q(0.95) - q(0.05)) / 2


def period(xs: list[float], interval_s: float) -> float:
    """Mean time between successive upward swings through the mean (0 when there are
    fewer than two). A swing counts once the series has been below ``mean - h`` and
    then reaches ``mean + h``, ``h`` half a standard deviation, so noise around the
    mean does not count as cycles."""
    m, sd = _mean_std(xs)
    h = sd / 2
    if h <= 0:
        return 0.0
    ups: list[int] = []
    low = False
    for i, x in enumerate(xs):
        if x < m - h:
            low = True
        elif x > m + h and low:
            ups.append(i)
            low = False
    if len(ups) < 2:
        return 0.0
    return (ups[-1] - ups[0]) / (len(ups) - 1) * interval_s


def summary(series: dict[str, list[float]]) -> dict[str, float]:
    """Oscillation numbers over the steady middle 80 % of the series: mean, standard
    deviation, amplitude (``amplitude``) and period (``period``) of the decode load
    and of the prefill queue, and the decode load's share of time over its target."""
    n = len(series["t"])
    lo, hi = n // 10, n - n // 10
    decode = series["decode_load"][lo:hi]
    queue = series["prefill_queue_s"][lo:hi]
    d_mean, d_std = _mean_std(decode)
    q_mean, q_std = _mean_std(queue)
    t = series["t"]
    step = (t[-1] - t[0]) / (len(t) - 1) if len(t) > 1 else 0.0
    return {
        "decode_load_amplitude": amplitude(decode),
        "decode_load_period_s": period(decode, step),
        "prefill_queue_amplitude_s": amplitude(queue),
        "prefill_queue_period_s": period(queue, step),
        "decode_load_mean": d_mean,
        "decode_load_std": d_std,
        "decode_over_capacity_share": sum(1 for x in decode if x > 1.0) / len(decode)
        if decode
        else 0.0,
        "prefill_queue_mean_s": q_mean,
        "prefill_queue_std_s": q_std,
    }


def plot(runs: dict[str, dict[str, list[float]]], path: str, title: str = "") -> None:
    """Prefill queue and decode load against time, one line per run (label -> series)."""
    try:
        import matplotlib
    except ImportError:
        raise RuntimeError("the plot needs matplotlib: pip install 'kvpool[plot]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(8, 5), sharex=True)
    for label, s in runs.items():
        ax1.plot(s["t"], s["prefill_queue_s"], label=label, linewidth=0.8)
        ax2.plot(s["t"], s["decode_load"], label=label, linewidth=0.8)
    ax1.set_ylabel("prefill queue (s per node)")
    ax2.set_ylabel("decode load / admission target")
    ax2.axhline(1.0, color="gray", linestyle="--", linewidth=0.8)
    ax2.set_xlabel("simulated time (s)")
    ax1.legend()
    if title:
        ax1.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

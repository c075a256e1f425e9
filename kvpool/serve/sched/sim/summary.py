"""The simulator's result dict: SLO attainment, goodput, latencies, rejections, config."""

from __future__ import annotations

import math
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from kvpool.serve.sched.sim.load_series import summary as load_summary

if TYPE_CHECKING:
    from kvpool.serve.sched.sim.cluster import Cluster


def summarize(cluster: Cluster, wall_s: float = 0.0) -> dict[str, Any]:
    """What ``kvpool sim`` prints for a finished run of ``cluster``."""
    reqs = cluster.reqs
    n = len(reqs)
    done = [r for r in reqs if r.rejected is None and r.end >= 0]
    ttft = [r.first_token - r.arrival for r in done]
    ttft_ok = [r.first_token - r.arrival <= r.ttft_slo for r in done]
    tbt_ok = [r.tbt_ok for r in done]
    good = sum(1 for r, a in zip(done, ttft_ok, strict=True) if a and r.tbt_ok)
    span = (reqs[-1].arrival - reqs[0].arrival) if n > 1 else 0.0
    ttft_sorted = sorted(ttft)

    def pct(xs: list[float], p: float) -> float:
        if not xs:
            return 0.0
        return xs[min(len(xs) - 1, max(0, math.ceil(p / 100 * len(xs)) - 1))]

    tbts = sorted(r.mean_tbt for r in done if r.output > 1)
    cfg = cluster.cfg
    load: dict[str, Any] = {}
    if cluster.sampler is not None:
        series = cluster.sampler.series
        load = {"load_oscillation": load_summary(series), "load_series": series}
    return {
        "requests": n,
        "completed": len(done),
        "rejected": sum(1 for r in reqs if r.rejected is not None),
        "ttft_slo_attainment": sum(ttft_ok) / len(done) if done else 0.0,
        "tbt_slo_attainment": sum(tbt_ok) / len(done) if done else 0.0,
        "goodput_rps": good / span if span > 0 else float(good),
        "mean_ttft_s": sum(ttft) / len(ttft) if ttft else 0.0,
        "hit_ratio": cluster.hit_blocks / cluster.total_blocks if cluster.total_blocks else 0.0,
        "good": good,
        "slo_attainment_all": good / n if n else 0.0,
        "p90_ttft_s": pct(ttft_sorted, 90),
        "p99_ttft_s": pct(ttft_sorted, 99),
        "mean_tbt_s": sum(tbts) / len(tbts) if tbts else 0.0,
        "p99_mean_tbt_s": pct(tbts, 99),
        "rejected_ttft": cluster.rejected_ttft,
        "rejected_decode": cluster.rejected_decode,
        "rejected_after_prefill": cluster.rejected_after,
        "wasted_prefill_s": cluster.wasted_prefill_s,
        "fetches": cluster.fetches,
        "duration_s": span,
        "makespan_s": max((r.end for r in done), default=0.0),
        "sim_wall_s": wall_s,
        "config": {
            "prefill": 0 if cluster.coupled else cfg.prefill,
            "decode": 0 if cluster.coupled else cfg.decode,
            "coupled": cfg.coupled,
            "speed": cfg.speed,
            "router": cfg.router,
            "rejection": cfg.rejection,
            "capacity_blocks": cfg.capacity_blocks,
            "policy": cfg.policy,
            "slo": asdict(cfg.slo),
            "balance_threshold": cfg.balance_threshold,
            "decode_headroom": cfg.decode_headroom,
            "model": cfg.model,
            "cpp_group": cfg.cpp_group,
            "hardware": cfg.hardware,
            "layerwise": cfg.layerwise,
            "layer_overhead_s": cfg.layer_overhead_s,
        },
        **load,
    }

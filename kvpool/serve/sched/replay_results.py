"""What ``kvpool replay`` measured: per-request outcomes, SLOs, the summary, CDF plots.

A request meets the TTFT SLO when its TTFT is within it, and the TBT SLO
when both the P90 and the mean of its gaps between tokens are within it (as
in ``kvpool sim``). How the SLOs are derived (absolute, a cost model, or the
probe request) is ``apply_slos``'s.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvpool.errors import KVPoolError
from kvpool.serve.sched.cost_model import PrefillCostModel

PERCENTILES = (50, 90, 99)


class ReplayError(KVPoolError, RuntimeError):
    """The replay cannot go on (its probe request failed) or cannot report (no matplotlib)."""


@dataclass
class Outcome:
    """One replayed request."""

    index: int
    prompt_tokens: int
    max_tokens: int
    sent: float = 0.0  # seconds since the replay started
    status: int = 0
    ttft: float | None = None
    gaps: list[float] = field(default_factory=list)
    output_tokens: int = 0
    cached_tokens: int | None = None
    error: str | None = None
    ttft_slo: float = math.inf
    tbt_slo: float = math.inf

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None and self.ttft is not None

    @property
    def rejected(self) -> bool:
        return self.status == 429

    def ttft_ok(self) -> bool:
        return self.ok and self.ttft is not None and self.ttft <= self.ttft_slo

    def tbt_ok(self, percentile: float = 90.0) -> bool:
        if not self.ok:
            return False
        if not self.gaps:
            return True
        return (
            percentile_of(self.gaps, percentile) <= self.tbt_slo
            and sum(self.gaps) / len(self.gaps) <= self.tbt_slo
        )


def percentile_of(values: Sequence[float], p: float) -> float:
    """Nearest-rank percentile (0 for no values)."""
    if not values:
        return 0.0
    xs = sorted(values)
    return xs[min(len(xs) - 1, max(0, math.ceil(p / 100.0 * len(xs)) - 1))]


def apply_slos(
    outcomes: Sequence[Outcome],
    probe: Outcome | None,
    *,
    ttft_mult: float,
    tbt_mult: float,
    cost_model: PrefillCostModel | None = None,
    ttft_slo_s: float | None = None,
    tbt_slo_s: float | None = None,
) -> dict[str, Any]:
    """Fill each outcome's SLOs; returns how they were derived."""
    basis: dict[str, Any] = {"ttft_mult": ttft_mult, "tbt_mult": tbt_mult}
    probe_tbt = percentile_of(probe.gaps, 50) if probe and probe.gaps else None
    if probe is not None:
        basis["probe"] = {
            "prompt_tokens": probe.prompt_tokens,
            "ttft_s": probe.ttft,
            "median_gap_s": probe_tbt,
        }
    for o in outcomes:
        if ttft_slo_s is not None:
            o.ttft_slo = ttft_slo_s
        elif cost_model is not None:
            o.ttft_slo = ttft_mult * cost_model.unloaded_ttft(o.prompt_tokens)
        elif probe is not None and probe.ttft is not None:
            o.ttft_slo = ttft_mult * probe.ttft * max(o.prompt_tokens, 1) / probe.prompt_tokens
        if tbt_slo_s is not None:
            o.tbt_slo = tbt_slo_s
        elif probe_tbt:
            o.tbt_slo = tbt_mult * probe_tbt
    basis["ttft"] = (
        "absolute"
        if ttft_slo_s is not None
        else "cost model"
        if cost_model is not None
        else "probe (linear in prompt length)"
        if probe is not None
        else "none"
    )
    basis["tbt"] = "absolute" if tbt_slo_s is not None else "probe" if probe_tbt else "none"
    return basis


def summarize(outcomes: Sequence[Outcome], span_s: float, wall_s: float) -> dict[str, Any]:
    ok = [o for o in outcomes if o.ok]
    ttfts = [o.ttft for o in ok if o.ttft is not None]
    gaps = [g for o in ok for g in o.gaps]
    good = sum(1 for o in ok if o.ttft_ok() and o.tbt_ok())
    prompt = sum(o.prompt_tokens for o in ok if o.cached_tokens is not None)
    cached = sum(o.cached_tokens or 0 for o in ok if o.cached_tokens is not None)
    span = span_s if span_s > 0 else wall_s
    out: dict[str, Any] = {
        "requests": len(outcomes),
        "completed": len(ok),
        "rejected": sum(1 for o in outcomes if o.rejected),
        "failed": sum(1 for o in outcomes if not o.ok and not o.rejected),
        "ttft_slo_attainment": sum(o.ttft_ok() for o in ok) / len(ok) if ok else 0.0,
        "tbt_slo_attainment": sum(o.tbt_ok() for o in ok) / len(ok) if ok else 0.0,
        "goodput_rps": good / span if span > 0 else 0.0,
        "mean_ttft_s": sum(ttfts) / len(ttfts) if ttfts else 0.0,
        "hit_ratio": cached / prompt if prompt else None,
        "good": good,
        "output_tokens": sum(o.output_tokens for o in ok),
        "duration_s": span_s,
        "wall_s": wall_s,
    }
    for p in PERCENTILES:
        out[f"ttft_p{p}_s"] = percentile_of(ttfts, p)
    for p in PERCENTILES:
        out[f"tbt_p{p}_s"] = percentile_of(gaps, p)
    errors = sorted({o.error for o in outcomes if o.error and not o.rejected})
    if errors:
        out["errors"] = errors[:5]
    return out


def plot_cdfs(outcomes: Sequence[Outcome], directory: str) -> list[str]:
    """``ttft_cdf.png`` and ``tbt_cdf.png`` in ``directory``; returns the paths."""
    try:
        import matplotlib
    except ImportError:
        raise ReplayError("--plot needs matplotlib: pip install 'kvpool[plot]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(directory, exist_ok=True)
    ok = [o for o in outcomes if o.ok]
    series = {
        "ttft": ([o.ttft for o in ok if o.ttft is not None], "TTFT (s)"),
        "tbt": ([g for o in ok for g in o.gaps], "time between tokens (s)"),
    }
    paths = []
    for name, (values, label) in series.items():
        fig, ax = plt.subplots(figsize=(5, 3.5))
        xs = sorted(values)
        if xs:
            ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post")
        ax.set_xlabel(label)
        ax.set_ylabel("CDF")
        ax.set_ylim(0, 1.01)
        ax.grid(True, alpha=0.3)
        ax.set_title(f"{name.upper()} CDF ({len(xs)} samples)")
        fig.tight_layout()
        path = os.path.join(directory, f"{name}_cdf.png")
        fig.savefig(path, dpi=100)
        plt.close(fig)
        paths.append(path)
    return paths

"""The capacity planner's report: the text table ``kvpool plan`` prints and its plot."""

from __future__ import annotations

from typing import Any


def format_report(out: dict[str, Any]) -> str:
    lines = []
    cfg = out["config"]
    b = out["best"]
    lines.append(
        f"trace {cfg['trace']}: {cfg['requests']} requests, speed x{cfg['speed']}, "
        f"SLO TTFT {cfg['slo_ttft']}x / TBT {cfg['slo_tbt']}x unloaded, {cfg['nodes']} nodes"
    )
    att = cfg.get("attainment", 0.9)
    n = cfg["nodes"]
    lines.append(
        f"best split: {b['prefill']} prefill + {b['decode']} decode (cpp group {b['cpp_group']}): "
        f"sustains {b['sustainable_rps']:.2f} req/s ({b['sustainable_rps_per_node']:.3f} per node) "
        f"with >= {att:.0%} within both SLOs; {b['goodput_rps']:.2f} req/s within SLO at "
        f"x{cfg['speed']}"
    )
    c_rate = out["coupled_sustainable_rps"]
    lines.append(
        f"coupled baseline ({n} nodes): sustains {c_rate:.2f} req/s ({c_rate / n:.3f} per node); "
        f"{out['coupled_goodput_rps']:.2f} req/s within SLO at x{cfg['speed']} "
        f"(best split / coupled, sustainable = {_ratio(b['sustainable_rps'], c_rate)})"
    )
    lines.append("")
    lines.append(
        "| prefill | decode | cpp group | sustainable req/s | per node | goodput req/s | "
        "TTFT SLO met | TBT SLO met |"
    )
    lines.append("|---|---|---|---|---|---|---|---|")
    for p in out["curve"]:
        lines.append(
            f"| {p['prefill']} | {p['decode']} | {p['cpp_group']} | {p['sustainable_rps']:.2f} | "
            f"{p['sustainable_rps_per_node']:.3f} | {p['goodput_rps']:.2f} | "
            f"{p['ttft_slo_attainment']:.3f} | {p['tbt_slo_attainment']:.3f} |"
        )
    sc = out.get("smallest_cluster")
    lines.append("")
    if sc is None:
        lines.append("smallest cluster: none within the searched sizes")
    else:
        lines.append(
            f"smallest cluster within SLO at speed x{sc['speed']} "
            f"(>= {sc['attainment']:.0%} of requests within both SLOs): {sc['nodes']} nodes = "
            f"{sc['prefill']} prefill + {sc['decode']} decode (cpp group {sc['cpp_group']}), "
            f"{sc['slo_attainment_all']:.3f} within SLO, {sc['goodput_rps']:.2f} req/s"
        )
    if out.get("pool_sizing"):
        lines.append("")
        lines.append(
            "| policy | DRAM blocks (GiB) | SSD blocks (GiB) | hit ratio | from DRAM | "
            "prefill compute saved |"
        )
        lines.append("|---|---|---|---|---|---|")
        for r in out["pool_sizing"]:
            lines.append(
                f"| {r['policy']} | {r['dram_blocks']:,} ({r['dram_gib']:,.0f}) | "
                f"{r['ssd_blocks']:,} ({r['ssd_gib']:,.0f}) | {r['hit_ratio']:.3f} | "
                f"{r['dram_hit_ratio']:.3f} | {r['saved_prefill_fraction']:.1%} |"
            )
    return "\n".join(lines)


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b > 0 else "n/a"


def plot_curve(out: dict[str, Any], path: str) -> None:
    try:
        import matplotlib
    except ImportError:
        raise RuntimeError("the plot needs matplotlib: pip install 'kvpool[plot]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [p["prefill"] for p in out["curve"]]
    fig, ax = plt.subplots(figsize=(6, 3.8))
    ax.plot(xs, [p["sustainable_rps"] for p in out["curve"]], marker="o", label="disaggregated")
    ax.axhline(out["coupled_sustainable_rps"], color="gray", linestyle="--", label="coupled")
    b = out["best"]
    ax.scatter([b["prefill"]], [b["sustainable_rps"]], color="red", zorder=3, label="best")
    ax.set_xlabel(f"prefill nodes (of {out['config']['nodes']})")
    att = out["config"].get("attainment", 0.9)
    ax.set_ylabel(f"sustainable req/s ({att:.0%} within SLO)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

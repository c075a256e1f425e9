"""``simulate``: one trace on one configured cluster, the class chosen by the config."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvpool.serve.sched.cost_model import ClusterCostModel
from kvpool.serve.sched.sim.cluster import Cluster
from kvpool.serve.sched.sim.config import SimConfig
from kvpool.serve.sched.sim.cpp import CppCluster
from kvpool.workload.cachesim import trace_keys


def simulate(
    records: Sequence[Any],
    config: SimConfig | None = None,
    *,
    keys: Sequence[list[bytes]] | None = None,
    cost: ClusterCostModel | None = None,
) -> dict[str, Any]:
    """Simulate ``records`` (``TraceRecord``s) on the configured cluster; the result dict."""
    cfg = config or SimConfig()
    if keys is None:
        keys = trace_keys(records, cfg.block_tokens)
    if cfg.cpp_group != 1:  # pipeline prefill groups
        return CppCluster(records, keys, cfg, cost).run()
    return Cluster(records, keys, cfg, cost).run()

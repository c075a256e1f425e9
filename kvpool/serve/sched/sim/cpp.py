"""Chunked pipeline prefill (CPP) in the cluster simulator (``--cpp-group k``).

``CppCluster`` is ``sim.Cluster`` with ``--cpp-group k``: prefill nodes form
groups of k consecutive nodes. Per request the conductor's plan gives the
best single node and its TTFT estimate; the request is pipelined over the
group with the lowest estimate (queue = the group's busiest member) when
the single-node estimate misses its TTFT SLO or the tokens to compute
(prompt minus reused prefix) are at least ``min_tokens``, and only if
that lowers the estimate and does not leave the group's other members idle
for more than ``max_idle`` of the pipeline's node-seconds
(``choose_pipeline``). A pipelined request occupies every member of
its group for its whole duration (bubble included). Prompts that fit one
node pay nothing.


The pipeline's timing model is ``kvpool.serve.sched.pipeline_model``.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

from kvpool.serve.sched.cost_model import ClusterCostModel
from kvpool.serve.sched.pipeline_model import (
    DEFAULT_MAX_IDLE,
    DEFAULT_MIN_TOKENS,
    choose_pipeline,
    cpp_seconds,
)
from kvpool.serve.sched.sim.cluster import Cluster
from kvpool.serve.sched.sim.config import PREFILL_DONE, SimConfig


class CppCluster(Cluster):
    """``sim.Cluster`` with pipeline prefill over groups of ``config.cpp_group`` nodes."""

    def __init__(
        self,
        records: Any,
        keys: Any,
        config: SimConfig,
        cost: ClusterCostModel | None = None,
        *,
        min_tokens: int = DEFAULT_MIN_TOKENS,
        max_idle: float = DEFAULT_MAX_IDLE,
    ) -> None:
        k = config.cpp_group
        if k < 1:
            raise ValueError("--cpp-group must be >= 1")
        if config.coupled:
            raise ValueError("--cpp-group applies to disaggregated prefill nodes, not --coupled")
        if config.prefill % k:
            raise ValueError(f"--prefill {config.prefill} is not a multiple of --cpp-group {k}")
        super().__init__(records, keys, replace(config, cpp_group=1), cost)
        self.cfg = config
        self.k = k
        self.min_tokens = min_tokens
        self.max_idle = max_idle
        self.cpp_requests = 0
        self.cpp_bubble_sum = 0.0

    def _on_arrival(self, rid: int, now: float) -> None:
        if self.k == 1:
            super()._on_arrival(rid, now)
            return
        r = self.reqs[rid]
        nodes = self.prefill_nodes
        views = self._arrive(r, now)
        plan = self.route(self.conductor, r.input, views, self.rng)
        idx = next(i for i, n in enumerate(nodes) if n.name == plan.worker_id)
        ttft, seconds, members = plan.ttft_s, plan.transfer_s + plan.prefill_s, [idx]
        bubble = 0.0
        bt = self.cost.config.block_tokens
        cached = min(plan.reused_blocks * bt, r.input - 1)
        new = r.input - cached
        if plan.ttft_s > r.ttft_slo or new >= self.min_tokens:
            pipe_s, bubble, _ = cpp_seconds(self.cost, new, cached, self.k)
            best_g, best_q, best_idle = 0, math.inf, 0.0
            for g in range(len(nodes) // self.k):
                queues = [views[m].queue_s for m in range(g * self.k, (g + 1) * self.k)]
                q = max(queues)
                if q < best_q:
                    best_g, best_q, best_idle = g, q, sum(q - x for x in queues)
            cpp_ttft = best_q + plan.transfer_s + pipe_s
            if choose_pipeline(
                ttft,
                cpp_ttft,
                r.ttft_slo,
                new,
                self.min_tokens,
                idle_s=best_idle,
                work_s=self.k * pipe_s,
                max_idle=self.max_idle,
            ):
                ttft, seconds = cpp_ttft, plan.transfer_s + pipe_s
                members = list(range(best_g * self.k, (best_g + 1) * self.k))
        if self._rejects(r, now, ttft):
            return
        self._fetch(r, plan)
        if len(members) > 1:
            self.cpp_requests += 1
            self.cpp_bubble_sum += bubble
        r.prefill_node, r.prefill_s, r.reused_blocks = members[0], seconds, plan.reused_blocks
        r.compute_s = seconds - plan.transfer_s
        self.hit_blocks += plan.reused_blocks
        self.total_blocks += len(r.keys)
        end = max([now] + [nodes[m].busy_until for m in members]) + seconds
        for m in members:
            nodes[m].busy_until = end
        self.predictor.add(rid, end, r.weight)
        self._push(end, PREFILL_DONE, rid)

    def results(self, wall_s: float = 0.0) -> dict[str, Any]:
        out = super().results(wall_s)
        out["cpp_requests"] = self.cpp_requests
        out["cpp_mean_bubble"] = (
            self.cpp_bubble_sum / self.cpp_requests if self.cpp_requests else 0.0
        )
        return out


# -- CLI: kvpool sim-cpp ------------------------------------------------------------------

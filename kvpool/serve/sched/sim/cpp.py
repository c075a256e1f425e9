"""Chunked pipeline prefill (CPP) in the simulator, and its TTFT curve.

Time models (all on ``cost_model.analytic_cluster``'s nodes: llama2-70b on
8 x H100, tensor parallel over NVLink inside a node, 100 GB/s between nodes):

- single node: ``PrefillCostModel.predict(new, cached)``;
- CPP over k nodes (``cpp_seconds``): the layers split evenly (80/k per
  stage); the prompt cut into chunks; chunk i costs its share of the
  quadratic model on each stage, ``(c_token * c + c_pair * pairs(c, s_i)) / k``
  (``s_i`` = tokens before the chunk, so later chunks cost more) plus
  ``CHUNK_OVERHEAD_S`` per chunk per stage (kernel launches and scheduling
  of one more, smaller forward); between stages the chunk's hidden states
  move over the network, ``TransferModel.seconds(c * hidden * 2 B)``. The
  pipeline is simulated exactly (stage j starts chunk i when stage j-1 has
  sent it and stage j finished chunk i-1), so the fill/drain bubble and the
  growth of chunk cost are both in the result; the chunk size is the one
  of ``CHUNK_SIZES`` that minimises the time, per prompt;
- cross-node tensor parallelism over k nodes (``tp_seconds``): compute
  divides by k, but every layer adds two all-reduces (after attention and
  after the MLP) of the prompt's hidden states (``tokens * hidden * 2 B``),
  on the critical path; ring all-reduce moves ``2 (k - 1) / k`` of the data
  per node at ``NET_BPS`` = 100 GB/s with ``2 (k - 1)`` latencies of
  ``NET_LATENCY_S`` = 50 us (the cost model's network constants).

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

``kvpool sim-cpp`` prints the TTFT-vs-prompt-length table (8k -> 128k).
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import replace
from typing import Any

from kvpool.serve.sched.cost_model import (
    ClusterCostModel,
    PrefillCostModel,
    TransferModel,
    analytic_cluster,
    attention_pairs,
)
from kvpool.serve.sched.sim.cluster import PREFILL_DONE, Cluster, SimConfig

CHUNK_SIZES = (1024, 2048, 4096, 8192, 16384)
CHUNK_OVERHEAD_S = 0.5e-3  # per chunk per stage: one more forward's launches/scheduling
NET_BPS = 100e9  # between nodes (cost_model.HardwareSpec.net_Bps)
NET_LATENCY_S = 50e-6  # per message / per ring step (HardwareSpec.net_latency_s)
DEFAULT_MIN_TOKENS = 16384
DEFAULT_MAX_IDLE = 0.1  # of a pipeline's node-seconds, see choose_pipeline
PROMPT_LENGTHS = (8192, 16384, 32768, 65536, 131072)


def pipeline_seconds(
    cost: ClusterCostModel, new: int, cached: int, stages: int, chunk: int
) -> tuple[float, float]:
    """(seconds, bubble) of a ``stages``-stage pipeline prefill with ``chunk``-token chunks."""
    cfg = cost.config
    return pipeline_estimate(
        cost.prefill, cost.transfer, cfg.hidden_size * cfg.dtype_bytes, new, cached, stages, chunk
    )


def pipeline_estimate(
    pm: PrefillCostModel,
    transfer: TransferModel,
    hop_bytes: int,
    new: int,
    cached: int,
    stages: int,
    chunk: int,
) -> tuple[float, float]:
    """``pipeline_seconds`` on an explicit prefill model, stage-to-stage transfer
    model and bytes per token crossing a stage boundary (``hop_bytes``): what
    the live conductor (``kvpool serve --router conductor --cpp-group k``) uses."""
    finish = [0.0] * stages  # finish time of the previous chunk on each stage
    busy = 0.0
    start = 0
    while start < new:
        c = min(chunk, new - start)
        work = pm.c_token * c + pm.c_pair * attention_pairs(c, cached + start)
        if start == 0:
            work += pm.c_cached * cached
        t = work / stages + CHUNK_OVERHEAD_S
        ready = 0.0  # when this chunk's input is available to stage j
        for j in range(stages):
            begin = max(ready, finish[j])
            finish[j] = begin + t
            ready = finish[j] + (transfer.seconds(c * hop_bytes) if j < stages - 1 else 0)
        busy += t * stages
        start += c
    span = finish[-1]
    bubble = 1.0 - busy / (stages * span) if span > 0 else 0.0
    return pm.c0 + span, bubble


def cpp_seconds(
    cost: ClusterCostModel, new: int, cached: int, stages: int
) -> tuple[float, float, int]:
    """(seconds, bubble, chunk) with the best of ``CHUNK_SIZES`` for a ``stages``-node pipeline."""
    if stages <= 1:
        return cost.prefill.predict(new, cached), 0.0, new
    best: tuple[float, float, int] | None = None
    for chunk in CHUNK_SIZES:
        s, b = pipeline_seconds(cost, new, cached, stages, chunk)
        if best is None or s < best[0]:
            best = (s, b, chunk)
        if chunk >= new:
            break  # larger chunks are the same single chunk
    assert best is not None
    return best


def choose_pipeline(
    single_ttft_s: float,
    group_ttft_s: float,
    ttft_slo_s: float,
    new_tokens: int,
    min_tokens: int = DEFAULT_MIN_TOKENS,
    *,
    idle_s: float = 0.0,
    work_s: float = 0.0,
    max_idle: float = DEFAULT_MAX_IDLE,
) -> bool:
    """The conductor's per-request CPP rule: pipeline over a group when one node's
    TTFT estimate misses the SLO or the tokens to compute reach ``min_tokens``,
    and only if the group's estimate (its busiest member's queue + transfer +
    ``cpp_seconds``) is lower. Prompts that fit one node are never split.

    ``idle_s``: node-seconds the group's less busy members would sit idle
    waiting for the busiest (``sum(max(queues) - queue)``); the pipeline is
    refused when that exceeds ``max_idle`` of its work (``k x seconds``):
    under load, lining up k queues wastes capacity that other requests need."""
    if single_ttft_s <= ttft_slo_s and new_tokens < min_tokens:
        return False
    if idle_s > max_idle * work_s:
        return False
    return group_ttft_s < single_ttft_s


def tp_seconds(cost: ClusterCostModel, new: int, cached: int, nodes: int) -> float:
    """Cross-node tensor parallelism over ``nodes`` nodes: compute / k + 2 all-reduces per layer."""
    pm, cfg = cost.prefill, cost.config
    compute = (pm.predict(new, cached) - pm.c0) / nodes
    if nodes <= 1:
        return pm.c0 + compute
    msg = new * cfg.hidden_size * cfg.dtype_bytes
    allreduce = 2 * (nodes - 1) / nodes * msg / NET_BPS + 2 * (nodes - 1) * NET_LATENCY_S
    return pm.c0 + compute + 2 * cfg.num_layers * allreduce


def ttft_curve(
    cost: ClusterCostModel | None = None,
    lengths: tuple[int, ...] = PROMPT_LENGTHS,
    groups: tuple[int, ...] = (2, 4),
) -> list[dict[str, Any]]:
    """Unloaded TTFT per prompt length: single node, CPP over each group, TP over each."""
    cost = cost or analytic_cluster("llama2-70b")
    rows = []
    for n in lengths:
        row: dict[str, Any] = {"tokens": n, "single_s": cost.prefill.predict(n, 0)}
        for k in groups:
            s, bubble, chunk = cpp_seconds(cost, n, 0, k)
            row[f"cpp{k}_s"] = s
            row[f"cpp{k}_bubble"] = bubble
            row[f"cpp{k}_chunk"] = chunk
            row[f"tp{k}_s"] = tp_seconds(cost, n, 0, k)
        rows.append(row)
    return rows


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
        self.hit_blocks += plan.reused_blocks
        self.total_blocks += len(r.keys)
        end = max([now] + [nodes[m].busy_until for m in members]) + seconds
        for m in members:
            nodes[m].busy_until = end
        self.predictor.add(rid, end)
        self._push(end, PREFILL_DONE, rid)

    def results(self, wall_s: float = 0.0) -> dict[str, Any]:
        out = super().results(wall_s)
        out["cpp_requests"] = self.cpp_requests
        out["cpp_mean_bubble"] = (
            self.cpp_bubble_sum / self.cpp_requests if self.cpp_requests else 0.0
        )
        return out


# -- CLI: kvpool sim-cpp ------------------------------------------------------------------


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "sim-cpp",
        help="TTFT vs prompt length: single node, pipeline (CPP) and cross-node TP",
        description="Unloaded TTFT of one prompt on the simulator's nodes (llama2-70b on 8 x "
        "H100 by default): a single node, chunked pipeline prefill over k nodes, and cross-node "
        "tensor parallelism over k nodes (two all-reduces per layer over 100 GB/s).",
    )
    p.add_argument("--model", default="llama2-70b")
    p.add_argument("--lengths", default=",".join(str(n) for n in PROMPT_LENGTHS))
    p.add_argument("--groups", default="2,4", help="node counts for CPP and TP")
    p.add_argument("--json", default=None, metavar="F")
    p.set_defaults(func=_run_cli)


def format_curve(rows: list[dict[str, Any]], groups: tuple[int, ...]) -> str:
    head = ["tokens", "single s"]
    for k in groups:
        head += [f"CPP{k} s", f"CPP{k} bubble", f"TP{k} s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [f"{r['tokens']:,}", f"{r['single_s']:.2f}"]
        for k in groups:
            cells += [
                f"{r[f'cpp{k}_s']:.2f} ({r['single_s'] / r[f'cpp{k}_s']:.2f}x)",
                f"{r[f'cpp{k}_bubble']:.3f}",
                f"{r[f'tp{k}_s']:.2f} ({r['single_s'] / r[f'tp{k}_s']:.2f}x)",
            ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _run_cli(args: argparse.Namespace) -> int:
    lengths = tuple(int(x) for x in args.lengths.split(",") if x.strip())
    groups = tuple(int(x) for x in args.groups.split(",") if x.strip())
    cost = analytic_cluster(args.model)
    rows = ttft_curve(cost, lengths, groups)
    print(format_curve(rows, groups))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump({"model": args.model, "rows": rows}, fh, indent=2)
            fh.write("\n")
    return 0

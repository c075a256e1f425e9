"""Timing model of chunked pipeline prefill (CPP) and cross-node tensor parallelism.

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

``choose_pipeline`` is the rule both the simulator (``sim.cpp.CppCluster``)
and the live conductor router use to decide whether to pipeline a prompt.
``kvpool sim-cpp`` prints ``ttft_curve`` (TTFT vs prompt length, 8k -> 128k).
"""

from __future__ import annotations

from typing import Any

from kvpool.serve.sched.cost_model import (
    ClusterCostModel,
    PrefillCostModel,
    TransferModel,
    analytic_cluster,
    attention_pairs,
)

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

"""``kvpool bench cpp``: long-prompt TTFT, one prefill worker vs a k-stage pipeline.

A real cluster (``kvpool master`` + one ``kvpool node``) and real stage
processes (``kvpool.serve.runtime.pipeline``), each with one torch thread, so on a
2-core machine the single worker uses one core and a 2-stage pipeline two —
the fair comparison the issue asks for. Both run the same code path (a
"pipeline" of 1 stage is the single worker) and store every block to the
pool, so TTFT includes the KV store.

1. chunk-size sweep: each configuration's TTFT for every ``--chunks`` size
   (one run each, a fresh random prompt per run so nothing is a cache hit);
2. the chosen (TTFT-minimising) chunk size of each configuration is re-run
   ``--rounds`` times, interleaved (1 worker, pipeline, 1 worker, ...), and
   the best of each is reported (a shared machine's neighbours only add time);
3. speedup = best single TTFT / best pipeline TTFT, and the median of the
   per-round ratios (each round's two runs back to back); pipeline bubble =
   the stages' idle share of the pipeline's span, ``1 - sum(busy) / (k *
   span)`` (measured), next to the equal-chunk ideal ``(k - 1) / (n + k - 1)``
   for n chunks. The load average before and after is recorded: the machine
   is shared, and other processes slow the two stages unevenly.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

import numpy as np

from kvpool.args import positive_int, positive_ints, size_arg
from kvpool.bench.common import write_json
from kvpool.procs import Child, spawn_kvpool


def register_cpp(suites: Any) -> None:
    p = suites.add_parser("cpp", help="long-prompt TTFT: 1 prefill worker vs a k-stage pipeline")
    p.add_argument("--tokens", type=positive_int, default=16384)
    p.add_argument("--stages", type=positive_int, default=2)
    p.add_argument("--preset", default="tiny")
    p.add_argument(
        "--chunks", type=positive_ints, default="512,1024,2048,4096", help="chunk sizes to sweep"
    )
    p.add_argument("--rounds", type=positive_int, default=3)
    p.add_argument(
        "--dram", type=size_arg, default="512MiB", help="the node's DRAM (holds a few prompts)"
    )
    p.add_argument("--json", default=None, metavar="F")
    p.set_defaults(func=_run)


def _cluster(dram: str) -> list[Child]:
    master = spawn_kvpool(["master", "--host", "127.0.0.1", "--port", "0"])
    procs = [master]
    try:
        node = ["node", "--master", master.address, "--dram", dram, "--heartbeat", "0.5"]
        procs.append(spawn_kvpool(node))
    except BaseException:
        master.stop()
        raise
    return procs


def run_cpp(
    tokens: int,
    stages: int,
    chunks: list[int],
    rounds: int,
    *,
    preset: str = "tiny",
    dram: str = "512MiB",
    log: Any = print,
) -> dict[str, Any]:
    from kvpool.serve.runtime.pipeline import CppGroup

    load_before = list(os.getloadavg())  # a shared machine: say how busy it was
    rng = np.random.default_rng(2026)
    procs = _cluster(dram)
    url = f"kvpool://{procs[0].address}"
    runs: list[dict[str, Any]] = []
    try:
        with (
            CppGroup(url, stages=1, preset=preset) as single,
            CppGroup(url, stages=stages, preset=preset) as pipe,
        ):
            groups = {1: single, stages: pipe}

            def once(k: int, chunk: int, phase: str) -> dict[str, Any]:
                prompt = rng.integers(0, 256, tokens)  # fresh: never a cache hit
                res = groups[k].prefill(prompt, chunk_tokens=chunk)
                t = res.timings
                n = int(t["chunks"])
                row = {
                    "phase": phase,
                    "stages": k,
                    "chunk": chunk,
                    "chunks": n,
                    "ttft_s": t["ttft_s"],
                    "commit_s": t["store_wait_s"],
                    "bubble": t["bubble"],
                    "ideal_bubble": (k - 1) / (n + k - 1),
                    "busy_s": t["busy_s"],
                    "stored_blocks": res.stored_blocks,
                }
                log(
                    f"{phase:6} stages={k} chunk={chunk:5} ttft={row['ttft_s']:.2f}s "
                    f"bubble={row['bubble']:.3f} (ideal {row['ideal_bubble']:.3f})"
                )
                runs.append(row)
                return row

            for k in groups:  # warm-up: torch kernels, the node's arena pages
                once(k, max(chunks), "warmup")
            best_chunk: dict[int, int] = {}
            for k in groups:
                sweep = [once(k, c, "sweep") for c in chunks]
                best_chunk[k] = min(sweep, key=lambda r: r["ttft_s"])["chunk"]
            final: dict[int, list[dict[str, Any]]] = {k: [] for k in groups}
            for _ in range(rounds):
                for k in groups:
                    final[k].append(once(k, best_chunk[k], "final"))
    finally:
        for proc in reversed(procs):
            proc.stop()
    best = {k: min(rows, key=lambda r: r["ttft_s"]) for k, rows in final.items()}
    one, pipe_best = best[1], best[stages]
    paired = sorted(a["ttft_s"] / b["ttft_s"] for a, b in zip(final[1], final[stages], strict=True))
    return {
        "tokens": tokens,
        "preset": preset,
        "stages": stages,
        "torch_threads_per_worker": 1,
        "chunk_single": best_chunk[1],
        "chunk_pipeline": best_chunk[stages],
        "ttft_single_s": one["ttft_s"],
        "ttft_pipeline_s": pipe_best["ttft_s"],
        "speedup": one["ttft_s"] / pipe_best["ttft_s"],
        "paired_speedups": paired,
        "median_paired_speedup": paired[len(paired) // 2],
        "loadavg_before": load_before,
        "loadavg_after": list(os.getloadavg()),
        "bubble": pipe_best["bubble"],
        "ideal_bubble": pipe_best["ideal_bubble"],
        "stage_busy_s": pipe_best["busy_s"],
        "runs": runs,
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def _run(args: argparse.Namespace) -> int:
    result = run_cpp(
        args.tokens, args.stages, args.chunks, args.rounds, preset=args.preset, dram=str(args.dram)
    )
    summary = {k: v for k, v in result.items() if k != "runs"}
    print(json.dumps(summary, indent=2))
    write_json(args.json, result)
    return 0

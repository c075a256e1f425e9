"""kvpool bench cpp, tiny: real cluster and stage processes, JSON shape."""

from __future__ import annotations

import torch

from kvpool.bench.cpp import run_cpp


def test_bench_cpp_small() -> None:
    torch.set_num_threads(1)
    res = run_cpp(256, 2, [64, 128], 1, dram="64MiB", log=lambda *_: None)
    assert res["chunk_single"] in (64, 128) and res["chunk_pipeline"] in (64, 128)
    assert res["ttft_single_s"] > 0 and res["ttft_pipeline_s"] > 0
    assert res["speedup"] == res["ttft_single_s"] / res["ttft_pipeline_s"]
    assert len(res["paired_speedups"]) == 1 and res["median_paired_speedup"] > 0
    assert 0 <= res["bubble"] < 1 and len(res["stage_busy_s"]) == 2
    phases = [r["phase"] for r in res["runs"]]
    assert phases.count("sweep") == 4 and phases.count("final") == 2
    # 256 tokens in 512-token blocks: only the request's private tail block is stored
    assert all(r["stored_blocks"] == 0 for r in res["runs"])

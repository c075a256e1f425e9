"""Sections ``serve`` and ``serve_cli`` of ``kvpool bench gpu``: the reference runtime on CUDA.

1. Greedy equality: the ``tiny`` model's weights drawn once (on the CPU) and
   loaded into a CPU and a CUDA copy; the same prompts through
   ``PrefillWorker`` + ``DecodeEngine`` (the path ``kvpool serve`` runs),
   each with its own embedded pool; the greedy tokens must be equal.
2. In process, ``llama2-7b`` shapes with random bf16 weights on CUDA
   (``max_context`` raised to fit a 16k prompt; the preset says 4096):
   prefill TTFT of a 4k and a 16k prompt, the 4k prompt's prefix reused
   from the pool (TTFT with the cached prefix vs cold), and decode TBT at
   batch 1 and 16 (steady-state steps, every request admitted).
3. (``serve_cli``) ``kvpool serve --device cuda --model llama2-7b`` as its own processes
   (master, node, one prefill and one decode worker) under a short load
   from ``kvpool bench serve``'s client: TTFT/TBT as the HTTP client sees
   them, and no errors.

Dry run: 1 with the CPU model against itself, 2 with ``tiny`` on the CPU,
3 with ``kvpool serve --model tiny`` on the CPU; the CUDA parts are named
as skipped.
"""

from __future__ import annotations

import gc
import statistics
import time
from dataclasses import asdict, replace
from typing import Any

from kvpool.bench.gpu_common import Section, shm_free_bytes, sync

GiB = 1 << 30


def run_serve(s: Section, long_tokens: int) -> None:
    """Parts 1 and 2 (section ``serve``)."""
    _greedy_equal(s)
    s.check_time("llama2-7b in process")
    _in_process(s, long_tokens)


def _generate(model: Any, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    from kvpool.embedded.pool import Pool
    from kvpool.serve.runtime.decode import DecodeEngine
    from kvpool.serve.runtime.prefill import PrefillWorker

    with (
        Pool.embedded(dram_bytes=64 << 20) as pool,
        PrefillWorker(model, pool) as pw,
        DecodeEngine(model, pool, num_pages=256, max_batch=len(prompts)) as engine,
    ):
        firsts = {}
        for i, p in enumerate(prompts):
            res = pw.prefill(p, request_id=f"r{i}")
            firsts[res.request_id] = res.first_token
            engine.submit(res, new_tokens)
        done = engine.run()
    return [[firsts[f"r{i}"], *done[f"r{i}"]] for i in range(len(prompts))]


def _greedy_equal(s: Section) -> None:
    from kvpool.serve.runtime.model import build_model
    from kvpool.serve.sched.presets import get_preset

    cfg = get_preset("tiny").with_block_tokens(16)
    prompts = [[(7 * i + 3 * j) % 256 for j in range(40 + 9 * i)] for i in range(3)]
    cpu = build_model(cfg, seed=3)
    want = _generate(cpu, prompts, 24)
    if not s.cuda:
        s.skip("tiny greedy CUDA vs CPU", "needs CUDA; checked CPU against a second CPU run")
        s.check("tiny greedy tokens reproducible on CPU", _generate(cpu, prompts, 24) == want)
        return
    gpu = build_model(cfg, seed=3, device="cuda")
    own_weights = _generate(gpu, prompts, 24)
    gpu.load_state_dict(cpu.state_dict())
    got = _generate(gpu, prompts, 24)
    diverge = [
        next((j for j, (a, b) in enumerate(zip(g, w, strict=True)) if a != b), None)
        for g, w in zip(got, want, strict=True)
    ]
    s.check(
        "tiny greedy tokens equal on CUDA and CPU (same weights)",
        got == want,
        {"first_divergence": diverge},
    )
    # Informational: seeded weights are drawn by the device's own generator.
    s.figure("tiny_cuda_seeded_weights_same_tokens_as_cpu", own_weights == want)


def _in_process(s: Section, long_tokens: int) -> None:
    import torch

    from kvpool.embedded.pool import Pool
    from kvpool.serve.runtime.model import build_model
    from kvpool.serve.runtime.prefill import PrefillWorker
    from kvpool.serve.sched.presets import get_preset

    if s.cuda:
        preset, short, block = "llama2-7b", 4096, 512
        pool_bytes = min(10 * GiB, int(shm_free_bytes() * 0.7))
    else:
        s.skip("llama2-7b on CUDA", "needs CUDA (13.5 GB of bf16 weights); tiny on the CPU instead")
        preset, short, block, long_tokens = "tiny", 256, 16, 1024
        pool_bytes = 256 << 20
    cfg = get_preset(preset).with_block_tokens(block)
    cfg = replace(cfg, max_context=max(cfg.max_context, long_tokens + 64))
    start = time.perf_counter()
    model = build_model(cfg, seed=0, device=s.device)
    sync(s.device)
    s.figure(
        "model",
        {"preset": preset, "dtype": cfg.dtype, "build_s": round(time.perf_counter() - start, 2)},
    )
    kv_per_token = cfg.kv_layout().block_bytes // block
    gen = torch.Generator().manual_seed(1)

    def prompt(n: int) -> list[int]:
        return torch.randint(0, cfg.vocab_size, (n,), generator=gen).tolist()

    with Pool.embedded(dram_bytes=pool_bytes) as pool, PrefillWorker(model, pool) as pw:
        s.figure(
            "pool",
            {
                "dram_gib": round(pool_bytes / GiB, 1),
                "page_lock": pool.stats()["tiers"]["dram"]["page_lock"],
            },
        )
        pw.prefill(prompt(block + 7))  # warm-up: kernels, allocator, arena pages
        base = prompt(short)
        cold = pw.prefill(base)
        s.figure(f"ttft_{short}_cold_ms", _ms(cold))
        reuse = pw.prefill(base[: short - block] + prompt(block))
        s.figure(f"ttft_{short}_prefix_reuse_ms", _ms(reuse))
        s.figure("prefix_reuse_cached_tokens", reuse.cached_tokens)
        s.check(
            "prefix reused from the pool", reuse.cached_tokens >= short - block, reuse.cached_tokens
        )
        s.figure(
            "prefix_reuse_speedup", round(_ms(cold)["first_token"] / _ms(reuse)["first_token"], 2)
        )
        if long_tokens * kv_per_token > pool_bytes * 0.8:
            need = long_tokens * kv_per_token / GiB
            why = f"its KV ({need:.1f} GiB) does not fit the {pool_bytes / GiB:.1f} GiB pool"
            s.skip(f"TTFT {long_tokens} tokens", why + " (/dev/shm is too small)")
        else:
            s.check_time(f"prefill {long_tokens}")
            long = pw.prefill(prompt(long_tokens))
            s.figure(f"ttft_{long_tokens}_cold_ms", _ms(long))
            s.check(
                f"{long_tokens}-token prefill stored its blocks",
                long.stored_blocks == long_tokens // block,
                long.stored_blocks,
            )
        for batch in (1, 16):
            s.check_time(f"decode batch {batch}")
            s.figure(
                f"tbt_batch{batch}_ms",
                _decode_tbt(s, model, pool, pw, [prompt(256) for _ in range(batch)]),
            )
    del model, pw
    gc.collect()
    if s.cuda:
        torch.cuda.empty_cache()


def _ms(res: Any) -> dict[str, float]:
    t = res.timings
    return {
        "first_token": round((t["match_s"] + t["compute_s"]) * 1e3, 1),
        "with_store": round(t["total_s"] * 1e3, 1),
    }


def _decode_tbt(
    s: Section, model: Any, pool: Any, pw: Any, prompts: list[list[int]], steps: int = 16
) -> dict[str, float]:
    """Median / p90 step time once every request of the batch is running."""
    from kvpool.serve.runtime.decode import DecodeEngine

    longest = 256 + 4 * steps  # room for the steps taken while the batch fills
    pages = len(prompts) * (-(-(len(prompts[0]) + longest) // 16) + 1)
    with DecodeEngine(model, pool, num_pages=pages, max_batch=len(prompts)) as engine:
        for p in prompts:
            engine.submit(pw.prefill(p), longest)
        while len(engine.running) < len(prompts):
            s.check_time("the decode batch filling up")
            engine.step()
        times = []
        for _ in range(steps):
            sync(str(model.device.type))
            start = time.perf_counter()
            engine.step()
            sync(str(model.device.type))
            times.append(time.perf_counter() - start)
        engine.cancel({r.request_id for r in engine.running})
    times.sort()
    return {
        "p50": round(statistics.median(times) * 1e3, 2),
        "p90": round(times[int(0.9 * (len(times) - 1))] * 1e3, 2),
    }


def run_serve_cli(s: Section) -> None:
    """Part 3 (section ``serve_cli``): ``kvpool serve`` in its own processes."""
    from kvpool.bench.serve import start_server
    from kvpool.serve.runtime.http.load import make_prompts, run_load

    if s.cuda:
        extra = [
            "--model",
            "llama2-7b",
            "--device",
            "cuda",
            "--kv-tokens",
            "4096",
            "--dram",
            "4GiB",
        ]
        prompts = make_prompts(4, 1024, 512, seed=5)
    else:
        s.skip(
            "kvpool serve --device cuda", "needs CUDA; kvpool serve --model tiny on the CPU instead"
        )
        extra = ["--model", "tiny", "--dram", "256MiB", "--block-tokens", "16"]
        prompts = make_prompts(4, 64, 32, seed=5)
    start = time.perf_counter()
    server = start_server(extra, timeout=max(30.0, min(180.0, s.time_left() - 20)))
    s.figure("serve_start_s", round(time.perf_counter() - start, 1))
    try:
        result = run_load(
            server.url, concurrency=2, requests=len(prompts), max_tokens=8, prompts=prompts
        )
    finally:
        server.stop(30.0)
    s.figure("serve_load", asdict(result))
    s.check(
        "kvpool serve answered every request",
        result.errors == 0 and result.output_tokens == 8 * len(prompts),
        {"errors": result.errors, "tokens": result.output_tokens},
    )

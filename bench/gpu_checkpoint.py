"""Section ``checkpoint`` of ``kvpool bench gpu``: a Hugging Face checkpoint on CUDA.

For each of float32 and bfloat16, the benchmarks' tiny Llama checkpoint
(``kvpool.bench.tiny_checkpoint``: written here with ``safetensors`` and
``tokenizers``, no ``transformers``) is loaded by ``kvpool serve``'s model
code twice: on the CPU and on CUDA. The reference is the CPU run, not
``transformers``: the GPU machine gets only kvpool's runtime wheels (64 MiB
carry limit; ``transformers`` does not fit beside UCX), and CI proves the
CPU run equal to ``transformers`` on this same checkpoint format
(tests/test_serve_bench_checkpoint.py, tests/test_serve_hf.py).

Compared, CUDA against CPU:

1. logits of a 700-token prompt (two 512-token blocks): max abs difference,
   checked within ``TOLERANCE`` of the dtype;
2. greedy tokens and their logprobs (top 5) through ``PrefillWorker`` ->
   embedded pool -> ``DecodeEngine`` (the path ``kvpool serve`` runs) for
   three prompts: float32 must give the same tokens; bfloat16 reports where
   the first token differs (a rounding difference may flip a close call);
3. decode tokens/s on CUDA at batch 1 and 8 (figures).

Dry run: a 2-layer checkpoint, short prompts, the CPU run against a second
CPU run (tokens equal, logprobs within 1e-4), the CUDA parts named as skipped.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from kvpool.bench.gpu_common import Section, sync

#: Max abs logit difference CUDA vs CPU accepted per dtype (the logits are O(10)).
TOLERANCE = {"float32": 1e-3, "bfloat16": 0.25}
NEW_TOKENS = 16


def run_checkpoint(s: Section) -> None:
    from kvpool.bench.tiny_checkpoint import TinyShape, write_tiny_checkpoint

    # the dry run only walks the code: 2 layers, short prompts (bf16 is slow on a CPU)
    shape = TinyShape(layers=2) if s.dry_run else TinyShape()
    for dtype in ("float32", "bfloat16"):
        s.check_time(f"the {dtype} checkpoint")
        path = write_tiny_checkpoint(
            Path(s.scratch) / f"kvpool-tiny-{dtype}", dtype=dtype, shape=shape
        )
        _compare(s, path, dtype)


def _prompts(dry_run: bool) -> list[list[int]]:
    import torch

    gen = torch.Generator().manual_seed(7)
    lengths = (20, 50, 90) if dry_run else (40, 300, 700)
    return [torch.randint(2, 258, (n,), generator=gen).tolist() for n in lengths]


def _generate(model: Any, prompts: list[list[int]], new_tokens: int) -> tuple[list, list]:
    """Greedy tokens and (logprob, top-5) per token, through prefill -> pool -> decode."""
    from kvpool.embedded.pool import Pool
    from kvpool.serve.runtime.decode import DecodeEngine
    from kvpool.serve.runtime.prefill import PrefillWorker
    from kvpool.serve.runtime.sampling import SamplingParams

    params = SamplingParams(logprobs=5)
    tokens: dict[str, list[int]] = {}
    lps: dict[str, list[Any]] = {}
    with (
        Pool.embedded(dram_bytes=64 << 20) as pool,
        PrefillWorker(model, pool) as pw,
        DecodeEngine(model, pool, num_pages=512, max_batch=len(prompts)) as engine,
    ):
        for i, p in enumerate(prompts):
            engine.submit(
                pw.prefill(p, request_id=f"r{i}", sampling=params), new_tokens, sampling=params
            )
        while not engine.idle:
            for ev in engine.step():
                tokens.setdefault(ev.request_id, []).append(ev.token)
                lps.setdefault(ev.request_id, []).append(ev.logprobs)
    order = [f"r{i}" for i in range(len(prompts))]
    return [tokens[r] for r in order], [lps[r] for r in order]


def _lp_diff(a: list[list[Any]], b: list[list[Any]]) -> float:
    """Max abs difference of the sampled tokens' logprobs (same positions)."""
    return max(
        (
            abs(x[0] - y[0])
            for ra, rb in zip(a, b, strict=True)
            for x, y in zip(ra, rb, strict=True)
        ),
        default=0.0,
    )


def _first_divergence(a: list[list[int]], b: list[list[int]]) -> list[int | None]:
    return [
        next((j for j, (x, y) in enumerate(zip(ra, rb, strict=True)) if x != y), None)
        for ra, rb in zip(a, b, strict=True)
    ]


def _compare(s: Section, path: Path, dtype: str) -> None:
    from kvpool.serve.runtime.model import build_model

    prompts = _prompts(s.dry_run)
    new_tokens = 6 if s.dry_run else NEW_TOKENS
    cpu = build_model(str(path))
    want, want_lp = _generate(cpu, prompts, new_tokens)
    if not s.cuda:
        s.skip(f"{dtype} checkpoint CUDA vs CPU", "needs CUDA; the CPU run against a second one")
        got, got_lp = _generate(cpu, prompts, new_tokens)
        s.check(f"{dtype} checkpoint greedy tokens reproducible on CPU", got == want)
        # the batch's composition (when each load finishes) changes the float sums a little
        s.check(
            f"{dtype} checkpoint logprobs reproducible on CPU",
            _lp_diff(got_lp, want_lp) <= 1e-4,
            {"max_abs_diff": _lp_diff(got_lp, want_lp)},
        )
        s.figure(f"{dtype}_cpu_decode_tokens_per_s_batch2", _tokens_per_s(cpu, 2, 4, 32))
        return
    import torch

    gpu = build_model(str(path), device="cuda")
    long = prompts[-1]
    diff = float((gpu(long)[0].float().cpu() - cpu(long)[0].float()).abs().max())
    s.check(
        f"{dtype} checkpoint logits CUDA vs CPU within {TOLERANCE[dtype]}",
        diff <= TOLERANCE[dtype],
        {"max_abs_diff": diff},
    )
    got, got_lp = _generate(gpu, prompts, new_tokens)
    divergence = _first_divergence(got, want)
    detail = {"first_divergence": divergence}
    if dtype == "float32":
        s.check(f"{dtype} checkpoint greedy tokens equal on CUDA and CPU", got == want, detail)
        s.check(
            f"{dtype} checkpoint logprobs CUDA vs CPU within {TOLERANCE[dtype]}",
            _lp_diff(got_lp, want_lp) <= TOLERANCE[dtype],
            {"max_abs_diff": _lp_diff(got_lp, want_lp)},
        )
    else:
        s.figure(f"{dtype}_greedy_first_divergence_vs_cpu", divergence)
        s.check(
            f"{dtype} checkpoint first token equal on CUDA and CPU",
            all(d != 0 for d in divergence),
            detail,
        )
    for batch in (1, 8):
        s.check_time(f"{dtype} decode batch {batch}")
        s.figure(f"{dtype}_decode_tokens_per_s_batch{batch}", _tokens_per_s(gpu, batch))
    del gpu
    torch.cuda.empty_cache()


def _tokens_per_s(model: Any, batch: int, new_tokens: int = 64, prompt_tokens: int = 128) -> float:
    """Output tokens/s of ``batch`` requests decoded together (prefill excluded)."""
    from kvpool.embedded.pool import Pool
    from kvpool.serve.runtime.decode import DecodeEngine
    from kvpool.serve.runtime.prefill import PrefillWorker

    prompts = [[2 + (i * 31 + j) % 256 for j in range(prompt_tokens)] for i in range(batch)]
    with (
        Pool.embedded(dram_bytes=64 << 20) as pool,
        PrefillWorker(model, pool) as pw,
        # loads in the step that admits them: the whole batch starts decoding together
        DecodeEngine(
            model, pool, num_pages=batch * 16 + 8, max_batch=batch, overlap_loads=False
        ) as engine,
    ):
        for p in prompts:
            engine.submit(pw.prefill(p), new_tokens)
        engine.step()
        if len(engine.running) != batch:
            raise RuntimeError(f"{len(engine.running)} of {batch} requests joined the batch")
        sync(str(model.device.type))
        start, emitted = time.perf_counter(), 0
        while not engine.idle:
            emitted += len(engine.step())
        sync(str(model.device.type))
        return round(emitted / (time.perf_counter() - start), 1)

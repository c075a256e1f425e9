"""Runs inside the engine venv (.venv-engines): one vLLM CPU instance, one JSON job.

    python tests/engines/vllm_driver.py JOB.json OUT.json

``make_checkpoint`` writes the tiny Llama the tests use (transformers
``save_pretrained``); ``run`` starts ``vllm.LLM`` on it, optionally with the
kvpool connector, runs the job's rounds of token-id prompts and writes the
greedy tokens, ``num_cached_tokens``, the time to first token and the
connector's stats. A separate process per instance: each gets an empty local
cache, as a fresh vLLM would.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any


def make_checkpoint(path: str, *, layers: int = 2, seed: int = 0) -> None:
    """A tiny random Llama (hidden 128, 4 heads, 2 KV heads, bf16) saved at ``path``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=1024,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=8192,
        torch_dtype="bfloat16",
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(path)


def run(job: dict[str, Any]) -> dict[str, Any]:
    if job.get("uni", True):
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    kwargs: dict[str, Any] = dict(
        model=job["model"],
        skip_tokenizer_init=True,
        enforce_eager=True,
        block_size=32,
        max_model_len=job.get("max_model_len", 4096),
        enable_prefix_caching=job.get("prefix_caching", False),
        seed=0,
    )
    if job.get("uni", True):
        kwargs["distributed_executor_backend"] = "uni"
    if job.get("kv"):
        kwargs["kv_transfer_config"] = KVTransferConfig(**job["kv"])
    started = time.perf_counter()
    llm = LLM(**kwargs)
    startup_s = time.perf_counter() - started
    params = SamplingParams(temperature=0.0, max_tokens=job.get("max_tokens", 8), detokenize=False)
    rounds = []
    for prompts in job["rounds"]:
        t0 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        wall = time.perf_counter() - t0
        rounds.append(
            {
                "tokens": [list(o.outputs[0].token_ids) for o in outs],
                "cached": [o.num_cached_tokens for o in outs],
                "wall_s": wall,
            }
        )
        if job.get("kv") and job.get("uni", True):
            from kvpool.bindings.vllm import process_totals

            rounds[-1]["connector"] = process_totals()
    result: dict[str, Any] = {"startup_s": startup_s, "rounds": rounds}
    if job.get("kv") and job.get("uni", True):
        from dataclasses import asdict

        from vllm.distributed.kv_transfer import get_kv_transfer_group

        from kvpool.bindings.vllm import process_totals

        connector = get_kv_transfer_group()
        result["connector"] = totals = process_totals()
        result["geometry"] = asdict(connector.geometry)
        # vLLM's stats path: rebuilt from the plain dict, summed over workers, reduced
        stats = type(connector).build_kv_connector_stats(totals)
        result["stats_reduced"] = stats.aggregate(
            type(connector).build_kv_connector_stats(totals)
        ).reduce()
    return result


if __name__ == "__main__":
    if sys.argv[1] == "checkpoint":
        make_checkpoint(sys.argv[2], layers=int(sys.argv[3]) if len(sys.argv) > 3 else 2)
    else:
        with open(sys.argv[1]) as f:
            job = json.load(f)
        out = run(job)
        with open(sys.argv[2], "w") as f:
            json.dump(out, f)

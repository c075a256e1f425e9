"""Section ``layerwise`` of ``kvpool bench gpu``: layer-wise store/load behind real GPU compute.

A prefill of ``tokens`` tokens through llama2-7b-shaped layers on CUDA:
per layer the QKV, output and SwiGLU MLP matmuls at their real sizes (bf16;
one layer's weights reused for every layer), K and V of the layer cut from
the QKV product into that layer's KV buffers. ``LayerWriter`` stores each
layer from those CUDA buffers on its side stream (after a CUDA event on
the compute stream) while the next layers compute; ``LayerReader`` loads
layers into CUDA buffers one layer ahead of the compute that uses them.

Reported (best of interleaved rounds, device synchronised): compute alone,
store alone, overlapped, and overlap_ratio = overlapped / max(compute,
store); target <= 1.1. The same for loading. Every stored byte is read back
and compared with the KV buffers it came from.

Dry run: a small layout and CPU tensors, same writer/reader calls; the CUDA
side streams are named as skipped.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from kvpool.bench.gpu_common import MiB, Section, same_bytes, sync


def run_layerwise(s: Section, tokens: int) -> None:
    import torch

    from kvpool.embedded.pool import Pool
    from kvpool.index.keys import Namespace, block_keys
    from kvpool.layerwise import LayerReader, LayerWriter
    from kvpool.layout import KVLayout

    if s.cuda:
        layers, heads, head_dim, hidden, ffn, block = 32, 32, 128, 4096, 11008, 512
    else:
        s.skip(
            "CUDA side streams",
            "needs CUDA; the writer/reader copy on the calling thread's CPU path",
        )
        layers, heads, head_dim, hidden, ffn, block = 4, 4, 32, 128, 344, 64
        tokens = min(tokens, 4 * block)
    layout = KVLayout(layers, heads, head_dim, "bfloat16", block)
    n_blocks = tokens // block
    tokens = n_blocks * block
    keys = block_keys(
        torch.zeros(tokens, dtype=torch.int64).numpy(),
        Namespace("gpu-check", layout=layout),
        block_tokens=block,
    )
    dev, bf16 = s.device, torch.bfloat16
    gen = torch.Generator(device=dev).manual_seed(0)

    def rand(*shape: int) -> Any:
        return (torch.randn(*shape, generator=gen, device=dev) * shape[0] ** -0.5).to(bf16)

    w_qkv, w_o = rand(hidden, 3 * hidden), rand(hidden, hidden)
    w_up, w_down = rand(hidden, 2 * ffn), rand(ffn, hidden)
    x = rand(tokens, hidden)
    kv = [
        (
            torch.empty(tokens, heads, head_dim, dtype=bf16, device=dev),
            torch.empty(tokens, heads, head_dim, dtype=bf16, device=dev),
        )
        for _ in range(layers)
    ]
    outs = [(torch.empty_like(k), torch.empty_like(v)) for k, v in kv]
    s.figure(
        "shape",
        {
            "layers": layers,
            "tokens": tokens,
            "hidden": hidden,
            "ffn": ffn,
            "kv_heads": heads,
            "layer_kv_mib": round(2 * kv[0][0].numel() * 2 / MiB, 1),
        },
    )

    def compute(layer: int) -> None:
        qkv = x @ w_qkv
        k, v = kv[layer]
        k.copy_(qkv[:, hidden : 2 * hidden].view(tokens, heads, head_dim))
        v.copy_(qkv[:, 2 * hidden :].view(tokens, heads, head_dim))
        h = qkv[:, :hidden] @ w_o
        gate_up = h @ w_up
        _ = (torch.nn.functional.silu(gate_up[:, :ffn]) * gate_up[:, ffn:]) @ w_down

    capacity = n_blocks * layout.block_bytes + 64 * MiB
    pool = Pool.embedded(dram_bytes=capacity)
    s.figure("arena_page_lock", pool.stats()["tiers"]["dram"]["page_lock"])

    def clear() -> None:
        for key in keys:
            pool.remove(key)

    def compute_all() -> None:
        for layer in range(layers):
            compute(layer)

    def store_only() -> None:
        with LayerWriter(pool, keys, layout) as w:
            for layer in range(layers):
                w.write_layer(layer, *kv[layer])

    def store_overlapped() -> None:
        with LayerWriter(pool, keys, layout) as w:
            for layer in range(layers):
                compute(layer)
                w.write_layer(layer, *kv[layer])

    def load_only() -> None:
        with LayerReader(pool, keys, layout, out=outs) as r:
            for layer in range(layers):
                r.wait_layer(layer)

    def load_overlapped() -> None:
        with LayerReader(pool, keys, layout, out=outs) as r:
            for layer in range(layers):
                r.wait_layer(layer)
                compute(layer)

    try:
        compute_all()
        store_overlapped()  # warm-up, and the stored KV is what compute_all wrote
        load_only()
        bad = [
            i
            for i in range(layers)
            if not (same_bytes(outs[i][0], kv[i][0]) and same_bytes(outs[i][1], kv[i][1]))
        ]
        s.check("layer-wise store+load exact bytes, every layer", not bad, f"bad layers: {bad}")
        clear()
        nbytes = n_blocks * layout.block_bytes
        _measure(s, "store", nbytes, compute_all, store_only, store_overlapped, clear)
        store_only()  # the load rounds read what this stores
        _measure(s, "load", nbytes, compute_all, load_only, load_overlapped, None)
    finally:
        pool.close()


def _best_of(
    s: Section,
    ops: list[tuple[str, Callable[[], None], Callable[[], None] | None]],
    rounds: int = 7,
) -> dict[str, float]:
    """Best wall time of each op over interleaved rounds (noise only adds time)."""
    best: dict[str, float] = {}
    for r in range(rounds):
        for name, op, reset in ops:
            sync(s.device)
            start = time.perf_counter()
            op()
            sync(s.device)
            took = time.perf_counter() - start
            best[name] = min(took, best.get(name, took))
            if reset is not None:
                reset()
        if r >= 2 and s.time_left() < 5:
            break
    return best


def _measure(
    s: Section,
    what: str,
    nbytes: int,
    compute: Callable[[], None],
    copy: Callable[[], None],
    both: Callable[[], None],
    reset: Callable[[], None] | None,
) -> None:
    """Best of compute alone, the copy alone, and both overlapped; their ratio."""
    best = _best_of(
        s, [("compute_s", compute, None), ("copy_s", copy, reset), ("overlapped_s", both, reset)]
    )
    for name, value in best.items():
        s.figure(f"{what}_{name}", round(value, 5))
    ratio = round(best["overlapped_s"] / max(best["compute_s"], best["copy_s"]), 3)
    s.figure(f"{what}_overlap_ratio", ratio)
    s.figure(f"{what}_compute_to_copy", round(best["compute_s"] / best["copy_s"], 2))
    s.figure(f"{what}_gbps", round(nbytes / best["copy_s"] / 1e9, 2))
    if s.cuda:
        s.check(f"{what} overlap ratio <= 1.1", ratio <= 1.1, ratio)

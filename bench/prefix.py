"""``kvpool bench prefix``: hash a long prompt and match it against a big catalog.

The catalog is a real embedded pool holding ``catalog_blocks`` committed
blocks (tiny payloads, so it fits in a small arena); the prompt shares its
first half with blocks in the catalog. One sample = ``block_keys`` over the
whole prompt + ``prefix_match`` of the resulting keys.
"""

from __future__ import annotations

import time

import numpy as np

from kvpool.config import PoolConfig
from kvpool.embedded.pool import Pool
from kvpool.index.keys import Namespace, block_keys


def run_prefix(tokens: int, catalog_blocks: int, samples: int) -> dict[str, float | int]:
    namespace = Namespace("llama2-70b")
    prompt = np.random.default_rng(1).integers(0, 32_000, tokens, dtype=np.int64)
    prompt_keys = block_keys(prompt, namespace)
    shared = len(prompt_keys) // 2
    config = PoolConfig(dram_bytes=(catalog_blocks + 1) * 64, alignment=64)
    with Pool(config) as pool:
        _fill_catalog(pool, namespace, prompt_keys[:shared], catalog_blocks)
        assert pool.prefix_match(prompt_keys) == shared
        hash_s, match_s, total_s = [], [], []
        clock = time.perf_counter
        for _ in range(samples):
            start = clock()
            keys = block_keys(prompt, namespace)
            hashed = clock()
            matched = pool.prefix_match(keys)
            end = clock()
            assert matched == shared
            hash_s.append(hashed - start)
            match_s.append(end - hashed)
            total_s.append(end - start)
    return {
        "tokens": tokens,
        "catalog_blocks": catalog_blocks,
        "matched_blocks": shared,
        "p50_us": _us(total_s, 50),
        "p99_us": _us(total_s, 99),
        "hash_p50_us": _us(hash_s, 50),
        "match_p50_us": _us(match_s, 50),
    }


def _fill_catalog(pool: Pool, namespace: Namespace, shared: list[bytes], total: int) -> None:
    """Commit ``total`` blocks: the prompt's shared prefix plus unrelated chains."""
    pool.put_batch(shared, [b"k"] * len(shared))
    filler = total - len(shared)
    chunk = 65_536
    tokens = np.random.default_rng(2).integers(0, 32_000, filler * 4, dtype=np.int32)
    for start in range(0, filler, chunk):
        part = tokens[start * 4 : min(filler, start + chunk) * 4]
        keys = block_keys(part, namespace, block_tokens=4)
        pool.put_batch(keys, [b"k"] * len(keys))


def _us(samples: list[float], q: float) -> float:
    return round(float(np.percentile(samples, q)) * 1e6, 1)

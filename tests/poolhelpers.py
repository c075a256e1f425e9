"""Helpers shared by test modules (tests/ is on sys.path via pytest's pythonpath)."""

from __future__ import annotations

import mmap
from typing import Any

import numpy as np

from kvpool import Namespace, block_keys

BLOCK = 64 << 10  # payload size used by most pool tests


def make_keys(n: int, seed: int = 0) -> list[bytes]:
    """n chained keys of a deterministic token stream (16 tokens per block)."""
    tokens = np.random.default_rng(seed).integers(0, 32_000, n * 16)
    return block_keys(tokens, Namespace("test-model"), block_tokens=16)


def payload(i: int, size: int = BLOCK) -> np.ndarray:
    """Distinct, non-constant bytes for block i."""
    return (np.arange(size, dtype=np.uint32) * 2654435761 + i * 40503).astype(np.uint8)


def has_cuda() -> bool:
    """What the GPU paths themselves check: a CUDA device torch can use (the
    driver alone is not enough: a CPU build of torch on a GPU host has none).

    Imports torch when called, not when this module is imported: the client
    scripts that tests run in subprocesses import this module too."""
    import torch

    return bool(torch.cuda.is_available())


def aligned(nbytes: int, seed: int) -> np.ndarray:
    """Page-aligned anonymous memory (what O_DIRECT needs) with bytes unique to ``seed``."""
    array = np.frombuffer(mmap.mmap(-1, nbytes), dtype=np.uint8)
    array[:] = np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)
    return array


def ssd_tier_holding(directory: str, sizes: list[int]) -> tuple[Any, list[Any], list[np.ndarray]]:
    """An SSD tier of 64 MiB in ``directory`` that stored one block of each size
    (from page-aligned slots, as the pool's demotions do): (the tier, the blocks'
    records, the blocks' bytes). The caller closes the tier."""
    from kvpool.eviction import make_policy
    from kvpool.storage.ssd_tier import SsdTier

    tier = SsdTier(directory, 64 << 20, make_policy("lru"))
    records, blocks = [], []
    for i, size in enumerate(sizes):
        slot = aligned(-(-size // 4096) * 4096, 30 + i)
        records.append(tier.store(bytes([i]) * 16, slot, size, None))
        blocks.append(slot[:size].copy())
    return tier, records, blocks

"""Runs inside the engine venv: drives KVPoolStorage the way SGLang's cache controller does.

    python tests/engines/sglang_driver.py JOB.json OUT.json

The backend is created by SGLang's own ``StorageBackendFactory`` from a
``HiCacheStorageConfig`` (the ``dynamic`` path an ``--hicache-storage-backend
dynamic`` server takes), registered with a host pool, then called as the
controller calls it: ``batch_set_v1`` for write-back (``_page_set_zero_copy``),
``batch_exists`` then ``batch_get_v1`` for prefetch (``_page_get_zero_copy``),
``batch_set``/``batch_get`` on flat pages for the generic path. Page keys are
SGLang's own hash chain (``get_hash_str``).

The host pool is ``PageFirstHostPool``: SGLang's ``page_first`` MHA host
layout (``[2, size, layers, heads, head_dim]``) and its
``get_page_buffer_meta`` formula (K and V pointer per page), on a plain CPU
tensor. SGLang's ``MHATokenToKVPoolHost`` itself cannot be imported without
its GPU/vision stack (torchvision, CUDA kernels).
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import torch

LAYERS, HEADS, HEAD_DIM, PAGE = 2, 2, 64, 16


class PageFirstHostPool:
    """SGLang's page_first MHA host pool layout over one CPU tensor."""

    layout = "page_first"

    def __init__(self, size: int, seed: int | None) -> None:
        self.size, self.page_size, self.dtype = size, PAGE, torch.bfloat16
        self.layer_num, self.head_num, self.head_dim = LAYERS, HEADS, HEAD_DIM
        shape = (2, size, LAYERS, HEADS, HEAD_DIM)
        if seed is None:
            self.kv_buffer = torch.zeros(shape, dtype=self.dtype)
        else:
            gen = torch.Generator().manual_seed(seed)
            self.kv_buffer = torch.randn(shape, generator=gen).to(self.dtype)

    def get_page_buffer_meta(self, indices: torch.Tensor) -> tuple[list[int], list[int]]:
        item = self.dtype.itemsize
        token_bytes = self.layer_num * self.head_num * self.head_dim * item
        base, v_offset = self.kv_buffer.data_ptr(), self.size * token_bytes
        ptrs: list[int] = []
        ids = indices.tolist()
        for i in range(0, len(ids), self.page_size):
            k_ptr = base + ids[i] * token_bytes
            ptrs += [k_ptr, k_ptr + v_offset]
        return ptrs, [self.page_size * token_bytes] * len(ptrs)

    def page(self, first_index: int) -> torch.Tensor:
        """K and V of the page starting at ``first_index`` (a copy, for comparisons)."""
        return self.kv_buffer[:, first_index : first_index + self.page_size].clone()


def backend(extra: dict[str, Any], *, tp_rank: int = 0, tp_size: int = 1, mla: bool = False):
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig
    from sglang.srt.mem_cache.storage import StorageBackendFactory

    config = HiCacheStorageConfig(
        tp_rank=tp_rank,
        tp_size=tp_size,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=mla,
        enable_storage_metrics=False,
        is_page_first_layout=True,
        model_name="tiny-llama",
        extra_config={
            "backend_name": "kvpool",
            "module_path": "kvpool.bindings.sglang",
            "class_name": "KVPoolStorage",
            "interface_v1": 1,
            **extra,
        },
    )
    storage = StorageBackendFactory.create_backend("dynamic", config, None)
    assert isinstance(storage, HiCacheStorage)
    return storage


def page_keys(seed: int, pages: int) -> list[str]:
    from sglang.srt.mem_cache.utils import get_hash_str

    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1, 30000, (pages * PAGE,), generator=gen).tolist()
    keys, prior = [], None
    for i in range(pages):
        prior = get_hash_str(tokens[i * PAGE : (i + 1) * PAGE], prior)
        keys.append(prior)
    return keys


def write(job: dict[str, Any]) -> dict[str, Any]:
    """Write-back: ``pages`` pages from host slots 0.. via batch_set_v1, then again."""
    pool = PageFirstHostPool(job["pages"] * PAGE, seed=job["seed"])
    storage = backend(job["extra"])
    storage.register_mem_pool_host(pool)
    keys = page_keys(job["seed"], job["pages"])
    indices = torch.arange(job["pages"] * PAGE)
    first = storage.batch_set_v1(keys, indices)
    again = storage.batch_set_v1(keys, indices)  # stored already: not written twice
    flat = [pool.page(i * PAGE).reshape(-1) for i in range(2)]
    generic_keys = [k + ":generic" for k in keys[:2]]
    generic = storage.batch_set(generic_keys, flat)
    return {"first": first, "again": again, "generic": generic, "stats": storage.get_stats()}


def read(job: dict[str, Any]) -> dict[str, Any]:
    """Prefetch in a fresh process: exists, then zero-copy reads into other host slots."""
    pages = job["pages"]
    expected = PageFirstHostPool(pages * PAGE, seed=job["seed"])
    pool = PageFirstHostPool(2 * pages * PAGE, seed=None)
    storage = backend(job["extra"])
    storage.register_mem_pool_host(pool)
    keys = page_keys(job["seed"], pages)
    unknown = page_keys(job["seed"] + 1, 2)
    hit = storage.batch_exists(keys + unknown)
    # the controller reads the hit prefix into freshly allocated host slots
    dst = torch.arange(pages * PAGE, 2 * pages * PAGE)
    got = storage.batch_get_v1(keys, dst)
    same = [
        bool(torch.equal(pool.page(pages * PAGE + i * PAGE), expected.page(i * PAGE)))
        for i in range(pages)
    ]
    missing = storage.batch_get_v1(unknown, torch.arange(2 * PAGE))
    flat = [
        torch.empty(2 * PAGE * LAYERS * HEADS * HEAD_DIM, dtype=torch.bfloat16) for _ in range(2)
    ]
    generic = storage.batch_get([k + ":generic" for k in keys[:2]], flat)
    generic_same = [
        g is not None and bool(torch.equal(g, expected.page(i * PAGE).reshape(-1)))
        for i, g in enumerate(generic)
    ]
    other_rank = backend(job["extra"], tp_rank=1, tp_size=2)
    other_rank.register_mem_pool_host(pool)
    mla = [backend(job["extra"], tp_rank=r, tp_size=2, mla=True) for r in (0, 1)]
    return {
        "hit": hit,
        "got": got,
        "same": same,
        "missing": missing,
        "generic_same": generic_same,
        "exists_first": storage.exists(keys[0]),
        "other_rank_hit": other_rank.batch_exists(keys),
        "mla_shared": mla[0].block_key(keys[0]) == mla[1].block_key(keys[0]),
        "mla_differs_from_mha": mla[0].block_key(keys[0]) != storage.block_key(keys[0]),
    }


def partial(job: dict[str, Any]) -> dict[str, Any]:
    """A page that lost one of its pieces (K and V are a block each): a miss from
    there on, and the next write-back stores only that piece."""
    pages = job["pages"]
    pool = PageFirstHostPool(2 * pages * PAGE, seed=job["seed"])
    storage = backend(job["extra"])
    storage.register_mem_pool_host(pool)
    keys = page_keys(job["seed"], pages)
    src = torch.arange(pages * PAGE)
    wrote = storage.batch_set_v1(keys, src)
    store = storage.store.get()
    removed = store.remove(storage.piece_keys(keys[2])[1])  # page 2's V only
    dst = torch.arange(pages * PAGE, 2 * pages * PAGE)
    out = {
        "pieces": storage.pieces,
        "wrote": wrote,
        "removed": removed,
        "hit": storage.batch_exists(keys),
        "exists": [storage.exists(k) for k in keys],
        "got": storage.batch_get_v1(keys, dst),
    }
    before = storage.get_stats()
    out["rewrote"] = storage.batch_set_v1(keys, src)
    after = storage.get_stats()
    out["set"] = after["pages_set"] - before["pages_set"]
    out["skipped"] = after["pages_skipped"] - before["pages_skipped"]
    out["hit_after"] = storage.batch_exists(keys)
    out["got_after"] = storage.batch_get_v1(keys, dst)
    out["same"] = [
        bool(torch.equal(pool.page(pages * PAGE + i * PAGE), pool.page(i * PAGE)))
        for i in range(pages)
    ]
    return out


def mismatch(job: dict[str, Any]) -> dict[str, Any]:
    """Calls whose counts disagree (an engine bug) raise a clear error and store or
    read nothing; the same backend then works."""
    pool = PageFirstHostPool(4 * PAGE, seed=job["seed"])
    storage = backend(job["extra"])
    keys = page_keys(job["seed"], 2)
    flat = [pool.page(0).reshape(-1)]
    calls = {
        "unregistered": lambda: storage.batch_set_v1(keys, torch.arange(2 * PAGE)),
        "set_v1": lambda: storage.batch_set_v1(keys, torch.arange(PAGE)),
        "get_v1": lambda: storage.batch_get_v1(keys, torch.arange(3 * PAGE)),
        "batch_set": lambda: storage.batch_set(keys, flat),
        "batch_get": lambda: storage.batch_get(keys, flat),
    }
    out: dict[str, Any] = {}
    for name, call in calls.items():
        if name == "set_v1":
            storage.register_mem_pool_host(pool)
        try:
            out[name] = f"returned {call()!r}"
        except (RuntimeError, ValueError) as exc:
            out[name] = f"{type(exc).__name__}: {exc}"
    out["hit_after_errors"] = storage.batch_exists(keys)
    out["wrote"] = storage.batch_set_v1(keys, torch.arange(2 * PAGE))
    out["hit"] = storage.batch_exists(keys)
    return out


def down(job: dict[str, Any]) -> dict[str, Any]:
    """A pool that is not there: misses and failed writes, quickly, no exception."""
    pool = PageFirstHostPool(2 * PAGE, seed=0)
    storage = backend(job["extra"])
    storage.register_mem_pool_host(pool)
    keys = page_keys(0, 2)
    started = time.perf_counter()
    out = {
        "hit": storage.batch_exists(keys),
        "set": storage.batch_set_v1(keys, torch.arange(2 * PAGE)),
        "get": storage.batch_get_v1(keys, torch.arange(2 * PAGE)),
    }
    out["seconds"] = time.perf_counter() - started
    return out


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        job = json.load(f)
    steps = {"write": write, "read": read, "partial": partial, "mismatch": mismatch, "down": down}
    result = steps[job["step"]](job)
    with open(sys.argv[2], "w") as f:
        json.dump(result, f)

"""``KVPoolStorage``: a kvpool-backed SGLang HiCache storage backend (the L3 tier).

Selected with SGLang's dynamic backend loader::

    --enable-hierarchical-cache --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "kvpool",
        "module_path": "kvpool.bindings.sglang", "class_name": "KVPoolStorage",
        "interface_v1": 1, "url": "kvpool://HOST:PORT"}'

(``embedded`` instead of ``url`` for a pool inside the SGLang process;
``interface_v1: 1`` selects the zero-copy calls). SGLang's cache controller
names each page with an opaque string (a hash chain over the page's tokens);
this backend stores every page as one kvpool block under a 16-byte digest of
that string in a namespace of the model, the TP rank and size (one shared
copy for MLA, whose KV every rank replicates), the pipeline stage, the host
pool's layout and an optional ``tenant`` from the extra config.

- ``batch_set_v1`` / ``batch_get_v1``: zero-copy over the registered host
  pool (``register_mem_pool_host``): the pool's ``get_page_buffer_meta``
  gives each page's buffers (K and V, or per-layer pieces) as pointer and
  size; a page is written piecewise into one reserved block (committed
  whole, or aborted) and read back with ranged ``get_into`` straight into
  those buffers. Pages already stored are not written again.
- ``get``/``batch_get``/``set``/``batch_set``: the generic path over flat
  page tensors.
- ``exists``; ``batch_exists``: the number of leading pages stored (one
  ``prefix_match`` call).

An unreachable pool reads as misses and failed writes, never an exception
into SGLang's I/O threads.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import xxhash
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig

from kvpool.bindings.engine_store import StoreConfig, StoreHandle
from kvpool.errors import KVPoolError
from kvpool.index.keys import Namespace

if TYPE_CHECKING:
    from kvpool.api import BlockWriter, KVStore

log = logging.getLogger("kvpool.bindings.sglang")

_KEY_TAG = b"kvpool/sglang-page/v1\x00"


class KVPoolStorage(HiCacheStorage):
    """SGLang HiCache storage on a kvpool store (embedded or cluster)."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Any = None) -> None:
        extra = dict(storage_config.extra_config or {})
        self.storage_config = storage_config
        self.store = StoreHandle(StoreConfig.from_extra(extra, owner="KVPoolStorage"))
        self.namespace = page_namespace(storage_config, extra.get("tenant"))
        self._prefix = _KEY_TAG + self.namespace.digest()
        self.mem_pool_host: Any = None
        self.stats = {"pages_set": 0, "pages_skipped": 0, "pages_got": 0, "pages_missed": 0}

    # -- keys ---------------------------------------------------------------------

    def block_key(self, key: str) -> bytes:
        """The kvpool key of SGLang page key ``key`` (16 bytes, stable everywhere)."""
        return xxhash.xxh3_128_digest(self._prefix + key.encode())

    # -- registration -------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        layout = getattr(mem_pool_host, "layout", None)
        if layout is not None:
            # Pages written under one host layout are meaningless under another.
            self.namespace = page_namespace(
                self.storage_config, self.namespace.tenant, layout=str(layout)
            )
            self._prefix = _KEY_TAG + self.namespace.digest()

    # -- zero-copy batch calls ------------------------------------------------------

    def batch_get_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None
    ) -> list[bool]:
        results = [False] * len(keys)
        store = self.store.get()
        if store is None or not keys:
            return results
        try:
            pages = self._page_buffers(keys, host_indices)
            # one lease pins the stored prefix (SGLang uses the leading run of
            # successes), so no page can be evicted between the check and the copy
            with store.lease([self.block_key(key) for key in keys]) as lease:
                for i, (block_key, buffers) in enumerate(zip(lease.keys, pages, strict=False)):
                    if not _read_page(store, block_key, buffers):
                        break
                    results[i] = True
        except (KVPoolError, OSError) as exc:
            self.store.failed(exc)
        got = sum(results)
        self.stats["pages_got"] += got
        self.stats["pages_missed"] += len(keys) - got
        return results

    def batch_set_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None
    ) -> list[bool]:
        results = [False] * len(keys)
        store = self.store.get()
        if store is None or not keys:
            return results
        try:
            block_keys = [self.block_key(key) for key in keys]
            stored = store.exists(block_keys)
            pages = self._page_buffers(keys, host_indices)
            for i, (block_key, buffers) in enumerate(zip(block_keys, pages, strict=True)):
                if stored[i]:
                    self.stats["pages_skipped"] += 1
                    results[i] = True
                    continue
                results[i] = _write_page(store, block_key, buffers)
                self.stats["pages_set"] += int(results[i])
        except (KVPoolError, OSError) as exc:
            self.store.failed(exc)
        return results

    def _page_buffers(self, keys: Sequence[str], host_indices: torch.Tensor) -> list[list[Any]]:
        """For each page, its host-pool buffers as zero-copy numpy views."""
        if self.mem_pool_host is None:
            raise RuntimeError("KVPoolStorage: register_mem_pool_host was not called")
        ptrs, sizes = self.mem_pool_host.get_page_buffer_meta(host_indices)
        if len(ptrs) != len(sizes) or len(ptrs) % len(keys):
            raise RuntimeError(
                f"KVPoolStorage: {len(ptrs)} page buffers for {len(keys)} pages from the host pool"
            )
        per_page = len(ptrs) // len(keys)
        views = [_host_view(ptr, size) for ptr, size in zip(ptrs, sizes, strict=True)]
        return [views[i * per_page : (i + 1) * per_page] for i in range(len(keys))]

    # -- generic calls ----------------------------------------------------------------

    def get(
        self, key: str, target_location: Any = None, target_sizes: Any = None
    ) -> torch.Tensor | None:
        return self.batch_get([key], [target_location])[0]

    def batch_get(
        self, keys: list[str], target_locations: Any = None, target_sizes: Any = None
    ) -> list[torch.Tensor | None]:
        outs: list[torch.Tensor | None] = [None] * len(keys)
        store = self.store.get()
        if store is None:
            return outs
        targets = list(target_locations) if target_locations is not None else [None] * len(keys)
        try:
            for i, (key, target) in enumerate(zip(keys, targets, strict=True)):
                block_key = self.block_key(key)
                if target is None:
                    data = store.get(block_key)
                    outs[i] = (
                        None
                        if data is None
                        else torch.frombuffer(bytearray(data), dtype=torch.uint8)
                    )
                elif store.get_into(block_key, target) == target.numel() * target.element_size():
                    outs[i] = target
        except (KVPoolError, OSError) as exc:
            self.store.failed(exc)
        return outs

    def set(
        self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None
    ) -> bool:
        return self.batch_set([key], [value])

    def batch_set(
        self,
        keys: list[str],
        values: Any = None,
        target_locations: Any = None,
        target_sizes: Any = None,
    ) -> bool:
        store = self.store.get()
        if store is None or values is None:
            return False
        try:
            for key, value in zip(keys, values, strict=True):
                if store.put(self.block_key(key), value.contiguous()):
                    self.stats["pages_set"] += 1
                else:
                    self.stats["pages_skipped"] += 1  # already stored: same key, same bytes
        except (KVPoolError, OSError) as exc:
            self.store.failed(exc)
            return False
        return True

    def exists(self, key: str) -> bool:
        store = self.store.get()
        if store is None:
            return False
        try:
            return bool(store.exists([self.block_key(key)])[0])
        except (KVPoolError, OSError) as exc:
            self.store.failed(exc)
            return False

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        store = self.store.get()
        if store is None or not keys:
            return 0
        try:
            return int(store.prefix_match([self.block_key(key) for key in keys]))
        except (KVPoolError, OSError) as exc:
            self.store.failed(exc)
            return 0

    def clear(self) -> None:
        # The pool is shared with other engines: clearing one engine's cache
        # must not drop theirs. Blocks age out through the pool's eviction.
        log.info("KVPoolStorage.clear: kvpool blocks are shared and left to eviction")

    def get_stats(self) -> dict[str, int]:
        return dict(self.stats)

    def close(self) -> None:
        self.store.close()


def page_namespace(
    config: HiCacheStorageConfig, tenant: str | None, *, layout: str = "unregistered"
) -> Namespace:
    """Model, TP rank/size (one copy for MLA), pipeline and context-parallel shard, layout."""
    replicated = bool(config.is_mla_model)
    shard = (
        f"sglang:pp{config.pp_rank}/{config.pp_size}:cp{config.attn_cp_rank}/"
        f"{config.attn_cp_size}:dcp{config.dcp_rank}/{config.dcp_size}:mla={replicated}"
        f":layout={layout}"
    )
    return Namespace(
        model=config.model_name or "sglang",
        layout=shard,
        tp_rank=0 if replicated else config.tp_rank,
        tp_size=1 if replicated else config.tp_size,
        tenant=tenant,
    )


def _host_view(ptr: int, size: int) -> np.ndarray:
    """A writable uint8 numpy view of ``size`` bytes of host memory at ``ptr`` (no copy)."""
    return np.ctypeslib.as_array((ctypes.c_uint8 * size).from_address(ptr))


def _read_page(store: KVStore, key: bytes, buffers: list[np.ndarray]) -> bool:
    """Ranged reads of one leased page straight into its buffers."""
    offset = 0
    for buffer in buffers:
        if store.get_into(key, buffer, offset=offset, length=buffer.size) != buffer.size:
            return False
        offset += buffer.size
    return True


def _write_page(store: KVStore, key: bytes, buffers: list[np.ndarray]) -> bool:
    """Write one page's buffers into a reserved block; commit whole or abort."""
    writer: BlockWriter | None = store.reserve(key, sum(b.size for b in buffers))
    if writer is None:
        return True  # stored meanwhile by another writer
    with writer:  # commits on success, aborts on an exception
        offset = 0
        for buffer in buffers:
            writer.write(offset, buffer)
            offset += buffer.size
    return True

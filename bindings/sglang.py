"""``KVPoolStorage``: a kvpool-backed SGLang HiCache storage backend (the L3 tier).

Selected with SGLang's dynamic backend loader::

    --enable-hierarchical-cache --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "kvpool",
        "module_path": "kvpool.bindings.sglang", "class_name": "KVPoolStorage",
        "interface_v1": 1, "url": "kvpool://HOST:PORT"}'

(``embedded`` instead of ``url`` for a pool inside the SGLang process;
``interface_v1: 1`` selects the zero-copy calls). SGLang's cache controller
names each page with an opaque string (a hash chain over the page's tokens);
this backend stores every page (each of its buffers: "pieces", below) under
a 16-byte digest of that string in a namespace of the model, the TP rank and
size (one shared copy for MLA, whose KV every rank replicates), the pipeline
stage, the host pool's layout and an optional ``tenant`` from the extra config.

- ``batch_set_v1`` / ``batch_get_v1``: zero-copy over the registered host
  pool (``register_mem_pool_host``): the pool's ``get_page_buffer_meta``
  gives each page's buffers (K and V for the ``page_first`` MHA layouts, one
  for MLA) as pointer and size, and each buffer is one kvpool block (a
  "piece"). A write-back is one ``exists`` and one ``put_batch`` of the
  pieces not stored; a prefetch one ``get_into_batch`` of every piece: the
  store's batched paths, never a round trip per page (a block reserved,
  written and committed per page cost 6-10x longer for small pages:
  bench/RESULTS.md, "Session 35").
- ``get``/``batch_get``/``set``/``batch_set``: the generic path over flat
  page tensors, one block per page (``put_batch`` / ``get_into_batch``).
- ``exists``; ``batch_exists``: the number of leading pages stored (one
  ``prefix_match`` over their pieces).

Invariant: a page counts as stored, and reads as a hit, only when every one
of its pieces is stored and read whole. The pool evicts pieces one by one,
so a page may keep one piece and lose another: it then reads as a miss (the
leading run of hits stops there), and the next write-back of the page
stores only the piece it lacks. A page of one piece (MLA, or any page while
no host pool is registered) is stored under the page's own key
(``block_key``), so the generic and the zero-copy calls share its block.
Written pages follow the puts' visibility rule (README, "Visibility rule"):
this backend reads them at once, other SGLang instances within milliseconds.

An unreachable pool reads as misses and failed writes, never an exception
into SGLang's I/O threads.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import xxhash
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig

from kvpool.bindings.engine_store import StoreConfig, StoreHandle
from kvpool.errors import KVPoolError
from kvpool.index.keys import Namespace

log = logging.getLogger("kvpool.bindings.sglang")

_KEY_TAG = b"kvpool/sglang-page/v1\x00"
_MAX_PIECES = 1 << 16  # a piece's index is two bytes of its key


class KVPoolStorage(HiCacheStorage):
    """SGLang HiCache storage on a kvpool store (embedded or cluster)."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Any = None) -> None:
        extra = dict(storage_config.extra_config or {})
        self.storage_config = storage_config
        self.store = StoreHandle(StoreConfig.from_extra(extra, owner="KVPoolStorage"))
        self.namespace = page_namespace(storage_config, extra.get("tenant"))
        self._prefix = _KEY_TAG + self.namespace.digest()
        self.mem_pool_host: Any = None
        self.pieces = 1  # blocks per page: the registered host pool's buffers per page
        self.stats = {"pages_set": 0, "pages_skipped": 0, "pages_got": 0, "pages_missed": 0}

    # -- keys ---------------------------------------------------------------------

    def block_key(self, key: str) -> bytes:
        """The kvpool key of SGLang page key ``key`` (16 bytes, stable everywhere)."""
        return xxhash.xxh3_128_digest(self._prefix + key.encode())

    def piece_keys(self, key: str) -> list[bytes]:
        """The kvpool keys of page ``key``'s pieces, in buffer order (``pieces`` of
        them); a page of one piece is stored under ``block_key`` itself."""
        if self.pieces == 1:
            return [self.block_key(key)]
        page = self._prefix + key.encode() + b"\x00"
        return [xxhash.xxh3_128_digest(page + i.to_bytes(2, "big")) for i in range(self.pieces)]

    def _flat_keys(self, keys: Sequence[str]) -> list[bytes]:
        return [piece for key in keys for piece in self.piece_keys(key)]

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
        self.pieces = _pieces_per_page(mem_pool_host)

    # -- zero-copy batch calls ------------------------------------------------------

    def batch_get_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None
    ) -> list[bool]:
        """Read the pages straight into their host slots: one ``get_into_batch`` of
        every piece. True for the leading run of pages read whole (the run SGLang
        uses). Each read is checked by the store: a piece evicted meanwhile is a
        miss, never wrong bytes."""
        results = [False] * len(keys)
        store = self.store.get()
        if store is None or not keys:
            return results
        try:
            buffers = self._piece_buffers(keys, host_indices)
            got = store.get_into_batch(self._flat_keys(keys), buffers)
            n = self.pieces
            for i in range(len(keys)):
                if any(got[j] != buffers[j].size for j in range(i * n, (i + 1) * n)):
                    break
                results[i] = True
        except (KVPoolError, OSError) as exc:
            self.store.failed(exc)
        hits = sum(results)
        self.stats["pages_got"] += hits
        self.stats["pages_missed"] += len(keys) - hits
        return results

    def batch_set_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None
    ) -> list[bool]:
        """Store the pages straight from their host slots: one ``exists`` of every
        piece, then one ``put_batch`` of those not stored. All True; where the
        store fails, True only for the pages found whole (the pieces it did store
        stay, and the next write-back skips them)."""
        results = [False] * len(keys)
        store = self.store.get()
        if store is None or not keys:
            return results
        n = self.pieces
        flat_keys = self._flat_keys(keys)
        stored = [False] * len(flat_keys)
        try:
            buffers = self._piece_buffers(keys, host_indices)
            stored = store.exists(flat_keys)
            missing = [j for j, there in enumerate(stored) if not there]
            if missing:
                store.put_batch([flat_keys[j] for j in missing], [buffers[j] for j in missing])
            written = sum(1 for i in range(len(keys)) if not all(stored[i * n : (i + 1) * n]))
            self.stats["pages_set"] += written
            self.stats["pages_skipped"] += len(keys) - written
            return [True] * len(keys)
        except (KVPoolError, OSError) as exc:
            self.store.failed(exc)
            return [all(stored[i * n : (i + 1) * n]) for i in range(len(keys))]

    def _piece_buffers(self, keys: Sequence[str], host_indices: torch.Tensor) -> list[Any]:
        """Every page's host-pool buffers, in page then piece order, as zero-copy
        numpy views: ``pieces`` per page, as ``_flat_keys`` names them."""
        if self.mem_pool_host is None:
            raise RuntimeError("KVPoolStorage: register_mem_pool_host was not called")
        ptrs, sizes = self.mem_pool_host.get_page_buffer_meta(host_indices)
        if len(ptrs) != len(sizes) or len(ptrs) != len(keys) * self.pieces:
            raise RuntimeError(
                f"KVPoolStorage: {len(ptrs)} page buffers for {len(keys)} pages of"
                f" {self.pieces} from the host pool"
            )
        return [_host_view(ptr, size) for ptr, size in zip(ptrs, sizes, strict=True)]

    # -- generic calls ----------------------------------------------------------------

    def get(
        self, key: str, target_location: Any = None, target_sizes: Any = None
    ) -> torch.Tensor | None:
        return self.batch_get([key], [target_location])[0]

    def batch_get(
        self, keys: list[str], target_locations: Any = None, target_sizes: Any = None
    ) -> list[torch.Tensor | None]:
        """Whole pages (one block each): into the given targets with one
        ``get_into_batch``; where no target is given, a new tensor each."""
        outs: list[torch.Tensor | None] = [None] * len(keys)
        store = self.store.get()
        if store is None or not keys:
            return outs
        targets = list(target_locations) if target_locations is not None else [None] * len(keys)
        if len(targets) != len(keys):
            raise ValueError(f"KVPoolStorage: {len(targets)} targets for {len(keys)} keys")
        given = {i: t for i, t in enumerate(targets) if t is not None}
        try:
            got = store.get_into_batch(
                [self.block_key(keys[i]) for i in given], list(given.values())
            )
            for (i, target), n in zip(given.items(), got, strict=True):
                if n == target.numel() * target.element_size():
                    outs[i] = target
            for i in range(len(keys)):
                if i not in given:
                    data = store.get(self.block_key(keys[i]))
                    if data is not None:
                        outs[i] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
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
        """Whole pages (one block each) in one ``put_batch``."""
        store = self.store.get()
        if store is None or values is None:
            return False
        try:
            datas = [value.contiguous() for value in values]
            if len(datas) != len(keys):
                raise ValueError(f"KVPoolStorage: {len(datas)} values for {len(keys)} keys")
            written = store.put_batch([self.block_key(key) for key in keys], datas)
        except (KVPoolError, OSError) as exc:
            self.store.failed(exc)
            return False
        self.stats["pages_set"] += sum(written)
        self.stats["pages_skipped"] += len(written) - sum(written)  # stored: same key, same bytes
        return True

    def exists(self, key: str) -> bool:
        store = self.store.get()
        if store is None:
            return False
        try:
            return all(store.exists(self.piece_keys(key)))
        except (KVPoolError, OSError) as exc:
            self.store.failed(exc)
            return False

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        """The number of leading pages whose every piece is stored."""
        store = self.store.get()
        if store is None or not keys:
            return 0
        try:
            return int(store.prefix_match(self._flat_keys(keys))) // self.pieces
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


def _pieces_per_page(mem_pool_host: Any) -> int:
    """How many buffers ``get_page_buffer_meta`` gives per page of this host pool
    (asked for its first page); 1 where it gives none (a layout without the
    zero-copy calls, whose pages the generic calls store whole)."""
    page_size = int(getattr(mem_pool_host, "page_size", 1))
    try:
        meta = mem_pool_host.get_page_buffer_meta(torch.arange(page_size))
    except (AttributeError, NotImplementedError, ValueError, AssertionError) as exc:
        log.info("KVPoolStorage: host pool gives no page buffers (%s); whole pages only", exc)
        return 1
    if meta is None:  # SGLang's base host pool: no zero-copy buffers
        return 1
    ptrs = meta[0]
    if not 1 <= len(ptrs) <= _MAX_PIECES:
        raise RuntimeError(f"KVPoolStorage: the host pool gives {len(ptrs)} buffers per page")
    return len(ptrs)

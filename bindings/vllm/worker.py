"""Worker side of the vLLM connector: move pages between the paged cache and the pool.

Loads (``start_load`` / ``wait_layer``): a background thread leases the
kvpool blocks of this step's ``LoadOp``s, then goes layer by layer: one
``get_into_batch`` of a ranged read per kvpool block (pipelined per node) into
a staging buffer, one ``index_copy_`` into the layer's paged cache, then that
layer's event. The forward pass waits on the event of the layer it is about to
run, so layer l+1 loads while layer l computes. A block that cannot be read
(evicted, node down, timeout) marks its vLLM blocks failed; they are reported
through ``take_failed`` and vLLM recomputes them (``kv_load_failure_policy:
"recompute"``). After a failure or a timeout nothing more is written into
those blocks (``_Load.cancel``), so a late copy can never land in a block
vLLM is recomputing.

Saves (``save_layer`` / ``finish_saves``): right after a layer's attention
wrote its pages, ``save_layer`` gathers that layer's pages of each kvpool
block being saved (one ``index_select``, a copy, so vLLM may reuse its
blocks at once) and queues them; a background thread reserves the block on
first use (``reserve`` answers None for a block already stored: it is not
written again) and writes the layer's range of every block in one batch
(``BlockWriter.write_pieces``). ``finish_saves`` waits for the
queue and commits every block whose layers all arrived, aborting the rest,
so a block becomes visible whole or not at all.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from kvpool.bindings.engine_store import StoreHandle
from kvpool.bindings.vllm.counters import CounterSink
from kvpool.bindings.vllm.geometry import Geometry
from kvpool.bindings.vllm.pages import PagedLayers
from kvpool.bindings.vllm.plan import LoadOp, SaveOp
from kvpool.errors import KVPoolError

if TYPE_CHECKING:
    from kvpool.api import BlockWriter, KVStore, Lease

log = logging.getLogger("kvpool.bindings.vllm")

DEFAULT_LOAD_TIMEOUT_S = 30.0
DEFAULT_SAVE_TIMEOUT_S = 60.0


@dataclass
class _Load:
    ops: list[LoadOp]
    num_layers: int
    done: list[threading.Event] = field(default_factory=list)
    failed: set[int] = field(default_factory=set)  # vLLM block ids
    lock: threading.Lock = field(default_factory=threading.Lock)
    cancelled: bool = False
    staging: torch.Tensor | None = None  # this job's read buffer (see _run_load)

    def __post_init__(self) -> None:
        self.done = [threading.Event() for _ in range(self.num_layers)]

    def cancel(self, why: str) -> None:
        with self.lock:
            if not self.cancelled:
                log.warning("kvpool load abandoned (%s); vLLM recomputes those blocks", why)
            self.cancelled = True
            for op in self.ops:
                self.failed.update(op.block_ids)
        for event in self.done:
            event.set()


class WorkerTransfers:
    """Loads and saves of one vLLM worker (one TP rank)."""

    def __init__(
        self,
        geometry: Geometry,
        store: StoreHandle,
        counters: CounterSink,
        *,
        tp_rank: int = 0,
        load_timeout_s: float = DEFAULT_LOAD_TIMEOUT_S,
        save_timeout_s: float = DEFAULT_SAVE_TIMEOUT_S,
    ) -> None:
        self.geometry = geometry
        self.store = store
        self.counters = counters
        self.tp_rank = tp_rank
        self.load_timeout_s = load_timeout_s
        self.save_timeout_s = save_timeout_s
        self.pages: PagedLayers | None = None
        self._load: _Load | None = None
        self._failed: set[int] = set()
        self._saves: queue.Queue[Any] = queue.Queue()
        self._saver: threading.Thread | None = None

    def register(self, kv_caches: dict[str, torch.Tensor], num_blocks: int) -> None:
        self.pages = PagedLayers(kv_caches, num_blocks, self.geometry)

    # -- loads ------------------------------------------------------------------

    def start_load(self, ops: Sequence[LoadOp]) -> None:
        self._finish_load()
        if not ops or self.pages is None:
            return
        job = _Load(list(ops), self.geometry.num_layers)
        self._load = job
        threading.Thread(
            target=self._run_load, args=(job,), name="kvpool-load", daemon=True
        ).start()

    def wait_layer(self, layer_name: str) -> None:
        job = self._load
        if job is None or self.pages is None:
            return
        layer = self.pages.index.get(layer_name)
        if layer is None:
            return
        started = time.perf_counter()
        if not job.done[layer].wait(self.load_timeout_s):
            job.cancel(f"layer {layer} not loaded within {self.load_timeout_s} s")
        self.counters.add(load_wait_s=time.perf_counter() - started)

    def take_failed(self) -> set[int]:
        """vLLM block ids whose load failed since the last call."""
        self._finish_load()
        failed, self._failed = self._failed, set()
        return failed

    def _finish_load(self) -> None:
        job, self._load = self._load, None
        if job is None:
            return
        for event in job.done:  # normally set already: every layer was waited for
            if not event.wait(self.load_timeout_s):
                job.cancel("load still running at the end of the step")
                break
        with job.lock:
            if job.failed and self.pages is not None:
                self.pages.drop_staging()  # the thread may still be reading into it
            job.cancelled = True  # the thread may still be running: no late writes
            self._failed |= job.failed
        if job.failed:
            self.counters.add(load_failed_blocks=len(job.failed))

    def _run_load(self, job: _Load) -> None:
        assert self.pages is not None
        started = time.perf_counter()
        lease: Lease | None = None
        loaded_bytes = 0
        try:
            store = self.store.get()
            if store is None:
                raise KVPoolError("pool unreachable")
            # The buffer is the job's own: a cancelled job's thread may still be
            # reading into it while the next job runs (_finish_load drops it).
            job.staging = self.pages.staging(max(op.num_blocks for op in job.ops))
            keys = list(dict.fromkeys(k for op in job.ops for k in op.keys[self.tp_rank]))
            lease = store.lease(keys, prefix=False)
            leased = set(lease.keys)
            for layer in range(job.num_layers):
                for op in job.ops:
                    loaded_bytes += self._load_op_layer(store, job, op, layer, leased)
                job.done[layer].set()
            self.store.ok()
        except (KVPoolError, OSError) as exc:
            self.store.failed(exc)
            job.cancel(str(exc))
        except Exception:  # never leave the forward pass waiting on a dead thread
            log.exception("kvpool load failed")
            job.cancel("unexpected error")
        finally:
            if lease is not None:
                try:
                    lease.release()
                except (KVPoolError, OSError) as exc:
                    log.warning("kvpool lease release failed: %s", exc)
            for event in job.done:
                event.set()
            blocks = sum(op.num_blocks for op in job.ops)
            self.counters.add(
                load_ops=len(job.ops),
                loaded_blocks=blocks - len(job.failed),
                loaded_bytes=loaded_bytes,
                load_s=time.perf_counter() - started,
            )

    def _load_op_layer(
        self, store: KVStore, job: _Load, op: LoadOp, layer: int, leased: set[bytes]
    ) -> int:
        """One layer of one op: one batch of ranged reads (a range per kvpool block,
        pipelined per node) into staging, one scatter into the paged cache;
        segments that fail (here or in an earlier layer) are left out and their
        vLLM blocks marked failed. Bytes loaded."""
        assert self.pages is not None and job.staging is not None
        g = self.geometry
        staging = job.staging
        # (vLLM block ids, key, where in staging, bytes, offset in the block) per read
        plan: list[tuple[list[int], bytes, int, int, int]] = []
        placed = at = 0
        for s, key in enumerate(op.keys[self.tp_rank]):
            n = op.num_pages[s]
            ids = op.block_ids[at : at + n]
            at += n
            if ids[0] in job.failed:
                continue
            if key not in leased:
                with job.lock:
                    job.failed.update(ids)
                continue
            size = n * g.page_bytes
            plan.append((ids, key, placed, size, g.layer_offset(layer, op.first_page[s])))
            placed += size
        got = (
            store.get_into_batch(
                [key for _, key, _, _, _ in plan],
                [staging[start : start + size] for _, _, start, size, _ in plan],
                offsets=[offset for *_, offset in plan],
                lengths=[size for _, _, _, size, _ in plan],
            )
            if plan
            else []
        )
        good: list[int] = []
        filled = 0
        for (ids, _, start, size, _), took in zip(plan, got, strict=True):
            if took != size:
                with job.lock:
                    job.failed.update(ids)
                continue
            if start != filled:  # behind a failed read: close the gap (a copy: they overlap)
                staging[filled : filled + size] = staging[start : start + size].clone()
            good.extend(ids)
            filled += size
        with job.lock:
            if job.cancelled or not good:
                return 0
            self.pages.scatter(layer, good, staging[:filled])
        return filled

    # -- saves ------------------------------------------------------------------

    def save_layer(self, layer_name: str, kv_layer: torch.Tensor, ops: Sequence[SaveOp]) -> None:
        if not ops or self.pages is None:
            return
        layer = self.pages.index.get(layer_name)
        if layer is None:
            return
        if self._saver is None:
            self._saver = threading.Thread(target=self._run_saves, name="kvpool-save", daemon=True)
            self._saver.start()
        gathered = [self.pages.gather(kv_layer, op.block_ids) for op in ops]
        self._saves.put((list(ops), layer, gathered))

    def finish_saves(self, ops: Sequence[SaveOp]) -> None:
        """Wait for this step's writes and commit every whole block (``wait_for_save``)."""
        if not ops or self._saver is None:
            return
        started = time.perf_counter()
        done = threading.Event()
        self._saves.put(done)
        if not done.wait(self.save_timeout_s):
            log.warning("kvpool saves still running after %s s", self.save_timeout_s)
        self.counters.add(save_wait_s=time.perf_counter() - started)

    def _run_saves(self) -> None:
        writers: dict[bytes, BlockWriter | None] = {}
        layers: dict[bytes, int] = {}
        while True:
            item = self._saves.get()
            if isinstance(item, threading.Event):
                self._commit(writers, layers)
                writers.clear()
                layers.clear()
                item.set()
                continue
            started = time.perf_counter()
            self._save_layer(writers, layers, *item)
            self.counters.add(save_s=time.perf_counter() - started)

    def _save_layer(
        self,
        writers: dict[bytes, BlockWriter | None],
        layers: dict[bytes, int],
        ops: list[SaveOp],
        layer: int,
        gathered: list[torch.Tensor],
    ) -> None:
        """One layer of every op: reserve the blocks this step saves on first use, in
        one ``reserve_batch`` (a block already stored is skipped; when the batch
        fails, its blocks are left out), then all their pieces in one
        ``BlockWriter.write_pieces`` (the cluster client: one exchange per node). A
        failed write aborts the blocks of the batch."""
        keys = [op.keys[self.tp_rank] for op in ops]
        self._reserve_new(writers, [k for k in dict.fromkeys(keys) if k not in writers])
        pieces: list[tuple[BlockWriter, int, torch.Tensor]] = []
        for key, pages in zip(keys, gathered, strict=True):
            writer = writers[key]
            if writer is not None and not writer.done:
                pieces.append((writer, self.geometry.layer_offset(layer), pages))
        try:
            if pieces:  # (BlockWriter.write_pieces: bindings never import kvpool.api)
                pieces[0][0].write_pieces(pieces)
        except (KVPoolError, OSError) as exc:
            self.store.failed(exc)
            for writer, _, _ in pieces:
                _abort(writer)
            return
        for writer, _, _ in pieces:
            layers[writer.key] = layers.get(writer.key, 0) + 1

    def _reserve_new(self, writers: dict[bytes, BlockWriter | None], new: list[bytes]) -> None:
        """Reserve ``new`` (one allocation round trip on a cluster); each gets its
        writer, or None (already stored, no store, or the batch failed: not retried
        for its later layers)."""
        store = self.store.get()
        reserved: Sequence[BlockWriter | None] = [None] * len(new)
        if new and store is not None:
            try:
                sizes = [self.geometry.pool_block_bytes] * len(new)
                reserved = store.reserve_batch(new, sizes)
                self.counters.add(skipped_blocks=reserved.count(None))
            except (KVPoolError, OSError) as exc:
                self.store.failed(exc)
        writers.update(zip(new, reserved, strict=True))

    def _commit(self, writers: dict[bytes, BlockWriter | None], layers: dict[bytes, int]) -> None:
        """Commit the step's blocks that got every layer, in one ``commit_all`` (the
        cluster client: one seal exchange per node, one master round trip); abort the
        rest. When the batch fails, the blocks it stored are counted by ``exists``."""
        started = time.perf_counter()
        whole: list[BlockWriter] = []
        failed = 0
        for key, writer in writers.items():
            if writer is None:
                continue
            if writer.done or layers.get(key, 0) != self.geometry.num_layers:
                _abort(writer)
                failed += 1
            else:
                whole.append(writer)
        saved, store = len(whole), self.store.get()  # (before ``failed`` hides it)
        try:
            if whole:  # (BlockWriter.commit_all: bindings never import kvpool.api)
                whole[0].commit_all(whole)
        except (KVPoolError, OSError) as exc:
            self.store.failed(exc)
            for writer in whole:
                _abort(writer)  # a no-op for those committed
            saved = _stored(store, [writer.key for writer in whole])
        failed += len(whole) - saved
        self.counters.add(
            saved_blocks=saved,
            saved_bytes=saved * self.geometry.pool_block_bytes,
            save_failed_blocks=failed,
            save_s=time.perf_counter() - started,
        )

    def close(self) -> None:
        self._finish_load()


def _stored(store: KVStore | None, keys: list[bytes]) -> int:
    """How many of ``keys`` ``store`` holds (0 when it cannot say)."""
    try:
        return 0 if store is None else sum(store.exists(keys))
    except (KVPoolError, OSError):
        return 0


def _abort(writer: BlockWriter) -> None:
    try:
        writer.abort()
    except (KVPoolError, OSError) as exc:
        log.warning("kvpool abort failed: %s", exc)

"""LayerWriter: store a prefill's KV layer by layer while the next layers compute.

    with pool.layer_writer(keys, layout) as writer:
        for layer in range(layout.num_layers):
            k, v = run_layer(layer)          # [n_blocks*block_tokens, kv_heads, head_dim]
            writer.write_layer(layer, k, v)  # returns at once; copied in the background
    # leaving the block waited: every block is committed, or none is visible

The writer reserves every block of ``keys`` that is not stored yet, in one
``reserve_batch`` (the cluster client: one master round trip); blocks already
stored (or being written by someone else) are skipped and their part of each
layer is dropped. ``write_layer`` only checks its arguments and queues the
layer; one background thread copies it into the reserved blocks (large
numpy/torch copies release the GIL, so the copy overlaps the caller's
compute). ``wait()`` joins the copies and commits all blocks, so a block
appears only with all of its layers. If any copy failed or any layer was
never written, ``wait()`` aborts every reservation and raises: nothing
half-written ever becomes visible.

The caller must not modify ``k``/``v`` until ``wait()`` returns (or
``layer_done(layer)`` is true) unless it passes ``copy=True``, which
snapshots them before ``write_layer`` returns. CUDA inputs are copied on a
side stream after the kernels the caller queued before ``write_layer``.

Always finish a writer with ``wait()``, ``abort()`` or a ``with`` block: until
then its reservations hold pool space and its thread waits for layers.
``write_layer`` is meant to be called from one producer thread.

Only ``reserve_batch`` and ``BlockWriter``'s ``write_pieces``, ``commit_all`` and
``abort`` of the store contract are used, so the distributed client works as well as the
embedded pool; each layer's pieces go in one ``write_pieces`` (the cluster
client: one exchange per node for the layer, not one or two per block) and the
blocks commit in one ``commit_all``.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Sequence
from typing import Any

from kvpool.api import BlockWriter, KVStore
from kvpool.args import check_keys
from kvpool.bindings.buffers import Region, region_is_device
from kvpool.errors import BufferSpecError, KVPoolError
from kvpool.layerwise.common import (
    LayerTransferError,
    SideStream,
    check_layer,
    check_layout,
    device_event,
    layer_region,
)
from kvpool.layout import KVLayout

_STOP = None


class LayerWriter:
    """Writes the KV of ``keys`` (consecutive blocks of one prompt) layer by layer."""

    def __init__(
        self,
        pool: KVStore,
        keys: Sequence[bytes],
        layout: KVLayout,
        parents: Sequence[bytes | None] | None = None,
        *,
        copy: bool = False,
        device: bool = False,
    ) -> None:
        """Reserve every block of ``keys`` not stored yet.

        ``parents[i]`` is the parent key of ``keys[i]``; by default each key's
        parent is the key before it (the first has none). ``copy=True``
        snapshots each layer in ``write_layer`` so the caller may reuse its
        buffers at once. ``device=True`` asks for GPU-tier blocks.
        """
        self.layout = check_layout(layout)
        self.keys = list(keys)
        check_keys(self.keys)
        n = len(self.keys)
        if parents is None:
            parents = [None, *self.keys[:-1]] if n else []
        parents = list(parents)
        if len(parents) != n:
            raise ValueError(f"parents has {len(parents)} entries for {n} keys")
        self._copy = copy
        self._layer_nbytes = n * layout.half_layer_bytes
        # one allocation round trip for every block (all or nothing: KVStore.reserve_batch)
        self._writers: list[BlockWriter | None] = list(
            pool.reserve_batch(self.keys, [layout.block_bytes] * n, parents, device=device)
        )
        self._skipped = [k for k, w in zip(self.keys, self._writers, strict=True) if w is None]
        self._queued: set[int] = set()
        self._done: set[int] = set()
        self._error: BaseException | None = None
        self._finished = False
        self._cancel = False
        self._lock = threading.Lock()
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._side = SideStream()
        self._thread: threading.Thread | None = None

    # -- public API -------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        """Blocks each layer covers (``len(keys)``), stored or not."""
        return len(self.keys)

    @property
    def skipped(self) -> list[bytes]:
        """Keys not reserved (already stored or being written elsewhere); not written."""
        return list(self._skipped)

    def write_layer(self, layer: int, k: Any, v: Any) -> None:
        """Queue layer ``layer``'s K and V for all blocks; returns at once.

        ``k`` and ``v`` are contiguous buffers (numpy, torch CPU/CUDA, cupy,
        bytes-like) of exactly ``num_blocks*half_layer_bytes`` bytes, e.g.
        shaped [num_blocks*block_tokens, kv_heads, head_dim]. Do not modify
        them until the layer is done (see ``copy=True``).
        """
        if self._finished:
            raise KVPoolError("write_layer after wait()/abort(): this layer writer is finished")
        layer = check_layer(layer, self.layout)
        k_region = layer_region(k, self._layer_nbytes, "k", writable=False)
        v_region = layer_region(v, self._layer_nbytes, "v", writable=False)
        if layer in self._queued:
            raise KVPoolError(f"layer {layer} was already written")
        if region_is_device(k_region) != region_is_device(v_region):
            raise BufferSpecError("k and v must both be on the GPU or both in host memory")
        if self._copy:
            k_region, v_region = _snapshot(k_region), _snapshot(v_region)
        event = device_event(k_region)
        self._queued.add(layer)
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kvpool-layer-writer")
            self._thread.daemon = True
            self._thread.start()
        self._jobs.put((layer, k_region, v_region, event))

    def layer_done(self, layer: int) -> bool:
        """True once ``layer`` is copied into every reserved block (its inputs are free)."""
        with self._lock:
            return layer in self._done

    def wait(self) -> int:
        """Finish: join the copies and commit every reserved block; returns how many.

        Raises ``LayerTransferError`` (after aborting every reservation) when a
        copy failed, and ``KVPoolError`` when a layer was never written.
        """
        if self._finished:
            raise KVPoolError("wait() was already called on this layer writer")
        self._join()
        if self._error is not None:
            self._abort_all()
            raise LayerTransferError(f"storing layers failed: {self._error}") from self._error
        missing = sorted(set(range(self.layout.num_layers)) - self._done)
        if missing:
            self._abort_all()
            raise KVPoolError(
                f"layer writer finished with {len(missing)} layer(s) never written "
                f"(first: {missing[0]}); no block was stored"
            )
        writers = [writer for writer in self._writers if writer is not None]
        try:
            BlockWriter.commit_all(writers)  # one seal exchange per node, one master trip
        except BaseException as exc:
            self._abort_all()  # those already committed stay: aborting them is a no-op
            raise LayerTransferError(f"committing blocks failed: {exc}") from exc
        self._writers = [None] * len(self._writers)
        return len(writers)

    def abort(self) -> None:
        """Stop, drop queued layers and free every reservation. Idempotent."""
        if not self._finished:
            self._cancel = True
            self._join()
        self._abort_all()

    def __enter__(self) -> LayerWriter:
        return self

    def __exit__(self, exc_type: object, *rest: object) -> None:
        if exc_type is None:
            self.wait()
        else:
            self.abort()

    # -- background -------------------------------------------------------

    def _join(self) -> None:
        self._finished = True
        if self._thread is not None:
            self._jobs.put(_STOP)
            self._thread.join()

    def _run(self) -> None:
        half, layer_bytes = self.layout.half_layer_bytes, self.layout.layer_bytes
        while (job := self._jobs.get()) is not _STOP:
            if self._error is not None or self._cancel:
                continue  # drain: a failed or cancelled writer copies nothing more
            layer, k_region, v_region, event = job
            try:
                with self._side.enter(k_region, event):
                    pieces: list[tuple[BlockWriter, int, Region]] = []
                    for i, writer in enumerate(self._writers):
                        if writer is not None:
                            lo, hi = i * half, (i + 1) * half
                            pieces.append((writer, layer * layer_bytes, k_region[lo:hi]))
                            pieces.append((writer, layer * layer_bytes + half, v_region[lo:hi]))
                    if not self._cancel:
                        BlockWriter.write_pieces(pieces)  # one exchange per node
            except BaseException as exc:
                self._error = exc
                continue
            with self._lock:
                self._done.add(layer)

    def _abort_all(self) -> None:
        writers, self._writers = self._writers, [None] * len(self._writers)
        for writer in writers:
            if writer is not None:
                # a closed pool refuses the abort: its tiers (and the space) are gone anyway
                with contextlib.suppress(KVPoolError):
                    writer.abort()


def _snapshot(region: Region) -> Region:
    return region.clone() if region_is_device(region) else region.copy()

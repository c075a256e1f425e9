"""Moving a model's per-layer KV between torch tensors and the pool.

A block's bytes follow ``KVLayout``: layer l occupies
``[l * layer_bytes, (l + 1) * layer_bytes)``, K (``block_tokens x kv_heads x
head_dim``) then V. The runtime keeps KV per layer as ``[tokens, kv_heads,
head_dim]`` tensors, so a block's K for layer l is simply rows
``[i * block_tokens, (i + 1) * block_tokens)`` of layer l's K tensor.

- ``BlockLayerWriter``: stores a run of consecutive blocks layer by layer
  (``write_layer(layer, k, v)`` as each layer finishes, then ``wait()``,
  which commits). It uses the layer-wise store (``pool.layer_writer``, or
  ``kvpool.layerwise.LayerWriter`` over a pool without that method) and
  otherwise its own ``Pool.reserve`` path (two-phase: a block is visible only
  when every layer is written) with the copies on a background thread so
  they overlap the next layers' compute.
- ``BlockLayerLoader``: loads a run of blocks into per-layer destination
  tensors, one layer at a time in order (``wait_layer(l)`` blocks until
  layer l is in place while later layers keep loading). It uses the
  layer-wise reader (``pool.layer_reader(keys, layout, out=...)``, loading
  straight into the destination tensors) and otherwise a ``Pool.lease`` plus
  byte-range ``get_into``, also straight into the destination tensors.

``native=None`` picks the layer-wise store when available, ``True`` requires
it, ``False`` always takes the built-in reserve/lease path.
- ``tail_key``: the partial last block of a prompt gets no content key (only
  full blocks are shared), but prefill still hands it to decode through the
  pool under a key private to the request.
"""

from __future__ import annotations

import functools
import importlib
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, Future
from typing import Any, cast

import torch
import xxhash
from torch import Tensor

from kvpool.api import BlockWriter, KVStore
from kvpool.index.keys import Namespace, token_array
from kvpool.layout import KVLayout

_TAIL_TAG = b"kvpool/serve/tail/v1\x00"
KVBuffers = Sequence[tuple[Tensor, Tensor]]


class KVMissingError(RuntimeError):
    """A block the runtime needed vanished from the pool (evicted or never stored)."""


def tail_key(namespace: Namespace, request_id: str, parent: bytes, tokens: Any) -> bytes:
    """The pool key of a request's partial tail block (never shared between requests)."""
    ids = token_array(tokens)
    payload = _TAIL_TAG + namespace.digest() + parent + request_id.encode() + ids.tobytes()
    return xxhash.xxh3_128_digest(payload)


def tail_layout(layout: KVLayout, tokens: int) -> KVLayout:
    """Layout of a ``tokens``-long partial block (same per-layer format, fewer rows)."""
    return KVLayout(layout.num_layers, layout.num_kv_heads, layout.head_dim, layout.dtype, tokens)


def layerwise_api(pool: KVStore, kind: str) -> Callable[..., Any] | None:
    """``pool.layer_writer``/``layer_reader`` (``kind`` "writer"/"reader"), or the
    ``kvpool.layerwise`` class bound to ``pool``, or None when neither exists."""
    method = getattr(pool, f"layer_{kind}", None)
    if method is not None:
        return cast(Callable[..., Any], method)
    try:
        module = importlib.import_module("kvpool.layerwise")
    except ImportError:
        return None
    cls = getattr(module, "LayerWriter" if kind == "writer" else "LayerReader", None)
    return None if cls is None else functools.partial(cls, pool)


def _pick(pool: KVStore, kind: str, native: bool | None) -> Callable[..., Any] | None:
    if native is False:
        return None
    api = layerwise_api(pool, kind)
    if api is None and native:
        raise RuntimeError(f"this pool has no layer-wise {kind} (kvpool.layerwise)")
    return api


def _byte_view(t: Tensor) -> Tensor:
    """Flat uint8 view of a contiguous tensor (any dtype, bf16 included; CPU or CUDA:
    the pool takes either)."""
    return t.reshape(-1).view(torch.uint8)


class BlockLayerWriter:
    """Stores consecutive blocks ``keys`` layer by layer; ``wait()`` commits them.

    ``k``/``v`` given to ``write_layer`` are ``[len(keys) * block_tokens,
    kv_heads, head_dim]`` (contiguous; the caller must not modify them until
    ``wait`` returns). Blocks already in the pool are skipped.
    """

    def __init__(
        self,
        pool: KVStore,
        keys: Sequence[bytes],
        layout: KVLayout,
        *,
        parent: bytes | None = None,
        executor: Executor | None = None,
        native: bool | None = None,
    ) -> None:
        self.layout = layout
        self.keys = list(keys)
        parents = [parent, *self.keys[:-1]]
        api = _pick(pool, "writer", native)
        self._native: Any = None if api is None else api(self.keys, layout, parents)
        self._writers: list[BlockWriter | None] = []
        self._futures: list[Future[None]] = []
        self._executor = executor
        self._done = False
        if self._native is None:  # one allocation round trip for all (KVStore.reserve_batch)
            sizes = [layout.block_bytes] * len(self.keys)
            self._writers = list(pool.reserve_batch(self.keys, sizes, parents))

    @property
    def stored_blocks(self) -> int:
        """Blocks this writer writes (those not already in the pool), when known."""
        if self._native is not None:
            return len(self.keys) - len(getattr(self._native, "skipped", ()))
        return sum(w is not None for w in self._writers)

    def write_layer(self, layer: int, k: Tensor, v: Tensor) -> None:
        if self._native is not None:
            self._native.write_layer(layer, k, v)
            return
        if self._executor is None:
            self._copy_layer(layer, k, v)
        else:
            self._futures.append(self._executor.submit(self._copy_layer, layer, k, v))

    def _copy_layer(self, layer: int, k: Tensor, v: Tensor) -> None:
        lay, bt = self.layout, self.layout.block_tokens
        base = layer * lay.layer_bytes
        pieces: list[tuple[BlockWriter, int, Tensor]] = []
        for i, writer in enumerate(self._writers):
            if writer is not None:
                pieces.append((writer, base, _byte_view(k[i * bt : (i + 1) * bt])))
                pieces.append(
                    (writer, base + lay.half_layer_bytes, _byte_view(v[i * bt : (i + 1) * bt]))
                )
        BlockWriter.write_pieces(pieces)  # the cluster client: one exchange per node

    def wait(self) -> None:
        """Finish every copy and commit; on any failure abort all and re-raise."""
        if self._done:
            return
        self._done = True
        if self._native is not None:
            self._native.wait()
            return
        try:
            for fut in self._futures:
                fut.result()
            BlockWriter.commit_all([w for w in self._writers if w is not None])
        except BaseException:
            self._abort()  # (a no-op for the blocks committed before an error)
            raise

    def abort(self) -> None:
        if self._done:
            return
        self._done = True
        for fut in self._futures:
            fut.cancel()
        for fut in self._futures:
            if not fut.cancelled():
                fut.exception()  # wait for a running copy before freeing its block
        self._abort()

    def _abort(self) -> None:
        if self._native is not None:
            self._native.abort()
            return
        for writer in self._writers:
            if writer is not None and not writer.done:
                writer.abort()


class BlockLayerLoader:
    """Loads consecutive blocks into ``dest[l] = (K, V)`` rows ``[0, n * block_tokens)``.

    Layers load in order on a background thread; ``wait_layer(l)`` returns
    when layer l is in place. ``count`` is the number of leading blocks that
    could be pinned (a block evicted between ``prefix_match`` and the load is
    not loaded; the caller recomputes from there). ``close()`` releases the
    pinned blocks; use as a context manager.
    """

    def __init__(
        self,
        pool: KVStore,
        keys: Sequence[bytes],
        layout: KVLayout,
        dest: KVBuffers,
        *,
        native: bool | None = None,
        background: bool = True,
    ) -> None:
        self.layout = layout
        self._dest = dest
        self._pool = pool
        self._error: BaseException | None = None
        self._ready = [threading.Event() for _ in range(layout.num_layers)]
        api = _pick(pool, "reader", native)
        self._native: Any = None
        self._lease: Any = None
        if api is not None:
            rows = len(keys) * layout.block_tokens
            views = [(k[:rows], v[:rows]) for k, v in dest]
            self._native = api(list(keys), layout, out=views)
            self.keys = list(self._native.keys)
        elif hasattr(pool, "lease"):
            self._lease = pool.lease(list(keys))
            self.keys = list(self._lease.keys)
        else:
            self.keys = list(keys)
        self.count = len(self.keys)
        self._thread: threading.Thread | None = None
        if self.count == 0 or self._native is not None:
            for ev in self._ready:
                ev.set()  # nothing to load, or the layer-wise reader loads
        elif background:
            self._thread = threading.Thread(target=self._run, name="kvpool-kv-load", daemon=True)
            self._thread.start()
        else:
            self._run()

    def _run(self) -> None:
        try:
            for layer in range(self.layout.num_layers):
                self._load_layer(layer)
                self._ready[layer].set()
        except BaseException as exc:  # surfaced by wait_layer
            self._error = exc
            for ev in self._ready:
                ev.set()

    def _load_layer(self, layer: int) -> None:
        """One batch read of the layer's K and V range of every block (pipelined per
        node by a distributed client)."""
        k_dst, v_dst = self._dest[layer]
        bt, n = self.layout.block_tokens, len(self.keys)
        keys, offsets, lengths = self.layout.layer_reads(layer, self.keys)
        outs = [_byte_view(dst[i * bt : (i + 1) * bt]) for i in range(n) for dst in (k_dst, v_dst)]
        got = self._pool.get_into_batch(keys, outs, offsets=offsets, lengths=lengths)
        for key, took in zip(keys, got, strict=True):
            if took != self.layout.half_layer_bytes:
                raise KVMissingError(f"block {key.hex()} layer {layer} could not be read")

    def wait_layer(self, layer: int) -> tuple[Tensor, Tensor]:
        """Layer ``layer``'s loaded rows ``(K, V)``; raises if the load failed."""
        if self._native is not None and self.count:
            self._native.wait_layer(layer)  # it loads into our destination tensors
        self._ready[layer].wait()
        if self._error is not None:
            raise self._error
        rows = self.count * self.layout.block_tokens
        k_dst, v_dst = self._dest[layer]
        return k_dst[:rows], v_dst[:rows]

    def wait_all(self) -> None:
        for layer in range(self.layout.num_layers):
            self.wait_layer(layer)

    def close(self) -> None:
        if self._thread is not None:
            self._thread.join()
        if self._native is not None:
            self._native.close()
        if self._lease is not None:
            self._lease.release()
        self._native = self._lease = None

    def __enter__(self) -> BlockLayerLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

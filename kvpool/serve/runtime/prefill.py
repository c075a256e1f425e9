"""Prefill worker: reuse the cached prefix, compute the rest in chunks, store new KV.

For a prompt of T tokens:

1. block keys of its full blocks (``kvpool.block_keys`` in the model's
   namespace), ``prefix_match`` -> n cached blocks, pinned with a lease;
2. the cached blocks' KV is loaded layer by layer into the request's KV
   buffers on a background thread (layer l+1 loads while layer l computes);
3. the remaining tokens are computed in chunks of ``chunk_tokens``; within a
   chunk the model runs layer by layer and, after each layer, every block
   that this chunk completed is handed to a layer writer, so its bytes move
   to the pool while later layers compute; a block becomes visible once all
   its layers are written;
4. the partial tail block is stored under a request-private key so decode
   can take the whole prompt's KV from the pool;
5. the first output token is sampled from the last position's logits
   (``runtime.sampling``; its logprobs too when the request asks).

When every token of the prompt is cached (T a multiple of the block size and
all blocks hit), the last token is recomputed (its logits are needed), so at
least one token is always computed.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor

from kvpool.api import KVStore
from kvpool.index.keys import Namespace, block_keys, root_key, token_array
from kvpool.serve.runtime.kv_io import BlockLayerLoader, BlockLayerWriter, tail_key, tail_layout
from kvpool.serve.runtime.model import Transformer
from kvpool.serve.runtime.sampling import (
    GREEDY,
    SamplingParams,
    TokenLogprobs,
    sample,
    token_logprobs,
)


@dataclass
class PrefillResult:
    """What a prefill hands to decode (all plain data but ``last_logits``)."""

    request_id: str
    tokens: list[int]
    first_token: int
    block_keys: list[bytes]
    tail_key: bytes | None
    cached_tokens: int  # prompt tokens whose KV came from the pool
    computed_tokens: int  # prompt tokens this prefill ran through the model
    cached_blocks: int
    stored_blocks: int  # new full blocks written to the pool
    timings: dict[str, float] = field(default_factory=dict)
    first_logprobs: TokenLogprobs | None = None  # when the request asked for logprobs
    last_logits: Tensor | None = field(default=None, repr=False, compare=False)

    @property
    def prompt_tokens(self) -> int:
        return len(self.tokens)

    def to_dict(self) -> dict[str, Any]:
        """Plain msgpack-able form (no logits)."""
        return {
            "request_id": self.request_id,
            "tokens": self.tokens,
            "first_token": self.first_token,
            "block_keys": self.block_keys,
            "tail_key": self.tail_key,
            "cached_tokens": self.cached_tokens,
            "computed_tokens": self.computed_tokens,
            "cached_blocks": self.cached_blocks,
            "stored_blocks": self.stored_blocks,
            "timings": self.timings,
            "first_logprobs": self.first_logprobs,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PrefillResult:
        return cls(**d)


class PrefillWorker:
    """Prefills prompts against a pool (embedded ``kvpool.Pool`` or a connected one).

    ``chunk_tokens`` bounds the tokens run through the model at once.
    ``native_layerwise``: None uses the pool's ``layer_writer``/``layer_reader``
    when it has them, False always uses ``reserve``/``lease`` + ``get_into``.
    """

    def __init__(
        self,
        model: Transformer,
        pool: KVStore,
        *,
        chunk_tokens: int = 512,
        namespace: Namespace | None = None,
        native_layerwise: bool | None = None,
        store_tail: bool = True,
    ) -> None:
        if chunk_tokens <= 0:
            raise ValueError("chunk_tokens must be positive")
        self.model = model
        self.pool = pool
        self.cfg = model.cfg
        self.layout = self.cfg.kv_layout()
        self.namespace = namespace or self.cfg.namespace(model.seed)
        self.chunk_tokens = chunk_tokens
        self.native = native_layerwise
        self.store_tail = store_tail
        self._copier = ThreadPoolExecutor(1, thread_name_prefix="kvpool-kv-store")

    def close(self) -> None:
        self._copier.shutdown(wait=True)

    def __enter__(self) -> PrefillWorker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def keys(self, tokens: Sequence[int] | Tensor | np.ndarray) -> list[bytes]:
        return block_keys(tokens, self.namespace, self.layout.block_tokens)

    @torch.inference_mode()
    def prefill(
        self,
        tokens: Sequence[int] | Tensor,
        request_id: str | None = None,
        sampling: SamplingParams = GREEDY,
    ) -> PrefillResult:
        ids_np = token_array(tokens)
        total = int(ids_np.size)
        if total == 0:
            raise ValueError("empty prompt")
        if total > self.cfg.max_context:
            raise ValueError(f"{total} tokens exceed the model's context of {self.cfg.max_context}")
        rid = request_id or uuid.uuid4().hex
        model, bt = self.model, self.layout.block_tokens
        ids = torch.from_numpy(ids_np.astype("int64"))
        t0 = time.perf_counter()
        keys = self.keys(ids_np)
        hit = self.pool.prefix_match(keys) if keys else 0
        buffers = model.kv_buffers(total)
        loader = BlockLayerLoader(self.pool, keys[:hit], self.layout, buffers, native=self.native)
        writers: list[BlockLayerWriter] = []
        tail: BlockLayerWriter | None = None
        try:
            cached_blocks = loader.count
            cached = min(cached_blocks * bt, total - 1)
            next_block = cached_blocks  # first block this prefill must store
            t_compute = time.perf_counter()
            h = None
            start = cached
            while start < total:
                end = min(start + self.chunk_tokens, total)
                jobs: list[tuple[BlockLayerWriter, int, int]] = []
                done_blocks = end // bt
                if done_blocks > next_block:
                    parent = keys[next_block - 1] if next_block else None
                    w = self._writer(keys[next_block:done_blocks], self.layout, parent)
                    jobs.append((w, next_block * bt, done_blocks * bt))
                    next_block = done_blocks
                if end == total and self.store_tail and total % bt:
                    tail_start = (total // bt) * bt
                    parent = keys[-1] if keys else root_key(self.namespace, bt)
                    key = tail_key(self.namespace, rid, parent, ids_np[tail_start:])
                    tail = self._writer([key], tail_layout(self.layout, total - tail_start), None)
                    jobs.append((tail, tail_start, total))
                writers.extend(w for w, _, _ in jobs)
                h = model.embed(ids[start:end])
                for layer in range(self.cfg.num_layers):
                    if start == cached:
                        loader.wait_layer(layer)
                    k_buf, v_buf = buffers[layer]
                    h = model.run_layer(layer, h, start, k_buf, v_buf)
                    for w, a, b in jobs:
                        w.write_layer(layer, k_buf[a:b], v_buf[a:b])
                start = end
            assert h is not None
            logits = model.logits(h[-1])
            first = sample(logits, sampling, 0)
            first_lp = (
                None
                if sampling.logprobs is None
                else token_logprobs(logits, first, sampling.logprobs)
            )
            t_stored = time.perf_counter()
            for w in writers:
                w.wait()
            t_end = time.perf_counter()
        except BaseException:
            for w in writers:
                w.abort()
            raise
        finally:
            loader.close()
        return PrefillResult(
            request_id=rid,
            tokens=[int(t) for t in ids_np],
            first_token=first,
            block_keys=keys,
            tail_key=None if tail is None else tail.keys[0],
            cached_tokens=cached,
            computed_tokens=total - cached,
            cached_blocks=cached_blocks,
            stored_blocks=sum(w.stored_blocks for w in writers if w is not tail),
            timings={
                "match_s": t_compute - t0,
                "compute_s": t_stored - t_compute,
                "store_wait_s": t_end - t_stored,
                "total_s": t_end - t0,
            },
            first_logprobs=first_lp,
            last_logits=logits,
        )

    def _writer(self, keys: list[bytes], layout: Any, parent: bytes | None) -> BlockLayerWriter:
        native = self.native if layout == self.layout else False
        return BlockLayerWriter(
            self.pool, keys, layout, parent=parent, executor=self._copier, native=native
        )

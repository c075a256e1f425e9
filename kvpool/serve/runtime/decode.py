"""Decode worker: paged local KV memory and continuous batching.

``PagedKVCache`` is the worker's bounded KV memory: per layer, ``num_pages``
pages of ``page_tokens`` token slots. A request holds a page table (list of
page ids); token position p lives in page ``table[p // page_tokens]``, slot
``p % page_tokens``.

``DecodeEngine.step()`` is one iteration of continuous batching:

1. admit waiting requests in arrival order while the batch has room and the
   cache can give the head of the queue every page it will ever need
   (prompt + ``max_new_tokens - 1`` positions, reserved up front so a running
   request can never run out of memory); if it cannot, it and everything
   behind it wait. Admission loads the prompt's KV from the pool (full blocks
   by key, the tail by its request-private key) into the request's pages;
   anything missing from the pool is recomputed locally (counted in
   ``recomputed_tokens``). With ``overlap_loads`` (default) the load runs on
   a background thread while the batch keeps decoding, and the request joins
   the batch at the first step after its load finished; a load that fails
   fails only its request (a final ``TokenEvent`` with ``error``);
2. one decode step for the whole batch: every running request feeds its last
   token, attention runs over each request's own pages (gathered and padded
   to the longest, with a mask), one token per request is emitted;
3. finished requests (``max_new_tokens`` reached or ``eos_id``) leave the
   batch and free their pages.

The first token comes from prefill; it is emitted at admission, so a
request's event stream is complete from the decode worker alone.
"""

from __future__ import annotations

import math
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass, field

import torch
from torch import Tensor

from kvpool.api import KVStore
from kvpool.index.keys import Namespace
from kvpool.serve.runtime.kv_io import BlockLayerLoader, tail_layout
from kvpool.serve.runtime.model import Transformer
from kvpool.serve.runtime.prefill import PrefillResult
from kvpool.serve.runtime.sampling import (
    GREEDY,
    SamplingParams,
    TokenLogprobs,
    batch_logprobs,
    sample_batch,
)


class PagedKVCache:
    """Fixed pages of per-layer KV; allocation is all-or-nothing."""

    def __init__(
        self,
        model: Transformer,
        num_pages: int,
        page_tokens: int = 16,
    ) -> None:
        if num_pages <= 0 or page_tokens <= 0:
            raise ValueError("num_pages and page_tokens must be positive")
        cfg = model.cfg
        self.num_pages = num_pages
        self.page_tokens = page_tokens
        shape = (cfg.num_layers, num_pages, page_tokens, cfg.num_kv_heads, cfg.head_dim)
        self.k = torch.zeros(shape, dtype=model.dtype, device=model.device)
        self.v = torch.zeros(shape, dtype=model.dtype, device=model.device)
        self._free: deque[int] = deque(range(num_pages))

    @property
    def free_pages(self) -> int:
        return len(self._free)

    @property
    def used_pages(self) -> int:
        return self.num_pages - len(self._free)

    def pages_for(self, tokens: int) -> int:
        return math.ceil(tokens / self.page_tokens)

    def allocate(self, tokens: int) -> list[int] | None:
        """Pages for ``tokens`` positions, or None (nothing taken) when too few are free."""
        need = self.pages_for(tokens)
        if need > len(self._free):
            return None
        return [self._free.popleft() for _ in range(need)]

    def free(self, pages: list[int]) -> None:
        self._free.extend(pages)

    def slots(self, table: Tensor, positions: Tensor) -> Tensor:
        """Flat slot indices (``page * page_tokens + slot``) of ``positions`` under ``table``."""
        pt = self.page_tokens
        return table[positions // pt] * pt + positions % pt

    def write(self, layer: int, slots: Tensor, k: Tensor, v: Tensor) -> None:
        """Store ``k, v [n, kv_heads, hd]`` at flat ``slots [n]``."""
        self.k[layer].view(-1, *k.shape[1:])[slots] = k
        self.v[layer].view(-1, *v.shape[1:])[slots] = v

    def gather(self, layer: int, tables: Tensor) -> tuple[Tensor, Tensor]:
        """K, V ``[B, max_pages * page_tokens, kv_heads, hd]`` of padded page ``tables [B, P]``."""
        k = self.k[layer][tables]
        v = self.v[layer][tables]
        b, p, t = k.shape[:3]
        return k.reshape(b, p * t, *k.shape[3:]), v.reshape(b, p * t, *v.shape[3:])


@dataclass
class DecodeRequest:
    handoff: PrefillResult
    max_new_tokens: int
    eos_id: int | None = None
    sampling: SamplingParams = GREEDY
    output: list[int] = field(default_factory=list)
    pages: list[int] = field(default_factory=list)
    length: int = 0  # positions whose KV is in this request's pages
    finished: bool = False
    error: str | None = None  # set when the request failed (its KV could not be loaded)
    recomputed_tokens: int = 0  # prompt tokens missing from the pool, recomputed here
    submitted_at: float = field(default_factory=time.perf_counter)
    admitted_at: float | None = None
    token_times: list[float] = field(default_factory=list)

    @property
    def request_id(self) -> str:
        return self.handoff.request_id

    @property
    def table(self) -> Tensor:
        return torch.tensor(self.pages, dtype=torch.long)


@dataclass(frozen=True)
class TokenEvent:
    request_id: str
    token: int
    index: int  # 0 for the prefill's first token
    finished: bool
    error: str | None = None  # a failed request's last event (token -1)
    logprobs: TokenLogprobs | None = None  # when the request asked (``runtime.sampling``)


class DecodeEngine:
    """Continuous batching over a bounded paged KV cache, KV taken from a pool."""

    def __init__(
        self,
        model: Transformer,
        pool: KVStore,
        *,
        num_pages: int = 1024,
        page_tokens: int = 16,
        max_batch: int = 32,
        namespace: Namespace | None = None,
        native_layerwise: bool | None = None,
        remove_tail: bool = True,
        overlap_loads: bool = True,
    ) -> None:
        self.model = model
        self.pool = pool
        self.cfg = model.cfg
        self.layout = self.cfg.kv_layout()
        self.namespace = namespace or self.cfg.namespace(model.seed)
        self.cache = PagedKVCache(model, num_pages, page_tokens)
        self.max_batch = max_batch
        self.native = native_layerwise
        self.remove_tail = remove_tail
        self.waiting: deque[DecodeRequest] = deque()
        self.loading: list[tuple[DecodeRequest, Future[None]]] = []
        self.running: list[DecodeRequest] = []
        self.steps = 0
        self._loader = (
            ThreadPoolExecutor(1, thread_name_prefix="kvpool-decode-load")
            if overlap_loads
            else None
        )

    def close(self) -> None:
        """Stop the background loader (after the load in progress, if any)."""
        if self._loader is not None:
            self._loader.shutdown(wait=True)

    def __enter__(self) -> DecodeEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- requests --------------------------------------------------------------

    def submit(
        self,
        handoff: PrefillResult,
        max_new_tokens: int,
        *,
        eos_id: int | None = None,
        sampling: SamplingParams = GREEDY,
    ) -> DecodeRequest:
        """Queue a prefilled request; it joins the batch at a later ``step``."""
        if max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")
        need = handoff.prompt_tokens + max_new_tokens - 1
        if need > self.cfg.max_context:
            raise ValueError(f"{need} positions exceed the model's context {self.cfg.max_context}")
        if self.cache.pages_for(need) > self.cache.num_pages:
            raise ValueError(f"request needs {need} KV positions; the cache holds fewer")
        req = DecodeRequest(handoff, max_new_tokens, eos_id, sampling)
        self.waiting.append(req)
        return req

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.loading and not self.running

    # -- the loop --------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> list[TokenEvent]:
        """Admit what fits, run one decode step for the batch, drop finished requests."""
        events = self._admit()
        if self.running:
            events.extend(self._decode_step())
        self.steps += 1
        return events

    def run(self) -> dict[str, list[int]]:
        """Step until every submitted request finished; outputs by request id."""
        done: dict[str, list[int]] = {}
        pending = [*self.running, *(r for r, _ in self.loading), *self.waiting]
        while not self.idle:
            self.step()
        for req in pending:
            done[req.request_id] = req.output
        return done

    def cancel(self, request_ids: set[str]) -> set[str]:
        """Drop the waiting and running requests with these ids (pages freed; a waiting
        one's tail block removed from the pool); returns the ids dropped. Requests
        still loading are left alone: cancel them once they joined the batch."""
        dropped: set[str] = set()
        for req in [r for r in self.waiting if r.request_id in request_ids]:
            self.waiting.remove(req)
            self._drop_tail(req.handoff)
            dropped.add(req.request_id)
        for req in [r for r in self.running if r.request_id in request_ids]:
            self.running.remove(req)
            self._finish(req)
            dropped.add(req.request_id)
        return dropped

    def abandon(self) -> list[DecodeRequest]:
        """Take every running and waiting request out of the engine (pages freed) and
        return them, e.g. to fail them all after a step raised."""
        reqs = [*self.running, *self.waiting]
        self.running, self.waiting = [], deque()
        for req in reqs:
            self._finish(req)
        return reqs

    def _emit(
        self, req: DecodeRequest, token: int, logprobs: TokenLogprobs | None = None
    ) -> TokenEvent:
        req.output.append(token)
        req.token_times.append(time.perf_counter())
        if len(req.output) >= req.max_new_tokens or token == req.eos_id:
            req.finished = True
        return TokenEvent(
            req.request_id, token, len(req.output) - 1, req.finished, logprobs=logprobs
        )

    def _finish(self, req: DecodeRequest) -> None:
        self.cache.free(req.pages)
        req.pages = []

    def _fail(self, req: DecodeRequest, exc: BaseException) -> TokenEvent:
        self._finish(req)
        req.finished = True
        req.error = f"{type(exc).__name__}: {exc}"
        return TokenEvent(req.request_id, -1, len(req.output), True, req.error)

    def _activate(self, req: DecodeRequest, events: list[TokenEvent]) -> None:
        req.admitted_at = time.perf_counter()
        self.running.append(req)
        events.append(self._emit(req, req.handoff.first_token, req.handoff.first_logprobs))

    def _admit(self) -> list[TokenEvent]:
        events: list[TokenEvent] = []
        # Start loading the queue head while the batch has room and memory allows.
        while self.waiting and len(self.running) + len(self.loading) < self.max_batch:
            req = self.waiting[0]
            h = req.handoff
            if req.max_new_tokens == 1 or h.first_token == req.eos_id:
                self.waiting.popleft()  # done with prefill's token alone: no KV needed
                events.append(self._emit(req, h.first_token, h.first_logprobs))
                req.finished = True
                self._drop_tail(h)
                continue
            pages = self.cache.allocate(h.prompt_tokens + req.max_new_tokens - 1)
            if pages is None:
                break  # the head waits for memory; so does everyone behind it
            self.waiting.popleft()
            req.pages = pages
            if self._loader is None:
                try:
                    self._load_prompt(req)
                except Exception as exc:
                    events.append(self._fail(req, exc))
                    continue
                self._activate(req, events)
            else:
                self.loading.append((req, self._loader.submit(self._load_prompt, req)))
        # Loads run while the batch decodes; a finished load joins the batch
        # (in order: one loader thread). With nothing to decode, wait for one.
        if self.loading and not self.running:
            futures_wait([self.loading[0][1]])
        still: list[tuple[DecodeRequest, Future[None]]] = []
        for req, fut in self.loading:
            if not fut.done():
                still.append((req, fut))
                continue
            error = fut.exception()
            if error is not None:
                events.append(self._fail(req, error))
            else:
                self._activate(req, events)
        self.loading = still
        return events

    def _load_prompt(self, req: DecodeRequest) -> None:
        """Prompt KV: pool blocks, then the tail, recomputing whatever is missing."""
        h, model, bt = req.handoff, self.model, self.layout.block_tokens
        total = h.prompt_tokens
        buffers = model.kv_buffers(total)
        with BlockLayerLoader(
            self.pool, h.block_keys, self.layout, buffers, native=self.native, background=False
        ) as loader:
            loader.wait_all()
            have = loader.count * bt
        if have == len(h.block_keys) * bt and h.tail_key is not None and total > have:
            views = [(k[have:], v[have:]) for k, v in buffers]
            lay = tail_layout(self.layout, total - have)
            with BlockLayerLoader(self.pool, [h.tail_key], lay, views, native=False) as tail:
                tail.wait_all()
                have += tail.count * (total - have)
        self._drop_tail(h)
        if have < total:  # evicted or never stored: recompute locally
            hid = model.embed(torch.tensor(h.tokens[have:], dtype=torch.long, device=model.device))
            for layer in range(self.cfg.num_layers):
                hid = model.run_layer(layer, hid, have, *buffers[layer])
            req.recomputed_tokens = total - have
        dev = model.device
        slots = self.cache.slots(req.table.to(dev), torch.arange(total, device=dev))
        for layer, (k, v) in enumerate(buffers):
            self.cache.write(layer, slots, k, v)
        req.length = total

    def _drop_tail(self, h: PrefillResult) -> None:
        if self.remove_tail and h.tail_key is not None and hasattr(self.pool, "remove"):
            self.pool.remove(h.tail_key)

    def _decode_step(self) -> list[TokenEvent]:
        model, cache, batch = self.model, self.cache, self.running
        dev = model.device
        tokens = torch.tensor([r.output[-1] for r in batch], dtype=torch.long, device=dev)
        positions = torch.tensor([r.length for r in batch], dtype=torch.long, device=dev)
        width = max(len(r.pages) for r in batch)
        rows = [r.pages + [0] * (width - len(r.pages)) for r in batch]  # pad with any page
        tables = torch.tensor(rows, dtype=torch.long, device=dev)
        pt = cache.page_tokens
        slots = tables.gather(1, (positions // pt)[:, None])[:, 0] * pt + positions % pt
        allowed = torch.arange(width * pt, device=dev)[None, :] <= positions[:, None]
        h = model.embed(tokens)[:, None]  # [B, 1, hidden]
        for layer in range(self.cfg.num_layers):
            q, k, v = model.layer_qkv(layer, h, positions[:, None])
            cache.write(layer, slots, k[:, 0], v[:, 0])
            k_all, v_all = cache.gather(layer, tables)
            attn = model.attention(q, k_all, v_all, allowed[:, None])
            h = model.layer_out(layer, h, attn)
        logits = model.logits(h[:, 0])
        params = [r.sampling for r in batch]
        next_tokens = sample_batch(logits, params, [len(r.output) for r in batch])
        logprobs = batch_logprobs(logits, next_tokens, params)
        events = []
        for req, token, lp in zip(batch, next_tokens, logprobs, strict=True):
            req.length += 1
            events.append(self._emit(req, int(token), lp))
        for req in [r for r in batch if r.finished]:
            self._finish(req)
        self.running = [r for r in batch if not r.finished]
        return events

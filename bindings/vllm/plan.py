"""Scheduler side of the vLLM connector: what to load and save, step by step.

Runs in vLLM's scheduler process and never touches KV bytes. For each request
it keeps the kvpool keys of its prompt (computed once), the vLLM block ids
it owns, the token range to load from the pool and the next kvpool block to
save. Each step's ``build`` turns that into plain ``LoadOp`` / ``SaveOp``
records the workers execute (``bindings/vllm/worker.py``).

Rules:
- a hit is the pool's cluster-wide ``prefix_match`` over the prompt's keys,
  minimum over the tensor-parallel ranks, cut so at least one prompt token is
  computed (vLLM needs a token to sample from) and to whole vLLM blocks;
  only what lies beyond vLLM's local hit is loaded, so a local hit that ends
  inside a kvpool block loads only the rest of it;
- a kvpool block is saved in the step whose forward pass completes its last
  prompt token (chunked prefill may spread it over several steps; pages of
  earlier steps are still in the request's vLLM blocks), unless the pool
  already had it when the request was matched;
- an unreachable pool is a miss (``StoreHandle``): never an error, never a hang.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvpool.bindings.engine_store import StoreHandle
from kvpool.bindings.vllm.geometry import Geometry, request_tenant
from kvpool.errors import KVPoolError


@dataclass
class LoadOp:
    """Read pages of consecutive kvpool blocks into vLLM blocks (one request)."""

    req_id: str
    keys: list[list[bytes]]  # [tp rank][segment]: the kvpool block of each segment
    first_page: list[int]  # [segment]: first page of that kvpool block to read
    num_pages: list[int]  # [segment]: pages to read
    block_ids: list[int]  # destination vLLM blocks, all segments in order

    @property
    def num_blocks(self) -> int:
        return len(self.block_ids)


@dataclass
class SaveOp:
    """Write one whole kvpool block from ``pages_per_block`` vLLM blocks."""

    req_id: str
    keys: list[bytes]  # [tp rank]
    block_ids: list[int]


@dataclass
class _Request:
    keys: list[list[bytes]]  # [tp rank][kvpool block]
    prompt_len: int
    block_ids: list[int] = field(default_factory=list)
    local_tokens: int = 0  # vLLM's local hit when last matched
    load: tuple[int, int] | None = None  # token range still to load
    next_save: int = 0  # first kvpool block not saved (nor known stored)


class SchedulerPlan:
    """Per-request bookkeeping behind the connector's scheduler-side calls."""

    def __init__(self, geometry: Geometry, store: StoreHandle, *, load: bool, save: bool):
        self.geometry = geometry
        self.store = store
        self.load_enabled = load
        self.save_enabled = save
        self._requests: dict[str, _Request] = {}

    # -- get_num_new_matched_tokens / update_state_after_alloc ------------------

    def matched_tokens(self, request: Any, num_computed_tokens: int) -> int:
        """Tokens beyond ``num_computed_tokens`` that the pool can supply."""
        state = self._state(request)
        stored = self._stored_blocks(state) if (self.load_enabled or self.save_enabled) else 0
        state.next_save = max(state.next_save, stored)
        state.local_tokens = num_computed_tokens
        if not self.load_enabled:
            return 0
        bs = self.geometry.block_size
        limit = (state.prompt_len - 1) // bs * bs  # leave a prompt token to compute
        hit = min(stored * self.geometry.block_tokens, limit)
        return max(0, hit - num_computed_tokens)

    def allocated(self, request: Any, num_external_tokens: int) -> None:
        state = self._requests.get(request.request_id)
        if state is None or num_external_tokens <= 0:
            return
        start = state.local_tokens
        state.load = (start, start + num_external_tokens)

    def finished(self, req_id: str) -> None:
        self._requests.pop(req_id, None)

    # -- build_connector_meta -----------------------------------------------------

    def build(self, scheduler_output: Any) -> tuple[list[LoadOp], list[SaveOp]]:
        loads: list[LoadOp] = []
        saves: list[SaveOp] = []
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            state = self._requests.get(new.req_id)
            if state is None:
                continue
            state.block_ids = list(new.block_ids[0])
            end = new.num_computed_tokens + scheduled.get(new.req_id, 0)
            self._plan(new.req_id, state, end, loads, saves)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self._requests.get(req_id)
            if state is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                state.block_ids = list(new_ids[0]) if new_ids is not None else []
            elif new_ids is not None:
                state.block_ids.extend(new_ids[0])
            end = cached.num_computed_tokens[i] + scheduled.get(req_id, 0)
            self._plan(req_id, state, end, loads, saves)
        return loads, saves

    def _plan(
        self,
        req_id: str,
        state: _Request,
        computed_end: int,
        loads: list[LoadOp],
        saves: list[SaveOp],
    ) -> None:
        if state.load is not None:
            op = self._load_op(req_id, state, *state.load)
            state.load = None
            if op is not None:
                loads.append(op)
        if not self.save_enabled:
            return
        g = self.geometry
        complete = min(computed_end, state.prompt_len) // g.block_tokens
        complete = min(complete, len(state.block_ids) // g.pages_per_block, len(state.keys[0]))
        while state.next_save < complete:
            i = state.next_save
            ids = state.block_ids[i * g.pages_per_block : (i + 1) * g.pages_per_block]
            saves.append(SaveOp(req_id, [keys[i] for keys in state.keys], ids))
            state.next_save += 1

    def _load_op(self, req_id: str, state: _Request, start: int, end: int) -> LoadOp | None:
        g = self.geometry
        first, last = start // g.block_size, end // g.block_size  # vLLM block indices
        if last <= first or last > len(state.block_ids):
            return None
        op = LoadOp(req_id, [[] for _ in state.keys], [], [], state.block_ids[first:last])
        for p in range(first // g.pages_per_block, (last - 1) // g.pages_per_block + 1):
            lo = max(first, p * g.pages_per_block) - p * g.pages_per_block
            hi = min(last, (p + 1) * g.pages_per_block) - p * g.pages_per_block
            for rank, keys in enumerate(state.keys):
                op.keys[rank].append(keys[p])
            op.first_page.append(lo)
            op.num_pages.append(hi - lo)
        return op

    # -- helpers ----------------------------------------------------------------

    def _state(self, request: Any) -> _Request:
        state = self._requests.get(request.request_id)
        if state is None:
            prompt = list(request.prompt_token_ids or [])
            keys = self.geometry.keys(prompt, request_tenant(request))
            state = self._requests[request.request_id] = _Request(keys, len(prompt))
        return state

    def _stored_blocks(self, state: _Request) -> int:
        """Leading kvpool blocks stored for every TP rank; 0 when the pool is down."""
        if not state.keys[0]:
            return 0
        store = self.store.get()
        if store is None:
            return 0
        try:
            stored = min(store.prefix_match(keys) for keys in state.keys)
        except (KVPoolError, OSError) as exc:
            self.store.failed(exc)
            return 0
        self.store.ok()
        return stored

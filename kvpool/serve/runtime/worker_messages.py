"""The RPC payloads of the prefill and decode workers (msgpack via ``WireMessage``).

The method names and payload shapes are the wire format between ``kvpool
serve``'s front end and its workers; see ``kvpool.serve.runtime.workers``
for what each method does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvpool.rpc.messages import WireMessage


@dataclass
class PrefillCall(WireMessage):
    request_id: str
    tokens: list[int]
    sampling: dict[str, Any] | None = None  # SamplingParams.to_dict(); None: greedy


@dataclass
class DecodeSubmit(WireMessage):
    handoff: dict[str, Any]
    max_new_tokens: int
    eos_id: int | None = None
    sampling: dict[str, Any] | None = None  # SamplingParams.to_dict(); None: greedy


@dataclass
class EventsCall(WireMessage):
    wait_s: float = 1.0


@dataclass
class CancelCall(WireMessage):
    request_id: str


@dataclass
class WorkerLoad(WireMessage):
    """What ``load`` answers (see ``kvpool.serve.sched.routing.WorkerState``)."""

    worker_id: str
    kind: str
    queued_requests: int = 0
    queued_tokens: int = 0
    running: int = 0
    completed: int = 0
    failed: int = 0
    kv_free_tokens: int | None = None
    kv_capacity_tokens: int | None = None
    max_batch: int | None = None
    steps: int = 0
    extra: dict[str, float] = field(default_factory=dict)

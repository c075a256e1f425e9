"""What the front end keeps: its settings, each in-flight request, each worker's handle.

A ``ServeRequest`` is owned by the coroutine answering it; other threads
(the decode pump, the supervisor) only ``push`` events to it, which is
thread-safe. A ``WorkerHandle``'s mutable fields are changed under the
fleet's lock (``WorkerFleet.lock``); ``generation`` counts the worker's
incarnations, so a thread serving an old incarnation can tell it is stale.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from kvpool.procs import Child
from kvpool.rpc.client import RpcClient
from kvpool.serve.runtime.checkpoint.chat import ChatTemplate
from kvpool.serve.runtime.checkpoint.config import Checkpoint
from kvpool.serve.runtime.http.stopping import StopState
from kvpool.serve.runtime.sampling import GREEDY, SamplingParams, TokenLogprobs
from kvpool.serve.runtime.tokenizer import EOS, VOCAB_SIZE, ByteTokenizer, TextTokenizer
from kvpool.serve.sched.presets import ModelConfig


@dataclass
class ServeSettings:
    """``kvpool serve``'s options the front end needs."""

    model: ModelConfig
    served_name: str
    seed: int = 0
    max_tokens_limit: int = 4096  # largest max_tokens a request may ask for
    decode_kv_tokens: int = 32768  # each decode worker's KV memory
    page_tokens: int = 16
    restart: bool = True  # restart dead workers
    events_wait_s: float = 1.0
    groups: dict[str, list[str]] = field(default_factory=dict)  # pipeline group -> stages
    chunk_tokens: int = 512  # the pipeline's chunk
    checkpoint: Checkpoint | None = None  # a Hugging Face checkpoint (else a preset)
    api_key: str | None = None  # Bearer key the /v1 routes require (None: open)
    max_body_bytes: int = 16 << 20  # larger request bodies answer 413

    @property
    def eos_id(self) -> int | None:
        if self.checkpoint is not None:
            return self.checkpoint.eos_id
        return EOS if self.model.vocab_size == VOCAB_SIZE else None

    def chat_template(self) -> ChatTemplate | None:
        """The checkpoint's chat template (None: none, or a preset)."""
        return ChatTemplate.load(self.checkpoint.path) if self.checkpoint else None

    @property
    def eos_ids(self) -> frozenset[int]:
        """Every EOS id of the checkpoint (the decode workers stop at ``eos_id``)."""
        return frozenset(self.checkpoint.eos_ids) if self.checkpoint else frozenset()

    def tokenizer(self) -> TextTokenizer:
        """The checkpoint's tokenizer, or the byte tokenizer of the presets."""
        if self.checkpoint is not None:
            from kvpool.serve.runtime.checkpoint.hf_tokenizer import HFTokenizer

            return HFTokenizer(self.checkpoint)
        return ByteTokenizer()


@dataclass
class WorkerHandle:
    """One worker id's current process, its RPC client and the requests it holds."""

    worker_id: str
    kind: str
    child: Child | None = None
    client: RpcClient | None = None
    alive: bool = False
    broken: bool = False  # connection lost; the supervisor replaces it
    restarts: int = 0
    inflight: dict[str, ServeRequest] = field(default_factory=dict)
    reported: dict[str, Any] = field(default_factory=dict)
    generation: int = 0
    started_at: float = 0.0  # monotonic time of the last (re)start
    quick_failures: int = 0  # deaths soon after a start, in a row
    retry_at: float = 0.0

    @property
    def pid(self) -> int | None:
        return self.child.pid if self.child else None


@dataclass
class ServeRequest:
    """One completion in flight: its tokens, timings and the events for its coroutine.

    A request with ``n > 1`` is ``n`` of these (``index`` 0..n-1, each with its
    own ``id`` towards the workers and the answer's ``response_id``)."""

    id: str
    tokens: list[int]
    max_tokens: int
    eos_id: int | None
    stream: bool
    include_usage: bool
    arrival: float
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[tuple[Any, ...]] = field(default_factory=asyncio.Queue)
    prefill_worker: str = ""
    decode_worker: str = ""
    cached_tokens: int = 0
    computed_tokens: int = 0
    output: list[int] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    finished: bool = False
    error: str | None = None
    prefill_timings: dict[str, float] = field(default_factory=dict)
    pipeline: list[str] = field(default_factory=list)  # the stages, when pipelined
    stopper: StopState | None = None  # the text and stop conditions
    chat: bool = False  # answered as chat.completion(.chunk)
    sampling: SamplingParams = GREEDY
    index: int = 0  # the choice this is of an ``n > 1`` request
    response_id: str = ""  # the id of the answer (choice 0's ``id``; "": ``id``)
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)  # per output token

    def __post_init__(self) -> None:
        self.response_id = self.response_id or self.id

    def push(self, item: tuple[Any, ...]) -> None:
        """Thread-safe: hand an event to the request's coroutine."""
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)

    @property
    def ttft(self) -> float | None:
        return self.times[0] - self.arrival if self.times else None

    @property
    def tbt(self) -> list[float]:
        return [b - a for a, b in zip(self.times, self.times[1:], strict=False)]

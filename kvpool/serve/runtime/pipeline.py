"""Chunked pipeline parallelism (CPP): one long prompt prefilled by k worker processes.

A ``CppGroup`` starts k stage processes (``kvpool.serve.runtime.pipeline_stage``), each
owning a contiguous layer range (``split_layers``). The prompt is cut into
chunks; chunk i runs through stage 1, 2, ..., k while stage 1 already works
on chunk i+1, so after the pipeline fills every stage computes at once. Only
the hidden states at a stage boundary cross between processes (RPC frames
carrying raw bytes, stage to stage directly).

Storing the KV: the pool commits a block only with all of its layers, but
here each stage holds only its own layers. The protocol (chosen over
per-stage staging keys that a last stage would re-read and re-assemble,
which would move every byte twice):

1. the coordinator (``CppGroup.prefill``, the process that took the request)
   matches the cached prefix and *reserves* every new block (and the
   request's private tail block, ``kv_io.tail_key``) with ``pool.reserve``;
2. it hands each stage the reservations' placements (allocation id, node,
   offset: ``RemoteBlockWriter.export``) and the nodes' addresses; each stage
   adopts them (``RemotePool.adopt``) and writes the byte ranges of its own
   layers of each block straight into the reserved space (same transports as
   any client write) as soon as the chunk completing that block has passed
   its layers;
3. when every stage has reported its writes done, the coordinator commits
   the blocks. A block therefore becomes visible only when all of its layers
   are written, exactly as after a single-worker prefill; if any stage fails
   the coordinator aborts every reservation (nothing half-written appears).

The cached prefix (``prefix_match``) is loaded by each stage for its own
layers only. The chunking follows ``PrefillWorker``'s: with the same chunk
size the KV bytes and the first token are bit-identical to a single-worker
prefill (``tests/test_cpp.py`` checks it across real processes).

Needs a distributed pool (``kvpool://`` master): the stages are separate
processes.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import FIRST_EXCEPTION, wait
from dataclasses import dataclass
from typing import Any

import numpy as np

import kvpool
from kvpool.cluster.client.handles import RemoteBlockWriter, ReservationTicket
from kvpool.cluster.client.remote_pool import RemotePool
from kvpool.index.keys import block_keys, root_key, token_array
from kvpool.procs import Child, start, wait_ready
from kvpool.rpc import RpcClient
from kvpool.serve.runtime.kv_io import tail_key, tail_layout
from kvpool.serve.runtime.pipeline_stage import MAX_FRAME
from kvpool.serve.runtime.prefill import PrefillResult
from kvpool.serve.runtime.sampling import GREEDY, SamplingParams
from kvpool.serve.sched.presets import ModelConfig, get_preset


def split_layers(num_layers: int, stages: int) -> list[tuple[int, int]]:
    """Contiguous layer ranges ``[a, b)`` for ``stages`` stages, as even as possible."""
    if not 1 <= stages <= num_layers:
        raise ValueError(f"cannot split {num_layers} layers into {stages} stages")
    base, extra = divmod(num_layers, stages)
    out, a = [], 0
    for i in range(stages):
        b = a + base + (1 if i < extra else 0)
        out.append((a, b))
        a = b
    return out


@dataclass
class StageProc:
    child: Child
    layers: tuple[int, int]
    client: RpcClient

    @property
    def address(self) -> str:
        return self.child.address

    def stop(self) -> None:
        self.client.close()
        self.child.stop(10.0)


def spawn_stage(
    pool_url: str,
    layers: tuple[int, int],
    *,
    preset: str = "tiny",
    seed: int = 0,
    block_tokens: int | None = None,
    threads: int = 1,
    cpus: set[int] | None = None,
    timeout: float = 60.0,
) -> StageProc:
    """Start one stage process and wait for its ready line."""
    args = [
        "-m",
        "kvpool.serve.runtime.pipeline_stage",
        "--pool",
        pool_url,
        "--preset",
        preset,
        "--seed",
        str(seed),
        "--layers",
        f"{layers[0]}:{layers[1]}",
        "--threads",
        str(threads),
    ]
    if block_tokens is not None:
        args += ["--block-tokens", str(block_tokens)]
    name = f"stage {layers[0]}:{layers[1]}"
    child = start(name, args, cpus=cpus, env={"OMP_NUM_THREADS": str(threads)})
    wait_ready(child, timeout)
    client = RpcClient(child.address, timeout=600.0, max_frame=MAX_FRAME)
    return StageProc(child, layers, client)


class CppGroup:
    """A pipeline of ``stages`` prefill processes over one distributed pool.

    ``stages=1`` is a single prefill worker process on the same code path
    (the fair baseline of ``kvpool bench cpp``).
    """

    def __init__(
        self,
        pool_url: str,
        *,
        stages: int = 2,
        preset: str = "tiny",
        seed: int = 0,
        block_tokens: int | None = None,
        chunk_tokens: int = 512,
        threads: int = 1,
        cpus: Sequence[set[int] | None] | None = None,
    ) -> None:
        self.cfg: ModelConfig = get_preset(preset, block_tokens=block_tokens)
        self.layout = self.cfg.kv_layout()
        self.seed = seed
        self.namespace = self.cfg.namespace(seed)
        self.chunk_tokens = chunk_tokens
        self.pool = kvpool.connect(pool_url, timeout=30.0)
        self.stages: list[StageProc] = []
        try:
            for i, layers in enumerate(split_layers(self.cfg.num_layers, stages)):
                self.stages.append(
                    spawn_stage(
                        pool_url,
                        layers,
                        preset=preset,
                        seed=seed,
                        block_tokens=block_tokens,
                        threads=threads,
                        cpus=None if cpus is None else cpus[i],
                    )
                )
            for a, b in zip(self.stages, self.stages[1:], strict=False):
                a.client.call("link", {"address": b.address})
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        for stage in self.stages:
            stage.stop()
        self.stages = []
        self.pool.close()

    def __enter__(self) -> CppGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def prefill(
        self,
        tokens: Sequence[int] | np.ndarray,
        *,
        request_id: str | None = None,
        chunk_tokens: int | None = None,
        store_tail: bool = True,
    ) -> PrefillResult:
        """Prefill ``tokens`` through the pipeline; the result is what a
        single-worker prefill returns (``timings`` adds the pipeline's:
        ``ttft_s``, ``bubble``, per-stage ``busy_s``)."""
        return pipeline_prefill(
            self.pool,
            self.cfg,
            [s.client for s in self.stages],
            tokens,
            chunk_tokens=chunk_tokens or self.chunk_tokens,
            request_id=request_id,
            store_tail=store_tail,
            seed=self.seed,
        )


def pipeline_prefill(
    pool: RemotePool,
    cfg: ModelConfig,
    clients: Sequence[RpcClient],
    tokens: Sequence[int] | np.ndarray,
    *,
    chunk_tokens: int = 512,
    request_id: str | None = None,
    store_tail: bool = True,
    timeout: float = 600.0,
    seed: int = 0,
    sampling: SamplingParams = GREEDY,
) -> PrefillResult:
    """Coordinate one pipeline prefill over stage RPC clients (``clients[i]`` runs
    stage i, already ``link``-ed to stage i+1), with ``pool`` reserving and
    committing the blocks (see the module docstring). Used by ``CppGroup`` and
    by ``kvpool serve --cpp-group`` (where the front end is the coordinator
    and the stages are prefill workers). When a stage fails (an error reply or
    a lost connection) every other stage is told to ``abort`` the request,
    every reservation is aborted and the error is raised."""
    layout = cfg.kv_layout()
    namespace = cfg.namespace(seed)
    ids = token_array(tokens)
    total = int(ids.size)
    if total == 0:
        raise ValueError("empty prompt")
    if total > cfg.max_context:
        raise ValueError(f"{total} tokens exceed the model's context of {cfg.max_context}")
    chunk = chunk_tokens
    rid = request_id or uuid.uuid4().hex
    bt = layout.block_tokens
    t0 = time.perf_counter()
    keys = block_keys(ids, namespace, bt)
    hit = pool.prefix_match(keys) if keys else 0
    cached = min(hit * bt, total - 1)
    writers: list[RemoteBlockWriter] = []
    writes: list[dict[str, Any]] = []
    regions: dict[str, dict[str, Any]] = {}
    tail = None
    try:
        new = keys[hit:]  # reserved in one allocation round trip
        parents = [keys[i - 1] if i else None for i in range(hit, len(keys))]
        reserved = pool.reserve_batch(new, [layout.block_bytes] * len(new), parents)
        writers += [w for w in reserved if w is not None]  # aborted below on any error
        for i, w in enumerate(reserved, start=hit):
            if w is not None:
                writes.append(_write_spec(w.export(), i * bt, bt, regions))
        if store_tail and total % bt:
            start = (total // bt) * bt
            parent = keys[-1] if keys else root_key(namespace, bt)
            tkey = tail_key(namespace, rid, parent, ids[start:])
            size = tail_layout(layout, total - start).block_bytes
            tail = pool.reserve(tkey, size)
            if tail is not None:
                writers.append(tail)
                writes.append(_write_spec(tail.export(), start, total - start, regions))
        begin = {
            "rid": rid,
            "total": total,
            "cached": cached,
            "cached_keys": keys[:hit],
            "chunk": chunk,
            "writes": writes,
            "nodes": regions,
            "sampling": sampling.to_dict(),
        }
        # later stages first, so they expect chunks before the first stage sends any
        for client in reversed(clients[1:]):
            client.call("begin", begin, timeout=60.0)
        t_start = time.perf_counter()
        clients[0].call("begin", {**begin, "tokens": ids.astype("<i4").tobytes()}, timeout=60.0)
        results = _results(clients, rid, timeout)
        t_first_token = time.perf_counter()
        errors = [r["error"] for r in results if r["error"]]
        if errors:
            raise RuntimeError(f"pipeline prefill failed: {errors[0]}")
        RemoteBlockWriter.commit_all(writers)  # one seal exchange per node, one master trip
        t_end = time.perf_counter()
    except BaseException:
        for w in writers:
            if not w.done:
                w.abort()
        raise
    span = max(r["t_last"] for r in results) - min(r["t_first"] for r in results)
    busy = [float(r["busy_s"]) for r in results]
    bubble = 1.0 - sum(busy) / (len(busy) * span) if span > 0 else 0.0
    first = results[-1]["first_token"]
    assert first is not None
    n_tail = 1 if tail is not None else 0
    return PrefillResult(
        request_id=rid,
        tokens=[int(t) for t in ids],
        first_token=int(first),
        first_logprobs=results[-1].get("first_logprobs"),
        block_keys=keys,
        tail_key=None if tail is None else tail.key,
        cached_tokens=cached,
        computed_tokens=total - cached,
        cached_blocks=hit,
        stored_blocks=len(writers) - n_tail,
        timings={
            "match_s": t_start - t0,
            "compute_s": t_first_token - t_start,
            "store_wait_s": t_end - t_first_token,
            "total_s": t_end - t0,
            "ttft_s": t_first_token - t0,
            "span_s": span,
            "bubble": bubble,
            "busy_s": busy,  # type: ignore[dict-item]
            "chunks": float(results[0]["chunks"]),
        },
    )


def _results(clients: Sequence[RpcClient], rid: str, timeout: float) -> list[dict[str, Any]]:
    """Every stage's ``result`` for ``rid``. On the first failure (error reply,
    lost connection, timeout) the other stages are told to ``abort`` so none
    waits for chunks that will never come, and the failure is raised."""
    futs = [c.submit("result", {"rid": rid, "timeout": timeout}) for c in clients]
    done, pending = wait(futs, timeout=timeout, return_when=FIRST_EXCEPTION)
    failed = [f for f in done if f.exception() is not None]
    if failed or pending:
        for c in clients:
            with contextlib.suppress(Exception):
                c.submit("abort", {"rid": rid, "error": "the coordinator gave up"})
        for f in pending:
            f.cancel()
        if failed:
            raise failed[0].exception()  # type: ignore[misc]
        raise TimeoutError(f"pipeline prefill {rid} timed out after {timeout} s")
    return [f.result() for f in futs]


def _write_spec(
    ticket: ReservationTicket, start: int, rows: int, regions: dict[str, dict[str, Any]]
) -> dict[str, Any]:
    """One ``begin`` write: the exported reservation ``ticket`` and the token rows
    [start, start+rows) it holds; its nodes' regions join ``regions``."""
    regions.update(ticket.nodes)
    return {
        "ttl_s": ticket.ttl_s,
        "epoch": ticket.epoch,  # the master term: the stage's writes are stamped with it
        "parent": ticket.parent,
        "key": ticket.key,
        "start": start,
        "rows": rows,
        "alloc": [list(alloc) for alloc in ticket.allocations],
    }

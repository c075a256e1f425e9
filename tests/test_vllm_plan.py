"""Unit tests of the vLLM connector's parts that need no vLLM: plan, pages, transfers.

The end-to-end proof runs real vLLM processes (tests/test_vllm_connector.py);
these pin the planning arithmetic, the page moves on several tensor layouts
and the failure paths with real stores (an embedded pool, a dead address) and
vLLM-shaped stand-ins for its request and scheduler-output records.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from kvpool.bindings.engine_store import StoreConfig, StoreHandle, close_embedded_pools
from kvpool.bindings.vllm.counters import CounterSink
from kvpool.bindings.vllm.geometry import Geometry
from kvpool.bindings.vllm.pages import PagedLayers, layer_number
from kvpool.bindings.vllm.plan import SchedulerPlan
from kvpool.bindings.vllm.worker import WorkerTransfers

BS, T, LAYERS, NUM_BLOCKS = 32, 512, 2, 80
PAGE_SHAPE = (2, BS, 16)  # kv_heads, block_size, 2*head_size (the CPU backend's page)
PAGE_BYTES = 2 * BS * 16 * 2  # bf16


def geometry(**kw: Any) -> Geometry:
    args: dict[str, Any] = dict(
        num_layers=LAYERS,
        block_size=BS,
        block_tokens=T,
        page_bytes=PAGE_BYTES,
        tp_size=1,
        model_id="tiny",
        page_format="test",
    )
    return Geometry(**{**args, **kw})


_pools = iter(range(10**6))


def embedded() -> StoreHandle:
    """A fresh embedded pool (a new name: embedded pools are shared per name in a process)."""
    return StoreHandle(StoreConfig(embedded={"dram_bytes": 64 << 20, "name": str(next(_pools))}))


@pytest.fixture(autouse=True)
def _close_pools() -> Iterator[None]:
    yield
    close_embedded_pools()


def request(req_id: str, n: int, salt: str | None = None) -> SimpleNamespace:
    ids = [(i * 7919) % 1000 + 1 for i in range(n)]
    return SimpleNamespace(
        request_id=req_id, prompt_token_ids=ids, cache_salt=salt, lora_request=None
    )


def new_req(req: SimpleNamespace, block_ids: list[int], computed: int) -> SimpleNamespace:
    return SimpleNamespace(
        req_id=req.request_id, block_ids=(block_ids,), num_computed_tokens=computed
    )


def step(new: list[SimpleNamespace], scheduled: dict[str, int], cached: Any = None) -> Any:
    cached = cached or SimpleNamespace(
        req_ids=[], new_block_ids=[], num_computed_tokens=[], resumed_req_ids=set()
    )
    return SimpleNamespace(
        scheduled_new_reqs=new, scheduled_cached_reqs=cached, num_scheduled_tokens=scheduled
    )


def kv_caches(layout: str = "cpu") -> dict[str, torch.Tensor]:
    """Per-layer views into one buffer, as vLLM's CPU backend registers them."""
    if layout == "cpu":
        buffer = torch.zeros(NUM_BLOCKS, LAYERS, *PAGE_SHAPE, dtype=torch.bfloat16)
        return {f"model.layers.{i}.self_attn.attn": buffer[:, i] for i in range(LAYERS)}
    # FlashAttention-like: [2, num_blocks, block_size, heads, head_size] per layer
    return {
        f"model.layers.{i}.self_attn.attn": torch.zeros(
            2, NUM_BLOCKS, BS, 2, 8, dtype=torch.bfloat16
        )
        for i in range(LAYERS)
    }


def fill(caches: dict[str, torch.Tensor], seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for tensor in caches.values():
        tensor.copy_(torch.randn(tensor.shape, generator=gen).to(tensor.dtype))


def page(tensor: torch.Tensor, block: int, dim: int) -> torch.Tensor:
    return tensor.select(dim, block)


def test_hit_leaves_a_token_and_counts_only_past_the_local_hit() -> None:
    store = embedded()
    plan = SchedulerPlan(geometry(), store, load=True, save=True)
    req = request("r", 1024)
    assert plan.matched_tokens(req, 0) == 0
    pool = store.get()
    assert pool is not None
    for key in geometry().keys(req.prompt_token_ids, None)[0]:
        pool.put(key, bytes(geometry().pool_block_bytes))
    # all 1,024 prompt tokens are stored, but one vLLM block stays to compute
    assert plan.matched_tokens(req, 0) == 1024 - BS
    assert plan.matched_tokens(req, 544) == 1024 - BS - 544
    assert plan.matched_tokens(request("salted", 1024, salt="s"), 0) == 0


def test_partial_local_hit_reads_the_rest_of_a_block() -> None:
    store = embedded()
    g = geometry()
    plan = SchedulerPlan(g, store, load=True, save=False)
    req = request("r", 1100)
    pool = store.get()
    assert pool is not None
    keys = g.keys(req.prompt_token_ids, None)[0]
    for key in keys:
        pool.put(key, bytes(g.pool_block_bytes))
    ext = plan.matched_tokens(req, 544)
    assert ext == 1024 - 544
    plan.allocated(req, ext)
    blocks = list(range(100, 135))
    loads, saves = plan.build(step([new_req(req, blocks, 1024)], {"r": 76}))
    assert saves == []
    (op,) = loads
    assert op.keys == [[keys[1]]]
    assert (op.first_page, op.num_pages) == ([1], [15])
    assert op.block_ids == blocks[17:32]


def test_saves_each_block_in_the_step_that_completes_it() -> None:
    g = geometry()
    plan = SchedulerPlan(g, embedded(), load=True, save=True)
    req = request("r", 1100)
    assert plan.matched_tokens(req, 0) == 0
    plan.allocated(req, 0)
    keys = g.keys(req.prompt_token_ids, None)[0]
    # chunked prefill: 600 tokens, then the rest
    loads, saves = plan.build(step([new_req(req, list(range(19)), 0)], {"r": 600}))
    assert loads == [] and [s.keys for s in saves] == [[keys[0]]]
    assert saves[0].block_ids == list(range(16))
    cached = SimpleNamespace(
        req_ids=["r"],
        new_block_ids=[(list(range(19, 35)),)],
        num_computed_tokens=[600],
        resumed_req_ids=set(),
    )
    _, saves = plan.build(step([], {"r": 500}, cached))
    assert [s.keys for s in saves] == [[keys[1]]]
    assert saves[0].block_ids == list(range(16, 32))
    _, saves = plan.build(step([], {"r": 1}, cached))  # decode steps save nothing more
    assert saves == []


def test_roles_producer_saves_consumer_only_loads() -> None:
    g = geometry()
    req = request("r", 600)
    producer = SchedulerPlan(g, embedded(), load=False, save=True)
    assert producer.matched_tokens(req, 0) == 0
    _, saves = producer.build(step([new_req(req, list(range(19)), 0)], {"r": 600}))
    assert len(saves) == 1
    consumer = SchedulerPlan(g, embedded(), load=True, save=False)
    consumer.matched_tokens(req, 0)
    assert consumer.build(step([new_req(req, list(range(19)), 0)], {"r": 600})) == ([], [])


def test_pool_down_is_a_miss_without_waiting_per_request() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    handle = StoreHandle(StoreConfig(url=f"kvpool://127.0.0.1:{port}", timeout=1.0, retry_s=60))
    plan = SchedulerPlan(geometry(), handle, load=True, save=True)
    started = time.monotonic()
    assert plan.matched_tokens(request("a", 1100), 0) == 0
    first = time.monotonic() - started
    started = time.monotonic()
    for i in range(20):
        assert plan.matched_tokens(request(f"b{i}", 1100), 0) == 0
    assert time.monotonic() - started < 1.0  # backed off: no call until retry_s
    assert first < 10


@pytest.mark.parametrize(
    "extra",
    [
        {},
        {"url": "kvpool://h:1", "embedded": True},
        {"url": 5},
        {"embedded": 3},
        {"embedded": True, "timeout": 0},
        {"embedded": True, "timeout": float("nan")},
        {"embedded": True, "retry_s": float("inf")},
    ],
)
def test_bad_store_config_is_a_clear_error(extra: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="KVPoolConnector"):
        StoreConfig.from_extra(extra, owner="KVPoolConnector")


def test_geometry_rejects_blocks_that_do_not_tile() -> None:
    with pytest.raises(ValueError, match="multiple"):
        geometry(block_tokens=500)


@pytest.mark.parametrize("layout", ["cpu", "flash"])
def test_pages_round_trip_through_the_pool(layout: str) -> None:
    """Save a block's pages from one cache, load them into other blocks of another."""
    g = geometry()
    store, counters = embedded(), CounterSink()
    src, dst = kv_caches(layout), kv_caches(layout)
    fill(src, seed=1)
    saver = WorkerTransfers(g, store, counters)
    saver.register(src, NUM_BLOCKS)
    loader = WorkerTransfers(g, store, counters)
    loader.register(dst, NUM_BLOCKS)
    dim = saver.pages.block_dim if saver.pages else -1
    req = request("r", 600)
    key = g.keys(req.prompt_token_ids, None)[0][0]
    from kvpool.bindings.vllm.plan import LoadOp, SaveOp

    save = SaveOp("r", [key], list(range(1, 17)))
    for name, tensor in src.items():
        saver.save_layer(name, tensor, [save])
    saver.finish_saves([save])
    assert counters.take().saved_blocks == 1
    # a local hit of 3 pages: load pages 3..15 into blocks 40..52
    load = LoadOp("r", [[key]], [3], [13], list(range(40, 53)))
    loader.start_load([load])
    for name in dst:
        loader.wait_layer(name)
    assert loader.take_failed() == set()
    for name in src:
        for i in range(13):
            assert torch.equal(page(dst[name], 40 + i, dim), page(src[name], 4 + i, dim))
        assert not page(dst[name], 39, dim).any() and not page(dst[name], 53, dim).any()
    taken = counters.take()
    assert taken.loaded_bytes == 13 * LAYERS * PAGE_BYTES and taken.load_failed_blocks == 0


def test_a_block_missing_at_load_time_is_reported_for_recompute() -> None:
    g = geometry()
    counters = CounterSink()
    worker = WorkerTransfers(g, embedded(), counters)
    caches = kv_caches()
    worker.register(caches, NUM_BLOCKS)
    from kvpool.bindings.vllm.plan import LoadOp

    key = g.keys(request("r", 600).prompt_token_ids, None)[0][0]
    worker.start_load([LoadOp("r", [[key]], [0], [16], list(range(1, 17)))])
    for name in caches:
        worker.wait_layer(name)
    assert worker.take_failed() == set(range(1, 17))
    assert not any(t.any() for t in caches.values())  # nothing written
    assert counters.take().load_failed_blocks == 16


class _LosesKey:
    """An embedded pool whose batch reads of ``lost`` fail (its node died under
    them): None in their place, the other reads' bytes as they are."""

    def __init__(self, pool: Any, lost: bytes) -> None:
        self.pool, self.lost = pool, lost

    def __getattr__(self, name: str) -> Any:
        return getattr(self.pool, name)

    def get_into_batch(self, keys: Any, outs: Any, **ranges: Any) -> Any:
        got = self.pool.get_into_batch(keys, outs, **ranges)
        for i, key in enumerate(keys):
            if key == self.lost:
                outs[i][:] = 0
                got[i] = None
        return got


def test_a_read_failing_in_a_layers_batch_fails_only_its_blocks() -> None:
    """A layer's reads go in one batch into staging; a failed read leaves a gap there,
    which the reads behind it close before the scatter: their pages land where they
    belong, the failed block's vLLM blocks are reported and left unwritten."""
    from kvpool.bindings.vllm.plan import LoadOp, SaveOp

    g = geometry()
    store, counters = embedded(), CounterSink()
    src, dst = kv_caches(), kv_caches()
    fill(src, seed=4)
    saver = WorkerTransfers(g, store, counters)
    saver.register(src, NUM_BLOCKS)
    first, second = g.keys(request("r", 1100).prompt_token_ids, None)[0][:2]
    saves = [SaveOp("r", [first], list(range(1, 17))), SaveOp("r", [second], list(range(17, 33)))]
    for name, tensor in src.items():
        saver.save_layer(name, tensor, saves)
    saver.finish_saves(saves)
    assert counters.take().saved_blocks == 2
    losing = _LosesKey(store.get(), first)

    class LosingHandle(StoreHandle):
        def get(self) -> Any:
            return losing

    loader = WorkerTransfers(g, LosingHandle(store.config), counters)
    loader.register(dst, NUM_BLOCKS)
    dim = loader.pages.block_dim if loader.pages else -1
    loader.start_load([LoadOp("r", [[first, second]], [0, 0], [16, 16], list(range(40, 72)))])
    for name in dst:
        loader.wait_layer(name)
    assert loader.take_failed() == set(range(40, 56))
    for name in src:
        for i in range(16):
            assert not page(dst[name], 40 + i, dim).any()
            assert torch.equal(page(dst[name], 56 + i, dim), page(src[name], 17 + i, dim))


def test_registered_caches_must_match_the_spec() -> None:
    with pytest.raises(ValueError, match="bytes"):
        PagedLayers(kv_caches(), NUM_BLOCKS, geometry(page_bytes=PAGE_BYTES * 2))
    with pytest.raises(ValueError, match="layers"):
        PagedLayers(kv_caches(), NUM_BLOCKS, geometry(num_layers=3))
    assert layer_number("model.layers.12.self_attn.attn") == 12


class _SlowStore:
    """An embedded pool whose reads take ``delay`` seconds (a stalled node)."""

    def __init__(self, pool: Any, delay: float) -> None:
        self.pool, self.delay = pool, delay

    def __getattr__(self, name: str) -> Any:
        return getattr(self.pool, name)

    def get_into_batch(self, *args: Any, **kw: Any) -> Any:
        time.sleep(self.delay)
        return self.pool.get_into_batch(*args, **kw)


def test_a_stalled_load_times_out_and_never_writes_late() -> None:
    from kvpool.bindings.vllm.plan import LoadOp, SaveOp

    g = geometry()
    store, counters = embedded(), CounterSink()
    src = kv_caches()
    fill(src, seed=3)
    saver = WorkerTransfers(g, store, counters)
    saver.register(src, NUM_BLOCKS)
    key = g.keys(request("r", 600).prompt_token_ids, None)[0][0]
    save = SaveOp("r", [key], list(range(1, 17)))
    for name, tensor in src.items():
        saver.save_layer(name, tensor, [save])
    saver.finish_saves([save])
    slow_store = _SlowStore(store.get(), delay=0.5)

    class SlowHandle(StoreHandle):
        def get(self) -> Any:
            return slow_store

    slow = SlowHandle(store.config)
    dst = kv_caches()
    loader = WorkerTransfers(g, slow, counters, load_timeout_s=0.1)
    loader.register(dst, NUM_BLOCKS)
    started = time.monotonic()
    loader.start_load([LoadOp("r", [[key]], [0], [16], list(range(1, 17)))])
    for name in dst:
        loader.wait_layer(name)
    assert loader.take_failed() == set(range(1, 17))
    assert time.monotonic() - started < 2.0
    time.sleep(1.2)  # the stalled reads finish now: their bytes must not land
    assert not any(t.any() for t in dst.values())


def test_a_failed_batch_commit_counts_the_blocks_stored(caplog: pytest.LogCaptureFixture) -> None:
    """The saver's ``commit_all`` failure branch against a real cluster: block A is
    reserved and written, then its reservation expires at the master (``--alloc-ttl``
    2 s); block B is reserved and written after that; the step's commit of both stores
    B and raises for A. The worker counts by ``exists``: 1 saved, 1 failed; A is not
    stored and B reads back as the pages it was saved from."""
    from clusterhelpers import start_cluster, wait_until

    from kvpool.bindings.vllm.plan import LoadOp, SaveOp

    g = geometry()
    cluster = start_cluster(["64MiB"], "--alloc-ttl", "2")
    try:
        store, counters = StoreHandle(StoreConfig(url=cluster.url, timeout=10.0)), CounterSink()
        src = kv_caches()
        fill(src, seed=4)
        saver = WorkerTransfers(g, store, counters)
        saver.register(src, NUM_BLOCKS)
        ids = request("r", 600).prompt_token_ids
        key_a, key_b = (g.keys(ids, salt)[0][0] for salt in ("a", "b"))
        save_a, save_b = (
            SaveOp("a", [key_a], list(range(1, 17))),
            SaveOp("b", [key_b], list(range(17, 33))),
        )
        for name, tensor in src.items():
            saver.save_layer(name, tensor, [save_a])
        pool = store.get()
        assert pool is not None
        # A's reservation expires (the master's reaper runs every 0.5 s)
        time.sleep(3.5)
        for name, tensor in src.items():
            saver.save_layer(name, tensor, [save_b])
        saver.finish_saves([save_a, save_b])
        taken = counters.take()
        assert (taken.saved_blocks, taken.save_failed_blocks) == (1, 1)
        # the commit raised: A's range went to B (A's seal refused) or A was lost
        assert "refused to seal" in caplog.text or "not stored" in caplog.text
        assert wait_until(lambda: pool.exists([key_a, key_b]) == [False, True])
        reader = StoreHandle(StoreConfig(url=cluster.url, timeout=10.0))
        dst = kv_caches()
        loader = WorkerTransfers(g, reader, CounterSink())
        loader.register(dst, NUM_BLOCKS)
        loader.start_load([LoadOp("b", [[key_b]], [0], [16], list(range(40, 56)))])
        for name in dst:
            loader.wait_layer(name)
        assert loader.take_failed() == set()
        dim = loader.pages.block_dim if loader.pages else -1
        for name in src:
            for i in range(16):
                assert torch.equal(page(dst[name], 40 + i, dim), page(src[name], 17 + i, dim))
        reader.close()
        store.close()
    finally:
        cluster.stop()

"""Prefill -> pool -> decode: exactness against the no-cache reference, prefix reuse,
continuous batching and the paged KV memory bound."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

from kvpool import Pool
from kvpool.serve.runtime.decode import DecodeEngine
from kvpool.serve.runtime.kv_io import BlockLayerLoader, BlockLayerWriter
from kvpool.serve.runtime.model import Transformer, build_model, generate
from kvpool.serve.runtime.prefill import PrefillWorker

torch.set_num_threads(1)
BT = 16  # block tokens in these tests


@pytest.fixture(scope="module")
def model() -> Transformer:
    return build_model("tiny", seed=0, block_tokens=BT)


@pytest.fixture
def kvpool_() -> Iterator[Pool]:
    with Pool.embedded(dram_bytes=32 << 20) as p:
        yield p


@pytest.fixture
def prefill(model: Transformer, kvpool_: Pool) -> Iterator[PrefillWorker]:
    with PrefillWorker(model, kvpool_, chunk_tokens=24, native_layerwise=False) as w:
        yield w


def prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), generator=g).tolist()


_REFERENCE: dict[tuple[tuple[int, ...], int], list[int]] = {}


def reference(model: Transformer, tokens: list[int], n: int) -> list[int]:
    key = (tuple(tokens), n)
    if key not in _REFERENCE:
        _REFERENCE[key] = generate(model, tokens, n)
    return _REFERENCE[key]


def serve_one(
    prefill: PrefillWorker, model: Transformer, pool: Any, tokens: list[int], n: int
) -> tuple[list[int], Any]:
    result = prefill.prefill(tokens)
    engine = DecodeEngine(model, pool, num_pages=64, page_tokens=8, native_layerwise=False)
    req = engine.submit(result, n)
    engine.run()
    return req.output, result


# -- exactness ----------------------------------------------------------------


@pytest.mark.parametrize("length", [5, 48, 53])
def test_prefill_pool_decode_equals_reference(
    model: Transformer, prefill: PrefillWorker, kvpool_: Pool, length: int
) -> None:
    tokens = prompt(length, seed=length)
    out, result = serve_one(prefill, model, kvpool_, tokens, 10)
    assert out == reference(model, tokens, 10)
    assert result.computed_tokens == length and result.cached_tokens == 0
    assert result.stored_blocks == length // BT
    assert kvpool_.prefix_match(result.block_keys) == length // BT
    if length % BT:  # the tail went through the pool and decode removed it after loading
        assert result.tail_key is not None and not kvpool_.exists([result.tail_key])[0]


def test_pool_bytes_follow_kv_layout(
    model: Transformer, prefill: PrefillWorker, kvpool_: Pool
) -> None:
    tokens = prompt(40, seed=1)
    result = prefill.prefill(tokens)
    _, kv = model(tokens)
    cfg = model.cfg
    for i, key in enumerate(result.block_keys):
        raw = kvpool_.get(key)
        assert raw is not None and len(raw) == cfg.kv_layout().block_bytes
        block = np.frombuffer(raw, dtype=np.float32).reshape(
            cfg.num_layers, 2, BT, cfg.num_kv_heads, cfg.head_dim
        )
        for layer, (k, v) in enumerate(kv):
            rows = slice(i * BT, (i + 1) * BT)
            np.testing.assert_allclose(block[layer, 0], k[rows].numpy(), atol=1e-5)
            np.testing.assert_allclose(block[layer, 1], v[rows].numpy(), atol=1e-5)


def test_chunk_size_does_not_change_the_result(model: Transformer, kvpool_: Pool) -> None:
    tokens = prompt(70, seed=2)
    results = []
    for chunk in (7, 16, 1000):
        with (
            Pool.embedded(dram_bytes=8 << 20) as pool,
            PrefillWorker(model, pool, chunk_tokens=chunk, native_layerwise=False) as w,
        ):
            r = w.prefill(tokens)
            results.append((r, [pool.get(k) for k in r.block_keys]))
    (base, base_blocks), others = results[0], results[1:]
    for r, blocks in others:
        assert r.first_token == base.first_token and r.computed_tokens == 70
        torch.testing.assert_close(r.last_logits, base.last_logits, atol=1e-4, rtol=1e-4)
        for a, b in zip(blocks, base_blocks, strict=True):
            assert a is not None and b is not None
            np.testing.assert_allclose(
                np.frombuffer(a, np.float32), np.frombuffer(b, np.float32), atol=1e-5
            )


# -- prefix reuse -------------------------------------------------------------


def test_shared_prefix_prefills_only_the_suffix(
    model: Transformer, prefill: PrefillWorker, kvpool_: Pool
) -> None:
    first = prompt(56, seed=3)  # 3 full blocks + 8
    second = first[:48] + prompt(21, seed=4)  # shares 3 blocks, 21 new tokens
    out1, r1 = serve_one(prefill, model, kvpool_, first, 6)
    assert r1.computed_tokens == 56
    out2, r2 = serve_one(prefill, model, kvpool_, second, 8)
    assert (r2.cached_blocks, r2.cached_tokens, r2.computed_tokens) == (3, 48, 21)
    assert r2.stored_blocks == 1  # block 3 (tokens 48-63) is new; 64-68 is the tail
    assert out2 == reference(model, second, 8)
    # The same request run cold (fresh pool) gives the same tokens.
    with (
        Pool.embedded(dram_bytes=8 << 20) as cold_pool,
        PrefillWorker(model, cold_pool, chunk_tokens=24, native_layerwise=False) as cold,
    ):
        cold_out, cold_r = serve_one(cold, model, cold_pool, second, 8)
    assert cold_r.computed_tokens == 69 and cold_out == out2
    assert out1 == reference(model, first, 6)


def test_fully_cached_prompt_recomputes_one_token(
    model: Transformer, prefill: PrefillWorker, kvpool_: Pool
) -> None:
    tokens = prompt(32, seed=5)
    out1, r1 = serve_one(prefill, model, kvpool_, tokens, 5)
    out2, r2 = serve_one(prefill, model, kvpool_, tokens, 5)
    assert (r2.cached_blocks, r2.cached_tokens, r2.computed_tokens) == (2, 31, 1)
    assert r2.stored_blocks == 0 and r2.first_token == r1.first_token
    assert out1 == out2 == reference(model, tokens, 5)


def test_decode_recomputes_kv_missing_from_the_pool(
    model: Transformer, prefill: PrefillWorker, kvpool_: Pool
) -> None:
    tokens = prompt(50, seed=6)
    result = prefill.prefill(tokens)
    assert kvpool_.remove(result.block_keys[1])  # evicted between prefill and decode
    engine = DecodeEngine(model, kvpool_, num_pages=32, page_tokens=8, native_layerwise=False)
    req = engine.submit(result, 6)
    engine.run()
    assert req.recomputed_tokens == 50 - BT  # everything after the first block
    assert req.output == reference(model, tokens, 6)


# -- continuous batching and paged memory ---------------------------------------


def test_continuous_batching_matches_each_request_alone(
    model: Transformer, prefill: PrefillWorker, kvpool_: Pool
) -> None:
    specs = [(7, 9), (40, 4), (33, 12), (64, 6), (19, 1)]  # (prompt length, max_new_tokens)
    prompts = [prompt(n, seed=100 + i) for i, (n, _) in enumerate(specs)]
    engine = DecodeEngine(model, kvpool_, num_pages=128, page_tokens=8, native_layerwise=False)
    reqs = []
    batch_sizes = []
    for i, (tokens, (_, n)) in enumerate(zip(prompts, specs, strict=True)):
        reqs.append(engine.submit(prefill.prefill(tokens), n))
        if i % 2:  # requests join while others are mid-generation
            engine.step()
            batch_sizes.append(len(engine.running))
    while not engine.idle:
        engine.step()
        batch_sizes.append(len(engine.running))
    assert max(batch_sizes) >= 3
    for req, tokens, (_, n) in zip(reqs, prompts, specs, strict=True):
        assert req.finished and len(req.output) == n
        assert req.output == reference(model, tokens, n), req.request_id
    assert engine.cache.free_pages == engine.cache.num_pages


def test_request_waits_when_kv_memory_is_full(
    model: Transformer, prefill: PrefillWorker, kvpool_: Pool
) -> None:
    # 40-token prompts + 8 new tokens need 47 positions = 6 pages of 8; 10 pages hold one.
    engine = DecodeEngine(model, kvpool_, num_pages=10, page_tokens=8, native_layerwise=False)
    a, b = prompt(40, seed=7), prompt(40, seed=8)
    ra = engine.submit(prefill.prefill(a), 8)
    rb = engine.submit(prefill.prefill(b), 8)
    peak = 0
    b_admitted_at_step = None
    while not engine.idle:
        events = engine.step()
        peak = max(peak, engine.cache.used_pages)
        if b_admitted_at_step is None and any(e.request_id == rb.request_id for e in events):
            b_admitted_at_step = engine.steps
            assert ra.finished  # b got memory only after a released it
        if not ra.finished:
            assert list(engine.waiting) == [rb]
    assert peak <= 6 < engine.cache.num_pages
    assert ra.output == reference(model, a, 8) and rb.output == reference(model, b, 8)
    assert b_admitted_at_step is not None and b_admitted_at_step > 1
    with pytest.raises(ValueError, match="cache holds fewer"):
        engine.submit(prefill.prefill(prompt(80, seed=9)), 8)


def test_eos_finishes_early(model: Transformer, prefill: PrefillWorker, kvpool_: Pool) -> None:
    tokens = prompt(20, seed=10)
    full = reference(model, tokens, 6)
    engine = DecodeEngine(model, kvpool_, num_pages=16, page_tokens=8, native_layerwise=False)
    req = engine.submit(prefill.prefill(tokens), 6, eos_id=full[2])
    engine.run()
    assert req.output == full[: full.index(full[2]) + 1]
    assert engine.cache.free_pages == 16


# -- layer-wise store/load ------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("native", [False, None])
def test_layer_writer_commits_only_after_every_layer(
    kvpool_: Pool, dtype: str, native: bool | None
) -> None:
    model = build_model("tiny", block_tokens=BT, dtype=dtype, layers=[])
    cfg = model.cfg
    layout = cfg.kv_layout()
    assert layout.dtype == dtype
    keys = [bytes([i]) * 16 for i in range(1, 4)]
    kv = model.kv_buffers(3 * BT)
    for k, v in kv:
        k.normal_()
        v.normal_()
    writer = BlockLayerWriter(kvpool_, keys, layout, native=native)
    for layer, (k, v) in enumerate(kv):
        assert kvpool_.prefix_match(keys) == 0
        writer.write_layer(layer, k, v)
    assert kvpool_.prefix_match(keys) == 0
    writer.wait()
    assert kvpool_.prefix_match(keys) == 3
    dest = model.kv_buffers(3 * BT)
    with BlockLayerLoader(kvpool_, keys, layout, dest, native=native) as loader:
        for layer in range(cfg.num_layers):
            k, v = loader.wait_layer(layer)
            assert torch.equal(k, kv[layer][0]) and torch.equal(v, kv[layer][1])
    raw = kvpool_.get(keys[1])  # block 1, layer 2's V: bytes follow KVLayout exactly
    assert raw is not None
    at = 2 * layout.layer_bytes + layout.half_layer_bytes
    v_bytes = kv[2][1][BT : 2 * BT].contiguous().view(torch.uint8).numpy().tobytes()
    assert raw[at : at + layout.half_layer_bytes] == v_bytes
    aborted = BlockLayerWriter(kvpool_, [b"\x09" * 16], layout, native=native)
    aborted.write_layer(0, kv[0][0][:BT], kv[0][1][:BT])
    aborted.abort()
    assert not kvpool_.exists([b"\x09" * 16])[0]


def test_layerwise_store_path_matches_builtin_path(model: Transformer) -> None:
    """The runtime on ``kvpool.layerwise`` (the default where it exists) stores the same
    bytes, reuses the same prefix and decodes the same tokens as its built-in path."""
    pytest.importorskip("kvpool.layerwise")
    tokens = prompt(45, seed=11)
    blocks = {}
    for native in (True, False):
        with (
            Pool.embedded(dram_bytes=8 << 20) as pool,
            PrefillWorker(model, pool, chunk_tokens=20, native_layerwise=native) as w,
        ):
            r1 = w.prefill(tokens)
            assert r1.stored_blocks == 2
            blocks[native] = [pool.get(k) for k in r1.block_keys]
            engine = DecodeEngine(model, pool, num_pages=16, page_tokens=8, native_layerwise=native)
            req = engine.submit(r1, 5)
            engine.run()
            assert req.output == reference(model, tokens, 5) and req.recomputed_tokens == 0
            r2 = w.prefill([*tokens[:40], 1, 2, 3])
            assert (r2.cached_blocks, r2.computed_tokens, r2.stored_blocks) == (2, 11, 0)
    assert blocks[True] == blocks[False]


def test_bfloat16_model_through_pool_and_decode(kvpool_: Pool) -> None:
    """The LLaMA-2 presets run in bf16: the whole path must carry 2-byte KV."""
    model = build_model("tiny", block_tokens=BT, dtype="bfloat16")
    assert model.cfg.kv_layout().dtype == "bfloat16" and model.cfg.kv_bytes_per_token == 1024
    tokens = prompt(37, seed=12)
    with PrefillWorker(model, kvpool_, chunk_tokens=16) as w:
        r1 = w.prefill(tokens)
        r2 = w.prefill(tokens)
    assert (r1.stored_blocks, r2.cached_tokens, r2.computed_tokens) == (2, 32, 5)
    raw = kvpool_.get(r1.block_keys[0])
    assert raw is not None and len(raw) == model.cfg.kv_layout().block_bytes
    engine = DecodeEngine(model, kvpool_, num_pages=16, page_tokens=8)
    reqs = [engine.submit(r1, 4), engine.submit(r2, 4)]
    engine.run()
    assert all(len(r.output) == 4 and r.recomputed_tokens == 0 for r in reqs)
    # r2's only chunk is r1's last one over the same KV bytes: bit-identical results.
    assert r1.first_token == r2.first_token and reqs[0].output == reqs[1].output


class _FailingReads:
    """A pool whose reads of ``bad`` keys fail (a node died mid-transfer)."""

    def __init__(self, pool: Pool, bad: set[bytes]) -> None:
        self._pool, self._bad = pool, bad

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pool, name)

    def get_into(self, key: bytes, out: Any, **kw: Any) -> int | None:
        if key in self._bad:
            raise OSError("connection reset by peer")
        return self._pool.get_into(key, out, **kw)

    def get_into_batch(self, keys: Any, outs: Any, **kw: Any) -> list[int | None]:
        if self._bad.intersection(keys):  # a layer's batch of ranges names a bad block
            raise OSError("connection reset by peer")
        return self._pool.get_into_batch(keys, outs, **kw)


@pytest.mark.parametrize("overlap", [True, False])
def test_failed_kv_load_fails_only_its_request(
    model: Transformer, prefill: PrefillWorker, kvpool_: Pool, overlap: bool
) -> None:
    good, bad = prompt(30, seed=13), prompt(30, seed=14)
    r_good, r_bad = prefill.prefill(good), prefill.prefill(bad)
    pool = _FailingReads(kvpool_, {r_bad.block_keys[0]})
    with DecodeEngine(
        model, pool, num_pages=16, page_tokens=8, native_layerwise=False, overlap_loads=overlap
    ) as engine:
        failed = engine.submit(r_bad, 5)
        ok = engine.submit(r_good, 5)
        events = []
        while not engine.idle:
            events.extend(engine.step())
    assert failed.finished and failed.error is not None and "connection reset" in failed.error
    assert [e.error is not None for e in events if e.request_id == failed.request_id] == [True]
    assert ok.error is None and ok.output == reference(model, good, 5)
    assert engine.cache.free_pages == 16

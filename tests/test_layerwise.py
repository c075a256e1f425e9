"""Layer-wise store (LayerWriter) and load (LayerReader) on the embedded pool."""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import pytest
from poolhelpers import BLOCK, make_keys, payload

from kvpool import BufferSpecError, KVLayout, KVPoolError, Pool
from kvpool.embedded.handles import EmbeddedBlockWriter
from kvpool.layerwise import LayerReader, LayerTransferError, LayerWriter

# 4 layers x 2 heads x 32 dims x 64 tokens, float16: 16 KiB per layer, one BLOCK per block
LAYOUT = KVLayout(num_layers=4, num_kv_heads=2, head_dim=32, dtype="float16", block_tokens=64)
assert LAYOUT.block_bytes == BLOCK


def layers(n_blocks: int, seed: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per-layer (k, v) for n_blocks blocks, as an engine would hold them."""
    rng = np.random.default_rng(seed)
    shape = (n_blocks * LAYOUT.block_tokens, LAYOUT.num_kv_heads, LAYOUT.head_dim)
    return [
        (
            rng.standard_normal(shape).astype(np.float16),
            rng.standard_normal(shape).astype(np.float16),
        )
        for _ in range(LAYOUT.num_layers)
    ]


def block_bytes(kv: list[tuple[np.ndarray, np.ndarray]], i: int) -> bytes:
    """The stored form of block i: layer-major, K then V within a layer."""
    t = LAYOUT.block_tokens
    return b"".join(
        k[i * t : (i + 1) * t].tobytes() + v[i * t : (i + 1) * t].tobytes() for k, v in kv
    )


def store(pool: Pool, keys: list[bytes], kv: list[tuple[Any, Any]], order: Any = None) -> int:
    with pool.layer_writer(keys, LAYOUT) as writer:
        for layer in order if order is not None else range(LAYOUT.num_layers):
            writer.write_layer(layer, *kv[layer])
    return len(keys) - len(writer.skipped)


def used(pool: Pool) -> int:
    return int(pool.stats()["tiers"]["dram"]["used_bytes"])


def pins(pool: Pool, keys: list[bytes]) -> list[int]:
    return [pool._blocks.entries[k].pins for k in keys]


@pytest.mark.parametrize("order", [[0, 1, 2, 3], [3, 1, 0, 2]])
def test_round_trip_exact_bytes(pool: Pool, order: list[int]) -> None:
    keys, kv = make_keys(3), layers(3)
    assert store(pool, keys, kv, order) == 3
    for i, key in enumerate(keys):
        assert pool.get(key) == block_bytes(kv, i)
    with pool.layer_reader(keys, LAYOUT) as reader:
        assert reader.num_blocks == 3 and reader.num_tokens == 3 * LAYOUT.block_tokens
        for layer in [0, 2, 1, 3, 3]:  # any order, twice is fine
            k, v = reader.wait_layer(layer)
            assert k.dtype == np.float16 and k.shape == kv[layer][0].shape
            np.testing.assert_array_equal(k, kv[layer][0])
            np.testing.assert_array_equal(v, kv[layer][1])
    assert pins(pool, keys) == [0, 0, 0]
    assert pool._blocks.entries[keys[1]].parent == keys[0]  # default parents chain the keys


def test_blocks_invisible_until_wait_commits(pool: Pool) -> None:
    keys, kv = make_keys(2), layers(2)
    writer = pool.layer_writer(keys, LAYOUT)
    for layer in range(LAYOUT.num_layers):
        writer.write_layer(layer, *kv[layer])
    deadline = time.monotonic() + 10
    while not all(writer.layer_done(layer) for layer in range(LAYOUT.num_layers)):
        assert time.monotonic() < deadline
        time.sleep(0.001)
    assert pool.prefix_match(keys) == 0 and pool.exists(keys) == [False, False]
    assert pool.get(keys[0]) is None
    assert writer.wait() == 2
    assert pool.prefix_match(keys) == 2


def test_failed_copy_mid_stream_aborts_everything(
    pool: Pool, monkeypatch: pytest.MonkeyPatch
) -> None:
    keys, kv = make_keys(3), layers(3)
    real_write = EmbeddedBlockWriter._write  # what moves the bytes, after the checks

    def failing(self: EmbeddedBlockWriter, offset: int, data: Any) -> None:
        if offset >= 2 * LAYOUT.layer_bytes:
            raise OSError("injected copy failure in layer 2")
        real_write(self, offset, data)

    monkeypatch.setattr(EmbeddedBlockWriter, "_write", failing)
    writer = pool.layer_writer(keys, LAYOUT)
    for layer in range(LAYOUT.num_layers):
        writer.write_layer(layer, *kv[layer])  # failures never raise here
    with pytest.raises(LayerTransferError, match="injected") as info:
        writer.wait()
    assert isinstance(info.value.__cause__, OSError)
    assert pool.prefix_match(keys) == 0 and used(pool) == 0
    monkeypatch.setattr(EmbeddedBlockWriter, "_write", real_write)
    assert store(pool, keys, kv) == 3  # the keys are free again
    assert pool.get(keys[2]) == block_bytes(kv, 2)


def test_pool_closed_mid_stream() -> None:
    keys, kv = make_keys(2), layers(2)
    pool = Pool.embedded(dram_bytes=8 * BLOCK)
    writer = pool.layer_writer(keys, LAYOUT)
    writer.write_layer(0, *kv[0])
    deadline = time.monotonic() + 10
    while not writer.layer_done(0):
        assert time.monotonic() < deadline
        time.sleep(0.001)
    pool.close()
    writer.write_layer(1, *kv[1])
    with pytest.raises(LayerTransferError, match="closed"):
        writer.wait()
    with pytest.raises(KVPoolError):
        pool.layer_writer(keys, LAYOUT)


def test_exception_in_context_aborts(pool: Pool) -> None:
    keys, kv = make_keys(2), layers(2)
    with pytest.raises(RuntimeError, match="model crashed"), pool.layer_writer(keys, LAYOUT) as w:
        w.write_layer(0, *kv[0])
        raise RuntimeError("model crashed")
    assert pool.prefix_match(keys) == 0 and used(pool) == 0
    w.abort()  # idempotent


def test_already_stored_blocks_are_skipped(pool: Pool) -> None:
    keys, kv = make_keys(3), layers(3)
    pool.put(keys[1], payload(9))
    writer = LayerWriter(pool, keys, LAYOUT)
    assert writer.skipped == [keys[1]] and writer.num_blocks == 3
    for layer in range(LAYOUT.num_layers):
        writer.write_layer(layer, *kv[layer])
    assert writer.wait() == 2
    assert pool.get(keys[1]) == payload(9).tobytes()  # untouched
    assert pool.get(keys[0]) == block_bytes(kv, 0) and pool.get(keys[2]) == block_bytes(kv, 2)


def test_bad_inputs_raise_and_leave_the_pool_consistent(pool: Pool) -> None:
    keys, kv = make_keys(2), layers(2)
    writer = pool.layer_writer(keys, LAYOUT)
    with pytest.raises(IndexError, match="out of range"):
        writer.write_layer(LAYOUT.num_layers, *kv[0])
    with pytest.raises(IndexError):
        writer.write_layer(-1, *kv[0])
    with pytest.raises(TypeError):
        writer.write_layer(1.0, *kv[0])  # type: ignore[arg-type]
    with pytest.raises(BufferSpecError, match="bytes"):
        writer.write_layer(0, kv[0][0][:-1], kv[0][1])
    with pytest.raises(BufferSpecError, match="contiguous"):
        writer.write_layer(0, kv[0][0][::2], kv[0][1])
    writer.write_layer(0, *kv[0])
    with pytest.raises(KVPoolError, match="already written"):
        writer.write_layer(0, *kv[0])
    with pytest.raises(KVPoolError, match="never written"):
        writer.wait()  # layers 1..3 missing
    assert pool.prefix_match(keys) == 0 and used(pool) == 0
    with pytest.raises(KVPoolError, match="finished"):
        writer.write_layer(1, *kv[1])
    with pytest.raises(KVPoolError, match="already called"):
        writer.wait()
    with pytest.raises(ValueError, match="parents"):
        pool.layer_writer(keys, LAYOUT, parents=[None])
    with pytest.raises(TypeError):
        pool.layer_writer(keys, "not a layout")
    assert used(pool) == 0
    assert store(pool, keys, kv) == 2


def test_copy_option_lets_the_caller_reuse_buffers(pool: Pool) -> None:
    keys, kv = make_keys(2), layers(2)
    scratch_k, scratch_v = np.empty_like(kv[0][0]), np.empty_like(kv[0][1])
    with pool.layer_writer(keys, LAYOUT, copy=True) as writer:
        for layer in range(LAYOUT.num_layers):
            scratch_k[:], scratch_v[:] = kv[layer]
            writer.write_layer(layer, scratch_k, scratch_v)
            scratch_k.fill(0)
            scratch_v.fill(0)
    assert pool.get(keys[1]) == block_bytes(kv, 1)


def test_reader_loads_ahead_unless_throttled(pool: Pool) -> None:
    keys, kv = make_keys(2), layers(2)
    store(pool, keys, kv)
    with pool.layer_reader(keys, LAYOUT, depth=1) as reader:
        reader.wait_layer(0)
        deadline = time.monotonic() + 10
        while not reader.layer_ready(1):  # loaded while the caller "computes" on layer 0
            assert time.monotonic() < deadline
            time.sleep(0.001)
        time.sleep(0.05)
        assert not reader.layer_ready(2)  # depth 1: no further than one ahead
    with pool.layer_reader(keys, LAYOUT, depth=0) as reader:
        reader.wait_layer(0)
        time.sleep(0.05)
        assert not reader.layer_ready(1)  # depth 0: only what was asked for
    with pool.layer_reader(keys, LAYOUT) as reader:  # default: every layer, nobody asking
        deadline = time.monotonic() + 10
        while not reader.layer_ready(LAYOUT.num_layers - 1):
            assert time.monotonic() < deadline
            time.sleep(0.001)
        for layer in range(LAYOUT.num_layers):
            k, v = reader.wait_layer(layer)
            np.testing.assert_array_equal(k, kv[layer][0])
            np.testing.assert_array_equal(v, kv[layer][1])


def test_reader_overlaps_a_slow_consumer(pool: Pool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Loading a layer takes 40 ms (sleeps, so no CPU is needed) and using it 40 ms:
    4 layers take ~200 ms with prefetch against 320 ms one after the other."""
    keys, kv = make_keys(1), layers(1)
    store(pool, keys, kv)
    real = pool.get_into_batch

    def slow_batch(*args: Any, **kw: Any) -> Any:
        time.sleep(0.04)  # one call (every block's K and V) per layer
        return real(*args, **kw)

    monkeypatch.setattr(pool, "get_into_batch", slow_batch)
    start = time.perf_counter()
    with pool.layer_reader(keys, LAYOUT) as reader:
        for layer in range(LAYOUT.num_layers):
            reader.wait_layer(layer)
            time.sleep(0.04)
    elapsed = time.perf_counter() - start
    assert elapsed < 0.28, f"{elapsed:.3f} s: no overlap (serial would be 0.32 s)"


def test_reader_reads_blocks_from_ssd(ssd_pool: Pool) -> None:
    keys, kv = make_keys(3), layers(3)
    store(ssd_pool, keys, kv)
    for i, key in enumerate(make_keys(8, seed=1)):  # push the 3 blocks down to SSD
        ssd_pool.put(key, payload(i))
    assert ssd_pool.stats()["tiers"]["ssd"]["blocks"] >= 3
    with ssd_pool.layer_reader(keys, LAYOUT) as reader:
        assert reader.num_blocks == 3
        for layer in range(LAYOUT.num_layers):
            k, v = reader.wait_layer(layer)
            np.testing.assert_array_equal(k, kv[layer][0])
            np.testing.assert_array_equal(v, kv[layer][1])


def test_torch_in_and_out(pool: Pool) -> None:
    torch = pytest.importorskip("torch")
    keys = make_keys(2)
    shape = (2 * LAYOUT.block_tokens, LAYOUT.num_kv_heads, LAYOUT.head_dim)
    gen = torch.Generator().manual_seed(0)
    kv = [
        (torch.randn(shape, generator=gen).half(), torch.randn(shape, generator=gen).half())
        for _ in range(LAYOUT.num_layers)
    ]
    store(pool, keys, kv)
    with pool.layer_reader(keys, LAYOUT, torch=True) as reader:
        for layer in range(LAYOUT.num_layers):
            k, v = reader.wait_layer(layer)
            assert k.dtype == torch.float16
            assert torch.equal(k, kv[layer][0]) and torch.equal(v, kv[layer][1])
    # caller buffers sized for 4 blocks; only the 2 stored are read and returned
    big = (4 * LAYOUT.block_tokens, LAYOUT.num_kv_heads, LAYOUT.head_dim)
    out = [(torch.zeros(big).half(), torch.zeros(big).half()) for _ in range(LAYOUT.num_layers)]
    with pool.layer_reader([*keys, *make_keys(4, seed=3)[2:]], LAYOUT, out=out) as reader:
        assert reader.num_blocks == 2
        for layer in range(LAYOUT.num_layers):
            k, v = reader.wait_layer(layer)
            assert k.shape == shape and k.data_ptr() == out[layer][0].data_ptr()
            assert torch.equal(k, kv[layer][0]) and torch.equal(v, kv[layer][1])


def test_reader_bad_inputs_release_the_lease(pool: Pool) -> None:
    keys, kv = make_keys(2), layers(2)
    store(pool, keys, kv)
    small = [(np.zeros(10, np.uint8), np.zeros(10, np.uint8))] * LAYOUT.num_layers
    with pytest.raises(BufferSpecError, match="at least"):
        pool.layer_reader(keys, LAYOUT, out=small)
    with pytest.raises(ValueError, match="one"):
        pool.layer_reader(keys, LAYOUT, out=small[:1])
    for depth in (-1, 1.5, True):
        with pytest.raises(ValueError, match="depth"):
            pool.layer_reader(keys, LAYOUT, depth=depth)
    assert pins(pool, keys) == [0, 0]
    reader = LayerReader(pool, keys, LAYOUT)
    with pytest.raises(IndexError):
        reader.wait_layer(LAYOUT.num_layers)
    reader.close()
    reader.close()
    assert pins(pool, keys) == [0, 0]
    with pytest.raises(KVPoolError, match="closed"):
        reader.wait_layer(3)


def test_reader_failure_surfaces_and_releases(pool: Pool, monkeypatch: pytest.MonkeyPatch) -> None:
    keys, kv = make_keys(2), layers(2)
    store(pool, keys, kv)
    real = pool.get_into_batch

    def failing(keys: Any, outs: Any, *, offsets: Any = None, lengths: Any = None) -> Any:
        if min(offsets) >= 2 * LAYOUT.layer_bytes:  # a layer is one batch of ranges
            raise ConnectionError("node lost")
        return real(keys, outs, offsets=offsets, lengths=lengths)

    monkeypatch.setattr(pool, "get_into_batch", failing)
    reader = pool.layer_reader(keys, LAYOUT, depth=4)
    k, _ = reader.wait_layer(1)
    np.testing.assert_array_equal(k, kv[1][0])
    with pytest.raises(LayerTransferError, match="node lost"):
        reader.wait_layer(2)
    assert pins(pool, keys) == [0, 0]
    reader.close()


def test_empty_prefix_reader(pool: Pool) -> None:
    with pool.layer_reader(make_keys(2), LAYOUT) as reader:
        assert reader.num_blocks == 0
        k, v = reader.wait_layer(3)
        assert k.shape == v.shape == (0, LAYOUT.num_kv_heads, LAYOUT.head_dim)


def test_concurrent_writers_of_the_same_keys(pool: Pool) -> None:
    """A second writer of keys being written skips them; exactly one stores each block."""
    keys, kv = make_keys(2), layers(2)
    first = pool.layer_writer(keys, LAYOUT)
    second = pool.layer_writer(keys, LAYOUT)
    assert second.skipped == keys
    threads = [threading.Thread(target=lambda w=w: store_all(w, kv)) for w in (first, second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert pool.get(keys[0]) == block_bytes(kv, 0)


def store_all(writer: LayerWriter, kv: list[tuple[np.ndarray, np.ndarray]]) -> None:
    for layer in range(LAYOUT.num_layers):
        writer.write_layer(layer, *kv[layer])
    writer.wait()


def test_layer_reads_name_each_blocks_k_then_v() -> None:
    a, b = make_keys(2)
    keys, offsets, lengths = LAYOUT.layer_reads(3, [a, b])
    base, half = 3 * LAYOUT.layer_bytes, LAYOUT.half_layer_bytes
    assert keys == [a, a, b, b]
    assert offsets == [base, base + half, base, base + half]
    assert lengths == [half] * 4
    assert LAYOUT.layer_reads(0, []) == ([], [], [])


def test_bench_layerwise_smoke(tmp_path: Any) -> None:
    pytest.importorskip("torch")
    import argparse
    import json

    from kvpool.bench.layerwise import register_layerwise

    parser = argparse.ArgumentParser()
    register_layerwise(parser.add_subparsers(dest="suite"))
    out = tmp_path / "lw.json"
    argv = "layerwise --layers 4 --tokens 128 --kv-heads 2 --head-dim 64 --block-tokens 64"
    args = parser.parse_args([*argv.split(), "--rounds", "1", "--json", str(out)])
    assert args.func(args) == 0
    result = json.loads(out.read_text())
    for key in ("compute_s", "store_s", "serial_s", "overlapped_s", "overlap_ratio"):
        assert result[key] > 0
    for key in ("compute_s", "s", "serial_s", "overlapped_s", "overlap_ratio"):
        assert result["load_" + key] > 0
    assert result["blocks"] == 2

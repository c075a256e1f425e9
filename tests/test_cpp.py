"""Chunked pipeline prefill (issue 8) across real processes: exact against one worker."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from clusterhelpers import Cluster, start_cluster, wait_until

import kvpool
from kvpool.serve.runtime.decode import DecodeEngine
from kvpool.serve.runtime.model import build_model
from kvpool.serve.runtime.pipeline import CppGroup, split_layers
from kvpool.serve.runtime.prefill import PrefillWorker

BT = 16  # small blocks: the prompt spans many blocks and a partial tail
CHUNK = 24  # not a multiple of the block size: blocks complete mid-chunk


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    c = start_cluster(["16MiB"])
    yield c
    c.stop()


def decode(model: Any, pool: Any, result: Any, n: int = 8) -> list[int]:
    engine = DecodeEngine(model, pool, num_pages=128, page_tokens=8, native_layerwise=False)
    req = engine.submit(result, n)
    engine.run()
    engine.close()
    assert req.recomputed_tokens == 0  # everything came from the pool
    return list(req.output)


def test_split_layers() -> None:
    assert split_layers(4, 2) == [(0, 2), (2, 4)]
    assert split_layers(5, 3) == [(0, 2), (2, 4), (4, 5)]
    assert split_layers(80, 4)[-1] == (60, 80)
    with pytest.raises(ValueError):
        split_layers(4, 5)


def test_two_stage_pipeline_is_exact(cluster: Cluster) -> None:
    torch.set_num_threads(1)
    rng = np.random.default_rng(8)
    prompt = rng.integers(0, 256, 16 * BT + 5).tolist()
    model = build_model("tiny", 0, block_tokens=BT)
    with kvpool.connect(cluster.url, timeout=10) as pool:
        assert wait_until(lambda: len(pool.stats()["nodes"]) == 1, timeout=15)
        # the reference: one worker, whole model, same chunking; another tenant's
        # namespace so its blocks do not turn into the pipeline's cache hits
        ref_ns = model.cfg.namespace(0, tenant="reference")
        with PrefillWorker(model, pool, chunk_tokens=CHUNK, namespace=ref_ns) as worker:
            ref = worker.prefill(prompt)
        with CppGroup(cluster.url, stages=2, block_tokens=BT, chunk_tokens=CHUNK) as group:
            got = group.prefill(prompt)
            assert got.first_token == ref.first_token
            assert got.stored_blocks == len(got.block_keys) == 16
            assert got.timings["chunks"] == -(-len(prompt) // CHUNK)
            assert 0.0 <= got.timings["bubble"] < 1.0
            for mine, theirs in zip(got.block_keys, ref.block_keys, strict=True):
                assert mine != theirs
                assert pool.get(mine) == pool.get(theirs)  # byte-identical KV, every layer
            assert got.tail_key is not None and ref.tail_key is not None
            assert pool.get(got.tail_key) == pool.get(ref.tail_key)
            # decode loads the pipeline's blocks from the pool: same greedy tokens
            assert decode(model, pool, got) == decode(model, pool, ref)

            # a longer prompt sharing the first 10 blocks: each stage loads its
            # own layers of the cached prefix, the rest is computed and stored
            longer = prompt[: 10 * BT] + rng.integers(0, 256, 9 * BT).tolist()
            again = group.prefill(longer)
            assert again.cached_blocks == 10
            with PrefillWorker(model, pool, chunk_tokens=CHUNK, namespace=ref_ns) as worker:
                ref2 = worker.prefill(longer)
            assert again.first_token == ref2.first_token
            for mine, theirs in zip(again.block_keys, ref2.block_keys, strict=True):
                assert pool.get(mine) == pool.get(theirs)

    # and the no-cache reference agrees on the first token
    assert got.first_token == int(torch.argmax(model(prompt)[0][-1]))


def test_a_dead_stage_fails_the_prefill_and_frees_every_reservation(cluster: Cluster) -> None:
    prompt = np.random.default_rng(9).integers(0, 256, 6 * BT + 3).tolist()
    with kvpool.connect(cluster.url, timeout=10) as pool:
        with CppGroup(cluster.url, stages=2, block_tokens=BT, chunk_tokens=CHUNK) as group:
            group.stages[1].child.kill()
            with pytest.raises(Exception):  # noqa: B017 - connection loss or remote error
                group.prefill(prompt)
            keys = kvpool.block_keys(prompt, group.namespace, BT)
        assert pool.prefix_match(keys) == 0  # nothing half-written became visible
        layout = group.layout

        def free() -> bool:  # the aborted reservation is gone: the key can be reserved again
            writer = pool.reserve(keys[0], layout.block_bytes)
            if writer is None:
                return False
            writer.abort()
            return True

        assert wait_until(free, timeout=10)

"""KVPoolConnector inside real vLLM (CPU build) processes sharing a real kvpool cluster.

Every vLLM instance is its own process with an empty local cache; the
cluster (master + node processes) is started by the test. Reference tokens
come from vLLM without any connector. Prompts are 1,100 tokens: two whole
512-token kvpool blocks (1,024 tokens) plus a tail that is always computed.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from clusterhelpers import Cluster, start_cluster
from vllmhelpers import kv_config, make_checkpoint, require_engine_venv, run_vllm, tokens

import kvpool
from kvpool.bindings.vllm.geometry import Geometry

pytestmark = pytest.mark.timeout(900)

PROMPT_LEN = 1100
A, B, C = tokens(1, PROMPT_LEN), tokens(2, PROMPT_LEN), tokens(3, PROMPT_LEN)
HIT = 1024  # two whole kvpool blocks


@dataclass
class Engine:
    python: Path
    workdir: Path
    model: Path
    reference: dict[str, list[int]]  # prompt name -> greedy tokens without a connector

    def run(self, name: str, rounds: list[list[list[int]]], **kw: Any) -> dict[str, Any]:
        return run_vllm(self.python, self.workdir, name, self.model, rounds, **kw)


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    python = require_engine_venv("vllm")
    workdir = tmp_path_factory.mktemp("vllm")
    model = make_checkpoint(python, workdir / "tiny-llama")
    out = run_vllm(python, workdir, "reference", model, [[A, B, C]])
    ref = dict(zip("ABC", out["rounds"][0]["tokens"], strict=True))
    return Engine(python, workdir, model, ref)


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    cluster = start_cluster(["256MiB"])
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module")
def stored(engine: Engine, cluster: Cluster) -> dict[str, Any]:
    """Process 1 (kv_both) prefills A and B into the cluster."""
    out = engine.run("store", [[A, B]], kv=kv_config("kv_both", url=cluster.url))
    assert out["rounds"][0]["tokens"] == [engine.reference["A"], engine.reference["B"]]
    assert out["connector"]["saved_blocks"] == 4
    assert out["connector"]["hit_tokens"] == 0
    assert out["stats_reduced"]["saved_blocks"] == 8  # two workers' worth, summed
    assert out["stats_reduced"]["saved_bytes"] == 2 * out["connector"]["saved_bytes"] > 0
    return out


def test_store_then_load_in_multiprocess_vllm(engine: Engine, cluster: Cluster, stored: dict):
    """Issue items 1 and 6: a fresh vLLM in its default multiprocess mode loads the prefix."""
    out = engine.run("load-mp", [[A]], kv=kv_config("kv_both", url=cluster.url), uni=False)
    assert out["rounds"][0]["cached"][0] >= HIT
    assert out["rounds"][0]["tokens"][0] == engine.reference["A"]


def test_loaded_bytes_are_the_pools(engine: Engine, cluster: Cluster, stored: dict):
    """Issue item 2: overwrite B's stored blocks with other bytes and the tokens change.

    The other bytes are A's KV for the same positions: valid values, and not a
    permutation of B's pages (attention is invariant under those).
    """
    geometry = Geometry(**stored["geometry"])
    keys_a, keys_b = geometry.keys(A, None)[0], geometry.keys(B, None)[0]
    assert len(keys_b) == 2
    with kvpool.connect(cluster.url) as pool:
        for key_a, key_b in zip(keys_a, keys_b, strict=True):
            data = pool.get(key_a)
            assert data is not None and len(data) == geometry.pool_block_bytes
            assert pool.remove(key_b)
            assert pool.put(key_b, data)
    out = engine.run("tampered", [[B], [A]], kv=kv_config("kv_consumer", url=cluster.url))
    tampered, untouched = out["rounds"]
    assert tampered["cached"][0] >= HIT
    assert tampered["tokens"][0] != engine.reference["B"]
    assert untouched["tokens"][0] == engine.reference["A"]


def test_prefill_decode_split(engine: Engine, cluster: Cluster):
    """Issue item 3: a kv_producer prefills, a kv_consumer decodes from the pool."""
    prefill = engine.run(
        "producer", [[C]], kv=kv_config("kv_producer", url=cluster.url), max_tokens=1
    )
    assert prefill["connector"]["saved_blocks"] == 2
    assert prefill["connector"]["loaded_bytes"] == 0
    decode = engine.run("consumer", [[C]], kv=kv_config("kv_consumer", url=cluster.url))
    assert decode["rounds"][0]["cached"][0] >= HIT
    assert decode["rounds"][0]["tokens"][0] == engine.reference["C"]
    assert decode["connector"]["saved_blocks"] == 0
    assert decode["connector"]["loaded_bytes"] == 2 * stored_bytes(decode)
    assert decode["stats_reduced"]["load_GBps"] > 0
    assert 0 <= decode["stats_reduced"]["load_overlap"] <= 1


def test_partial_local_hit_loads_only_the_rest(engine: Engine, cluster: Cluster, stored: dict):
    """Issue item 4: vLLM's prefix cache holds the first 544 tokens; only pages past them load."""
    warm = A[:545]  # 17 whole vLLM blocks (544 tokens) end up in vLLM's local cache
    out = engine.run(
        "partial",
        [[warm], [A]],
        kv=kv_config("kv_consumer", url=cluster.url),
        prefix_caching=True,
    )
    first, second = out["rounds"]
    g = out["geometry"]
    assert second["tokens"][0] == engine.reference["A"]
    assert second["cached"][0] >= HIT
    loaded = second["connector"]["loaded_bytes"] - first["connector"]["loaded_bytes"]
    # tokens 544..1023: 15 of the second kvpool block's 16 pages, every layer
    assert loaded == 15 * g["num_layers"] * g["page_bytes"]


def test_node_killed_between_store_and_load(engine: Engine):
    """Issue item 5: the master still lists the blocks, their node is gone: recompute."""
    cluster = start_cluster(["256MiB"], "--node-ttl", "600")
    try:
        url_kv = dict(url=cluster.url, transport="tcp", timeout=2.0, load_timeout_s=20.0)
        store = engine.run("kill-store", [[A]], kv=kv_config("kv_both", **url_kv))
        assert store["connector"]["saved_blocks"] == 2
        cluster.nodes[0].kill()
        out = engine.run("kill-load", [[A]], kv=kv_config("kv_consumer", **url_kv))
    finally:
        cluster.stop()
    assert out["rounds"][0]["tokens"][0] == engine.reference["A"]
    assert out["connector"]["hit_tokens"] >= HIT
    assert out["connector"]["load_failed_blocks"] > 0
    assert out["connector"]["loaded_bytes"] == 0


def stored_bytes(out: dict[str, Any]) -> int:
    g = out["geometry"]
    return g["num_layers"] * g["page_bytes"] * (g["block_tokens"] // g["block_size"])

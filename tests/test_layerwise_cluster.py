"""Layer-wise store and load against the distributed pool (real master and node processes)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from clusterhelpers import Cluster, start_cluster, wait_until
from poolhelpers import make_keys
from test_layerwise import LAYOUT, block_bytes, layers

import kvpool
from kvpool.cli import main as cli_main
from kvpool.layerwise import LayerReader, LayerTransferError, LayerWriter


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    c = start_cluster(["8MiB", "8MiB"])
    yield c
    c.stop()


def connect(cluster: Cluster, transport: str | None = None) -> kvpool.RemotePool:
    pool = kvpool.connect(cluster.url, timeout=3, transport=transport)
    assert wait_until(lambda: len(pool.stats()["nodes"]) == 2, timeout=15)
    return pool


@pytest.mark.parametrize("transport", [None, "tcp"], ids=["fastest", "tcp"])
def test_round_trip_through_the_cluster(cluster: Cluster, transport: str | None) -> None:
    """Stored layer by layer (in any order), loaded layer by layer, byte-exact: on the
    fastest data path (same host) and over TCP (each block's K and V of a layer go
    as one stamped write there, ``fenced.adjacent_runs``)."""
    keys, kv = make_keys(4), layers(3)
    with connect(cluster, transport) as pool:
        with LayerWriter(pool, keys[:3], LAYOUT) as writer:
            for layer in [1, 0, 3, 2]:
                writer.write_layer(layer, *kv[layer])
        assert pool.prefix_match(keys) == 3
        for i in range(3):
            assert pool.get(keys[i]) == block_bytes(kv, i)
        with LayerReader(pool, keys, LAYOUT) as reader:
            assert reader.num_blocks == 3
            for layer in range(LAYOUT.num_layers):
                k, v = reader.wait_layer(layer)
                np.testing.assert_array_equal(k, kv[layer][0])
                np.testing.assert_array_equal(v, kv[layer][1])


def test_nodes_lost_mid_stream_fail_writer_and_reader(cluster: Cluster) -> None:
    keys, kv = make_keys(4), layers(4)
    with connect(cluster, "tcp") as pool:
        stored = make_keys(4, seed=7)
        with LayerWriter(pool, stored, LAYOUT) as writer:
            for layer in range(LAYOUT.num_layers):
                writer.write_layer(layer, *kv[layer])
        reader = LayerReader(pool, stored, LAYOUT, depth=1)  # layers 2.. wait for the kill
        reader.wait_layer(0)
        writer = LayerWriter(pool, keys, LAYOUT)
        writer.write_layer(0, *kv[0])
        assert wait_until(lambda: writer.layer_done(0), timeout=10)
        for node in cluster.nodes:
            node.kill()
        for layer in range(1, LAYOUT.num_layers):
            writer.write_layer(layer, *kv[layer])
        with pytest.raises(LayerTransferError):
            writer.wait()
        assert pool.prefix_match(keys) == 0
        with pytest.raises(LayerTransferError):
            for layer in range(1, LAYOUT.num_layers):
                reader.wait_layer(layer)
        reader.close()


def test_bench_layerwise_against_the_cluster_over_tcp(cluster: Cluster, tmp_path: Path) -> None:
    """``kvpool bench layerwise --url --transport tcp``: the distributed reader and
    writer through the chosen data path (a layer read as one batch of ranges)."""
    out = tmp_path / "lw.json"
    argv = [
        *("bench", "layerwise", "--url", cluster.url, "--transport", "tcp", "--layers", "4"),
        *("--tokens", "128", "--kv-heads", "2", "--head-dim", "64", "--block-tokens", "64"),
        *("--rounds", "1", "--json", str(out)),
    ]
    assert cli_main(argv) == 0
    result = json.loads(out.read_text())
    assert result["mode"] == "distributed" and result["transport"] == "tcp"
    assert result["blocks"] == 2 and result["load_s"] > 0 and result["store_s"] > 0

"""``kvpool serve --pool URL``: workers on an existing cluster, which outlives the server."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import torch
from clusterhelpers import start_cluster

import kvpool
from kvpool.serve.runtime.model import build_model, generate

torch.set_num_threads(1)


def test_serve_on_an_existing_pool_leaves_it_running() -> None:
    cluster = start_cluster(["32MiB"])
    popen = None
    try:
        popen = subprocess.Popen(
            [
                *(sys.executable, "-m", "kvpool", "serve", "--pool", cluster.url, "--port", "0"),
                *("--block-tokens", "16", "--kv-tokens", "2048"),
            ],
            stdout=subprocess.PIPE,
            text=True,
            env=dict(os.environ, PYTHONUNBUFFERED="1"),
        )
        assert popen.stdout is not None
        line = popen.stdout.readline()
        assert "ready on http://" in line, line
        url = line.split("ready on ")[1].split()[0]
        workers = httpx.get(f"{url}/health").json()["workers"]
        assert sorted(w["id"] for w in workers) == ["d0", "p0"]
        ids = list(range(30, 80))
        r = httpx.post(
            f"{url}/v1/completions", json={"prompt": ids, "max_tokens": 6, "ignore_eos": True}
        )
        assert r.status_code == 200, r.text
        model = build_model("tiny", 0, block_tokens=16)
        assert r.json()["choices"][0]["token_ids"] == generate(model, ids, 6)
        popen.send_signal(signal.SIGTERM)
        assert popen.wait(30) == 0
        time.sleep(0.2)
        assert cluster.master.popen.poll() is None  # not ours to stop
        assert all(n.popen.poll() is None for n in cluster.nodes)
        with kvpool.connect(cluster.url) as pool:
            assert pool.stats()["blocks"] >= 3  # the prompt's blocks stay in the pool
    finally:
        if popen is not None and popen.poll() is None:
            popen.kill()
            popen.wait(10)
        cluster.stop()

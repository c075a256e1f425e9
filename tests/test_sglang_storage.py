"""KVPoolStorage through SGLang's real HiCache storage API, over a real kvpool cluster.

Each step runs in its own process in the engine venv (tests/engines/sglang_driver.py):
SGLang's ``StorageBackendFactory`` creates the backend from a
``HiCacheStorageConfig`` (``dynamic`` backend, zero-copy interface), and the
calls are the ones its cache controller makes for write-back and prefetch.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
from pathlib import Path
from typing import Any

import pytest
from clusterhelpers import start_cluster
from vllmhelpers import ENGINE_VENV, ROOT, require_engine_venv

pytestmark = pytest.mark.timeout(300)

DRIVER = ROOT / "tests" / "engines" / "sglang_driver.py"
PAGES = 6
# SGLang's utils import triton at module level; it lives beside the engine venv
# (.ci/engine-env) so that vLLM's imports never see it.
ENV = dict(os.environ, PYTHONPATH=str(ENGINE_VENV / "sglang-extras"))


def run_step(python: Path, tmp_path: Path, job: dict[str, Any]) -> dict[str, Any]:
    job_path, out_path = tmp_path / f"{job['step']}.json", tmp_path / f"{job['step']}.out"
    job_path.write_text(json.dumps(job))
    proc = subprocess.run(
        [str(python), str(DRIVER), str(job_path), str(out_path)],
        capture_output=True,
        text=True,
        timeout=240,
        env=ENV,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out_path.read_text())


@pytest.fixture(scope="module")
def python() -> Path:
    return require_engine_venv("sglang.srt.mem_cache.storage", ENV)


def test_write_back_then_prefetch_in_another_process(python: Path, tmp_path: Path):
    cluster = start_cluster(["64MiB"])
    try:
        extra = {"url": cluster.url}
        wrote = run_step(
            python, tmp_path, {"step": "write", "pages": PAGES, "seed": 7, "extra": extra}
        )
        read = run_step(
            python, tmp_path, {"step": "read", "pages": PAGES, "seed": 7, "extra": extra}
        )
    finally:
        cluster.stop()
    assert wrote["first"] == [True] * PAGES
    assert wrote["again"] == [True] * PAGES
    assert wrote["generic"] is True
    assert wrote["stats"]["pages_set"] == PAGES + 2
    assert wrote["stats"]["pages_skipped"] == PAGES  # the second write-back stored nothing
    assert read["hit"] == PAGES  # the leading stored pages, not the unknown tail
    assert read["got"] == [True] * PAGES
    assert read["same"] == [True] * PAGES  # the bytes landed in the new host slots
    assert read["missing"] == [False, False]
    assert read["generic_same"] == [True, True]
    assert read["exists_first"] is True
    assert read["other_rank_hit"] == 0  # another TP rank holds other heads
    assert read["mla_shared"] is True  # MLA: one copy for every rank
    assert read["mla_differs_from_mha"] is True


def test_a_page_missing_one_piece_is_a_miss_and_rewritten_alone(python: Path, tmp_path: Path):
    cluster = start_cluster(["64MiB"])
    try:
        out = run_step(
            python,
            tmp_path,
            {"step": "partial", "pages": PAGES, "seed": 11, "extra": {"url": cluster.url}},
        )
    finally:
        cluster.stop()
    assert out["pieces"] == 2  # page_first MHA: K and V, a block each
    assert out["wrote"] == [True] * PAGES and out["removed"] is True
    assert out["hit"] == 2  # the leading whole pages; page 2 lacks its V
    assert out["exists"] == [i != 2 for i in range(PAGES)]
    assert out["got"] == [True, True] + [False] * (PAGES - 2)  # the leading run stops there
    assert out["rewrote"] == [True] * PAGES
    assert (out["set"], out["skipped"]) == (1, PAGES - 1)  # only page 2 written again
    assert out["hit_after"] == PAGES
    assert out["got_after"] == [True] * PAGES
    assert out["same"] == [True] * PAGES


def test_calls_whose_counts_disagree_raise_and_store_nothing(python: Path, tmp_path: Path):
    cluster = start_cluster(["64MiB"])
    try:
        job = {"step": "mismatch", "seed": 12, "extra": {"url": cluster.url}}
        out = run_step(python, tmp_path, job)
    finally:
        cluster.stop()
    assert out["unregistered"] == (
        "RuntimeError: KVPoolStorage: register_mem_pool_host was not called"
    )
    assert out["set_v1"] == (
        "RuntimeError: KVPoolStorage: 2 page buffers for 2 pages of 2 from the host pool"
    )
    assert out["get_v1"] == (
        "RuntimeError: KVPoolStorage: 6 page buffers for 2 pages of 2 from the host pool"
    )
    assert out["batch_set"] == "ValueError: KVPoolStorage: 1 values for 2 keys"
    assert out["batch_get"] == "ValueError: KVPoolStorage: 1 targets for 2 keys"
    assert out["hit_after_errors"] == 0  # nothing was stored by the refused calls
    assert out["wrote"] == [True, True] and out["hit"] == 2


def test_pool_down_is_a_miss(python: Path, tmp_path: Path):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    extra = {"url": f"kvpool://127.0.0.1:{port}", "timeout": 1.0}
    out = run_step(python, tmp_path, {"step": "down", "extra": extra})
    assert out == {**out, "hit": 0, "set": [False, False], "get": [False, False]}
    assert out["seconds"] < 10

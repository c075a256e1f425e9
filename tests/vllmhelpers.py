"""Run real vLLM (CPU build) instances from the engine venv for the connector tests.

The engine lives in its own venv (``.ci/engine-env`` builds ``.venv-engines``):
vLLM pins its own stack. Each instance is a subprocess running
``tests/engines/vllm_driver.py`` on a JSON job, so every instance starts with
an empty local cache, as a fresh vLLM would. Without the venv the tests skip,
unless ``KVPOOL_REQUIRE_ENGINES=1`` (CI sets it), where they fail.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
DRIVER = ROOT / "tests" / "engines" / "vllm_driver.py"
ENGINE_VENV = Path(os.environ.get("KVPOOL_ENGINE_VENV", ROOT / ".venv-engines"))
ENGINE_PYTHON = ENGINE_VENV / "bin" / "python"
REQUIRED = os.environ.get("KVPOOL_REQUIRE_ENGINES", "") == "1"
# One instance: ~20 s to start in single-process mode, ~50 s in multiprocess
# mode, on an idle 2-core machine; generous for a loaded one.
INSTANCE_TIMEOUT_S = 300


def require_engine_venv(module: str, env: dict[str, str] | None = None) -> Path:
    """The engine venv's python, if ``module`` imports there; else skip (or fail in CI)."""
    reason = f"engine venv {ENGINE_VENV} missing: run .ci/engine-env"
    if ENGINE_PYTHON.exists():
        probe = subprocess.run(
            [str(ENGINE_PYTHON), "-c", f"import {module}"],
            capture_output=True,
            text=True,
            env=env,
        )
        if probe.returncode == 0:
            return ENGINE_PYTHON
        reason = f"{module} does not import in {ENGINE_VENV}: {probe.stderr.strip()[-300:]}"
    if REQUIRED:
        pytest.fail(reason)
    pytest.skip(reason)


def tokens(seed: int, n: int) -> list[int]:
    """A deterministic token-id prompt (ids within the tiny model's vocabulary)."""
    rng = random.Random(seed)
    return [rng.randrange(1, 1000) for _ in range(n)]


def make_checkpoint(python: Path, path: Path) -> Path:
    subprocess.run(
        [str(python), str(DRIVER), "checkpoint", str(path)],
        check=True,
        capture_output=True,
        timeout=INSTANCE_TIMEOUT_S,
    )
    return path


def kv_config(role: str, **extra: Any) -> dict[str, Any]:
    return {
        "kv_connector": "KVPoolConnector",
        "kv_connector_module_path": "kvpool.bindings.vllm",
        "kv_role": role,
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": extra,
    }


def run_vllm(
    python: Path,
    workdir: Path,
    name: str,
    model: Path,
    rounds: list[list[list[int]]],
    *,
    kv: dict[str, Any] | None = None,
    uni: bool = True,
    prefix_caching: bool = False,
    max_tokens: int = 8,
) -> dict[str, Any]:
    """One vLLM instance running ``rounds`` of prompts; its JSON result."""
    job = {
        "model": str(model),
        "rounds": rounds,
        "kv": kv,
        "uni": uni,
        "prefix_caching": prefix_caching,
        "max_tokens": max_tokens,
    }
    job_path, out_path, log_path = (workdir / f"{name}.{ext}" for ext in ("job", "out", "log"))
    job_path.write_text(json.dumps(job))
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1")
    env.pop("PYTHONHASHSEED", None)  # kvpool keys must not depend on it
    with open(log_path, "w") as log:
        proc = subprocess.run(
            [str(python), str(DRIVER), str(job_path), str(out_path)],
            stdout=log,
            stderr=subprocess.STDOUT,
            timeout=INSTANCE_TIMEOUT_S,
            env=env,
            cwd=workdir,
        )
    if proc.returncode != 0:
        tail = log_path.read_text()[-4000:]
        raise AssertionError(f"vLLM instance {name} exited {proc.returncode}:\n{tail}")
    return json.loads(out_path.read_text())

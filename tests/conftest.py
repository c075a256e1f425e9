"""Shared fixtures: small embedded pools, deterministic keys and payloads."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from poolhelpers import BLOCK, make_keys

from kvpool import Pool


@pytest.fixture
def keys() -> list[bytes]:
    return make_keys(64)


@pytest.fixture
def pool() -> Iterator[Pool]:
    with Pool.embedded(dram_bytes=16 * BLOCK) as p:
        yield p


@pytest.fixture
def ssd_pool(tmp_path: object) -> Iterator[Pool]:
    with Pool.embedded(dram_bytes=4 * BLOCK, ssd_path=str(tmp_path), ssd_bytes=32 * BLOCK) as p:
        yield p


@pytest.fixture(autouse=True, scope="session")
def no_leaked_shared_memory() -> Iterator[None]:
    """Every arena this test process creates must be unlinked by the end."""
    yield
    mine = f"kvpool-{os.getpid()}-"
    leaked = [n for n in os.listdir("/dev/shm") if n.startswith(mine)]
    assert not leaked, f"shared-memory arenas left behind: {leaked}"

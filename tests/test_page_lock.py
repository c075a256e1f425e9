"""CUDA page-locking of host memory: the outcome is always reported, never silently skipped.

Without a GPU only the "unavailable"/"off" outcomes can really happen; the
registered and failed outcomes are driven through a fake CUDA runtime
(unit level: what is recorded and that a registration is undone before the
memory is unmapped). On a GPU machine ``kvpool bench gpu`` checks the real
registration (its ``pinned`` and ``transports`` sections).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvpool.embedded.pool import Pool
from kvpool.storage import page_lock as pl
from kvpool.storage.arena import SharedArena
from kvpool.transport.peers import PeerTransports, expose_region


class FakeCudart:
    """Records cudaHostRegister/Unregister calls; returns ``code`` from register."""

    def __init__(self, code: int = 0) -> None:
        self.code = code
        self.registered: dict[int, int] = {}
        self.calls: list[tuple[str, int]] = []

    def cudaHostRegister(self, address: int, size: int, flags: int) -> int:
        self.calls.append(("register", address))
        if self.code == 0:
            self.registered[address] = size
        return self.code

    def cudaHostUnregister(self, address: int) -> int:
        self.calls.append(("unregister", address))
        del self.registered[address]
        return 0

    def cudaGetErrorString(self, code: int) -> str:
        return {712: "part or all of the requested memory range is already mapped"}[code]


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> FakeCudart:
    fake = FakeCudart()
    monkeypatch.setattr(pl, "cuda_runtime", lambda: (fake, ""))
    return fake


def test_without_cuda_the_reason_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(pl.ENV_SWITCH, raising=False)
    cudart, why = pl.cuda_runtime()
    if cudart is not None:
        pytest.skip("this machine has CUDA: kvpool bench gpu checks the real registration")
    with Pool.embedded(dram_bytes=1 << 20) as pool:
        status = pool.stats()["tiers"]["dram"]["page_lock"]
    assert status == f"unavailable: {why}" and why


def test_off_by_config_and_by_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvpool.config import PoolConfig

    with Pool(PoolConfig(dram_bytes=1 << 20, page_lock=False)) as pool:
        assert pool.stats()["tiers"]["dram"]["page_lock"].startswith("off: disabled by config")
    monkeypatch.setenv(pl.ENV_SWITCH, "0")
    assert pl.page_lock(4096, 4096).status == "off: KVPOOL_PAGE_LOCK=0"


def test_registered_arena_is_unregistered_before_unmap(fake_cuda: FakeCudart) -> None:
    arena = SharedArena(1 << 20)
    address = arena.view.ctypes.data
    assert arena.page_locked and arena.page_lock.status == "registered"
    assert fake_cuda.registered == {address: 1 << 20}
    arena.close()
    assert fake_cuda.registered == {} and arena.page_lock.status == "released"
    arena.close()  # idempotent: no second unregister
    assert fake_cuda.calls == [("register", address), ("unregister", address)]


def test_refused_registration_is_reported_with_the_error(fake_cuda: FakeCudart) -> None:
    fake_cuda.code = 712  # cudaErrorHostMemoryAlreadyRegistered
    with Pool.embedded(dram_bytes=1 << 20) as pool:
        status = pool.stats()["tiers"]["dram"]["page_lock"]
        pool.put(b"k" * 16, b"x" * 100)  # the pageable arena still works
        assert pool.get(b"k" * 16) == b"x" * 100
    assert status == (
        "failed: cudaHostRegister returned 712 "
        "(part or all of the requested memory range is already mapped)"
    )
    assert [c for c, _ in fake_cuda.calls] == ["register"]  # nothing to unregister


def test_raising_binding_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    class Broken:
        def cudaHostRegister(self, *args: Any) -> int:
            raise AttributeError("no cudaHostRegister in this build")

    monkeypatch.setattr(pl, "cuda_runtime", lambda: (Broken(), ""))
    status = pl.page_lock(4096, 4096).status
    assert status.startswith("failed: cudaHostRegister raised AttributeError")


def test_shm_client_registers_its_mapping_only_for_gpu_copies(fake_cuda: FakeCudart) -> None:
    """A same-host client never registers for host copies; its status says so.

    (The GPU copy that triggers registration needs CUDA: kvpool bench gpu.)"""
    fake_cuda.code = 0
    arena = SharedArena(1 << 20, page_lock=False)
    exposed = expose_region(arena.view, node_id="n1", shm_name=arena.name, ucx=False)
    peers = PeerTransports()
    try:
        t = peers.get(exposed.info)
        assert t.name == "shm"
        t.write(0, np.arange(256, dtype=np.uint8))
        out = np.empty(256, np.uint8)
        t.read_into(0, out)
        assert np.array_equal(out, np.arange(256, dtype=np.uint8))
        assert fake_cuda.calls == []  # host buffers only: no CUDA context, no registration
        assert peers.stats()["shm"]["page_lock"] == {"n1": "not yet: no GPU buffer copied"}
        t._lock_pages()  # what the first GPU copy does
        assert peers.stats()["shm"]["page_lock"] == {"n1": "registered"}
        (address,) = fake_cuda.registered
        peers.close()
        assert fake_cuda.registered == {}  # unregistered on close, before the unmap
        assert ("unregister", address) in fake_cuda.calls
    finally:
        peers.close()
        exposed.close()
        arena.close()


def _mapped_arenas() -> set[str]:
    maps = Path("/proc/self/maps").read_text().split()
    return {m for m in maps if m.startswith(f"/dev/shm/kvpool-{os.getpid()}-")}


def test_closing_a_pool_unregisters_then_unmaps_its_arena(fake_cuda: FakeCudart) -> None:
    """close() lets go of the arena at once: no view kept alive by a closed tier."""
    before = _mapped_arenas()
    pool = Pool.embedded(dram_bytes=1 << 20)
    pool.put(b"k" * 16, b"x" * 100)
    assert len(_mapped_arenas() - before) == 1 and fake_cuda.registered
    pool.close()
    assert fake_cuda.registered == {}  # unregistered first ...
    assert _mapped_arenas() == before  # ... then unmapped, not left to the GC

"""ServerGc: the collector rule of ``kvpool master`` and ``kvpool node``.

Unit tests in this process (the rule is undone after each), then the real
commands: each logs the rule it runs under.
"""

from __future__ import annotations

import gc
import subprocess
import sys
import time
import weakref
from collections.abc import Iterator

import pytest

from kvpool.gc_policy import NO_FULL_BY_COUNTS, ServerGc
from kvpool.procs import spawn_kvpool


@pytest.fixture
def restore_gc() -> Iterator[None]:
    saved = gc.get_threshold()
    yield
    gc.set_threshold(*saved)
    gc.unfreeze()  # this test process goes on with its objects walked as before


class _Cycle:
    def __init__(self) -> None:
        self.me = self


def test_start_freezes_and_ends_full_passes_by_counts_stop_restores(restore_gc: None) -> None:
    saved = gc.get_threshold()
    collector = ServerGc()
    collector.start()
    try:
        assert gc.get_threshold() == (*saved[:2], NO_FULL_BY_COUNTS)  # young, middle kept
        assert gc.get_freeze_count() > 0
        assert gc.isenabled()
        collector.start()  # once: a second start changes nothing
        assert gc.get_threshold() == (*saved[:2], NO_FULL_BY_COUNTS)
    finally:
        collector.stop()
    assert gc.get_threshold() == saved
    collector.stop()  # idempotent


def test_the_timer_reclaims_a_cycle_the_young_passes_left(restore_gc: None) -> None:
    collector = ServerGc(full_every_s=0.05)
    collector.start()
    try:
        cycle = _Cycle()
        gone = weakref.ref(cycle)
        gc.collect(1)  # survives the young passes: now in the oldest generation
        del cycle  # garbage only a full pass finds
        deadline = time.monotonic() + 5.0
        while gone() is not None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert gone() is None
        assert collector.full_passes >= 1
        assert 0 < collector.longest_pass_s < 5.0
    finally:
        collector.stop()


def test_counts_never_run_a_full_pass(restore_gc: None) -> None:
    """250k objects kept, then dropped: CPython's default thresholds run 2 full
    passes over this process's heap meanwhile; the servers' rule none."""
    collector = ServerGc(full_every_s=3600)
    collector.start()
    full = []

    def count(phase: str, info: dict[str, int]) -> None:
        if phase == "start" and info["generation"] == 2:
            full.append(info)

    gc.callbacks.append(count)
    try:
        garbage = [[_Cycle() for _ in range(100)] for _ in range(2500)]
        del garbage
        assert full == []
    finally:
        gc.callbacks.remove(count)
        collector.stop()


@pytest.mark.parametrize("bad", [0, -1.0, float("nan")])
def test_a_bad_interval_is_refused(bad: float) -> None:
    with pytest.raises(ValueError, match="full_every_s"):
        ServerGc(full_every_s=bad)


def test_master_and_node_run_under_the_rule(tmp_path) -> None:
    logs = {name: tmp_path / f"{name}.log" for name in ("master", "node")}
    with open(logs["master"], "w") as master_log:
        master = spawn_kvpool(
            ["master", "--host", "127.0.0.1", "--port", "0"], stderr=master_log.fileno()
        )
    try:
        with open(logs["node"], "w") as node_log:
            node = spawn_kvpool(
                ["node", "--master", master.address, "--dram", str(16 << 20)],
                stderr=node_log.fileno(),
            )
        node.stop()
    finally:
        master.stop()
    for name, path in logs.items():
        text = path.read_text()
        assert "kvpool.gc_policy INFO garbage collector:" in text, (name, text[-2000:])
        assert "the whole heap every 60 s, not by counts" in text


def test_the_library_leaves_the_engines_collector_alone() -> None:
    code = (
        "import gc; before = gc.get_threshold(); import kvpool, kvpool.cluster.client.remote_pool;"
        " print(gc.get_threshold() == before, gc.get_freeze_count())"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert done.stdout.split() == ["True", "0"]

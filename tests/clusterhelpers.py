"""Start real master and node processes for integration tests, and clean them up."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvpool.procs import Child, kvpool_args, spawn_kvpool, start, wait_ready


def spawn(args: Sequence[str], prefix: Sequence[str] = (), timeout: float = 20.0) -> Child:
    """Run ``python -m kvpool ARGS`` and wait for its ready line."""
    return spawn_kvpool(args, prefix=prefix, timeout=timeout)


@dataclass
class Cluster:
    master: Child
    nodes: list[Child] = field(default_factory=list)
    master_args: list[str] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"kvpool://{self.master.address}"

    def add_node(self, dram: str, *extra: str) -> Child:
        return wait_ready(self.start_node(dram, *extra), 20.0)

    def start_node(self, dram: str, *extra: str) -> Child:
        """Start a node without waiting for it (``wait_ready`` next); ``stop`` covers it."""
        args = ["node", "--master", self.master.address, "--dram", dram, "--heartbeat", "0.2"]
        node = start("node", kvpool_args(*args, *extra), stderr=subprocess.DEVNULL)
        self.nodes.append(node)
        return node

    def restart_master(self) -> None:
        self.master.kill()
        self.master = self.restart_master_process()

    def restart_master_process(self) -> Child:
        """A new master on the killed one's port (the caller killed it)."""
        return spawn(["master", "--port", str(self.master.port), *self.master_args])

    def stop(self) -> None:
        for proc in [*self.nodes, self.master]:
            proc.stop()


def start_cluster(node_drams: Sequence[str], *master_args: str) -> Cluster:
    args = ["--node-ttl", "1.5", *master_args]
    cluster = Cluster(spawn(["master", "--port", "0", *args]), master_args=args)
    try:  # the nodes start side by side: each is a Python start-up of ~0.3 s
        for node in [cluster.start_node(dram) for dram in node_drams]:
            wait_ready(node, 20.0)
    except BaseException:
        cluster.stop()
        raise
    return cluster


def wait_until(
    predicate: Callable[[], object], timeout: float = 10.0, interval: float = 0.05
) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return False

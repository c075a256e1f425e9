"""Start real master and node processes for integration tests, and clean them up."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

READY = re.compile(r"(?:ready on|on) ([\d.]+):(\d+)")


@dataclass
class Proc:
    popen: subprocess.Popen[str]
    host: str
    port: int
    line: str

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def kill(self) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGKILL)
            self.popen.wait(10)

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()


def spawn(args: Sequence[str], prefix: Sequence[str] = (), timeout: float = 20.0) -> Proc:
    """Run ``python -m kvpool ARGS`` and wait for its ready line."""
    popen = subprocess.Popen(
        [*prefix, sys.executable, "-m", "kvpool", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
    )
    deadline = time.monotonic() + timeout
    assert popen.stdout is not None
    while time.monotonic() < deadline:
        line = popen.stdout.readline()
        if not line:
            break
        match = READY.search(line)
        if match:
            return Proc(popen, match.group(1), int(match.group(2)), line.strip())
    popen.kill()
    raise RuntimeError(f"kvpool {' '.join(args)} did not start")


@dataclass
class Cluster:
    master: Proc
    nodes: list[Proc] = field(default_factory=list)
    master_args: list[str] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"kvpool://{self.master.address}"

    def add_node(self, dram: str, *extra: str) -> Proc:
        node = spawn(
            ["node", "--master", self.master.address, "--dram", dram, "--heartbeat", "0.2", *extra]
        )
        self.nodes.append(node)
        return node

    def restart_master(self) -> None:
        self.master.kill()
        self.master = spawn(["master", "--port", str(self.master.port), *self.master_args])

    def stop(self) -> None:
        for proc in [*self.nodes, self.master]:
            proc.stop()


def start_cluster(node_drams: Sequence[str], *master_args: str) -> Cluster:
    args = ["--node-ttl", "1.5", *master_args]
    cluster = Cluster(spawn(["master", "--port", "0", *args]), master_args=args)
    try:
        for dram in node_drams:
            cluster.add_node(dram)
    except BaseException:
        cluster.stop()
        raise
    return cluster


def wait_until(predicate, timeout: float = 10.0, interval: float = 0.05) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return False

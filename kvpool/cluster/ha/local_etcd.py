"""A throwaway single-member etcd on loopback (tests, ``kvpool bench failover``).

Runs the ``etcd`` binary (Debian's ``etcd-server``) in a temporary data
directory with short election timeouts, and waits until it reports healthy.
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request
from dataclasses import dataclass

from kvpool.errors import KVPoolError


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class LocalEtcd:
    popen: subprocess.Popen[bytes]
    url: str
    data_dir: tempfile.TemporaryDirectory[str]

    def pause(self) -> None:
        self.popen.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.popen.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        self.resume()
        self.popen.kill()
        self.popen.wait(10)
        self.data_dir.cleanup()


def etcd_binary() -> str | None:
    return shutil.which("etcd")


def start_etcd(binary: str | None = None, timeout: float = 15.0) -> LocalEtcd:
    binary = binary or etcd_binary()
    if binary is None:
        raise KVPoolError("no etcd binary on PATH (apt-get install etcd-server)")
    client, peer = free_port(), free_port()
    data = tempfile.TemporaryDirectory(prefix="kvpool-etcd-")
    url, peer_url = f"http://127.0.0.1:{client}", f"http://127.0.0.1:{peer}"
    popen = subprocess.Popen(
        [
            binary,
            "--name=t",
            f"--data-dir={data.name}",
            f"--listen-client-urls={url}",
            f"--advertise-client-urls={url}",
            f"--listen-peer-urls={peer_url}",
            f"--initial-advertise-peer-urls={peer_url}",
            f"--initial-cluster=t={peer_url}",
            "--heartbeat-interval=10",
            "--election-timeout=100",
            "--log-level=error",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    etcd = LocalEtcd(popen, url, data)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=1) as reply:
                if b"true" in reply.read():
                    return etcd
        except OSError:
            time.sleep(0.1)
    etcd.stop()
    raise KVPoolError(f"etcd did not become healthy within {timeout:g} s")

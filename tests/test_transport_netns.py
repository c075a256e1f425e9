"""Two "hosts": node and client in two network namespaces joined by a veth pair.

The node also exposes its /dev/shm arena (the file is visible from both
namespaces), but the client's host identity differs, so ``select_transport``
must pick TCP and move the bytes over the veth link, token checked.
Skipped where network namespaces cannot be created (no root, no ``ip``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator

import pytest

NODE = r"""
import os, sys
import numpy as np
from kvpool.storage.arena import SharedArena
from kvpool.transport.peers import expose_region
arena = SharedArena(8 << 20)
arena.view[:] = np.resize(np.arange(251, dtype=np.uint8), 8 << 20)
exposed = expose_region(arena.view, node_id="far", shm_name=arena.name, host=sys.argv[1],
                        token="veth-token", ucx=False)
print(exposed.info.to_dict(), flush=True)
sys.stdin.read()
exposed.close()
arena.close()
"""

CLIENT = r"""
import ast, sys
import numpy as np
from kvpool.errors import HandshakeRefusedError
from kvpool.transport.base import RegionInfo
from kvpool.transport.select import select_transport
info = RegionInfo.from_dict(ast.literal_eval(sys.argv[1]))
try:
    select_transport(info, token="wrong").read_into(0, bytearray(1))
    raise SystemExit("wrong token accepted")
except HandshakeRefusedError:
    pass
t = select_transport(info, token="veth-token")
out = np.empty(4 << 20, np.uint8)
t.read_into(5, out)
assert np.array_equal(out, np.resize(np.roll(np.arange(251, dtype=np.uint8), -5), 4 << 20))
data = np.random.default_rng(0).integers(0, 256, 1 << 20, dtype=np.uint8)
t.write(6 << 20, data)
t.read_into(6 << 20, out[: 1 << 20])
assert np.array_equal(out[: 1 << 20], data)
print(t.name, "ok")
"""


def _ip(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10)


@pytest.fixture
def two_hosts() -> Iterator[tuple[str, str, str]]:
    if shutil.which("ip") is None:
        pytest.skip("no `ip` command")
    tag = f"{os.getpid() % 100000}"
    a, b = f"kvpA{tag}", f"kvpB{tag}"
    subnet = f"10.213.{os.getpid() % 250}"
    if _ip("netns", "add", a).returncode != 0:
        pytest.skip("cannot create network namespaces here (needs root / CAP_SYS_ADMIN)")
    try:
        steps = [
            ("netns", "add", b),
            ("link", "add", f"va{tag}", "type", "veth", "peer", "name", f"vb{tag}"),
            ("link", "set", f"va{tag}", "netns", a),
            ("link", "set", f"vb{tag}", "netns", b),
            ("-n", a, "addr", "add", f"{subnet}.1/24", "dev", f"va{tag}"),
            ("-n", b, "addr", "add", f"{subnet}.2/24", "dev", f"vb{tag}"),
            ("-n", a, "link", "set", f"va{tag}", "up"),
            ("-n", b, "link", "set", f"vb{tag}", "up"),
            ("-n", a, "link", "set", "lo", "up"),
            ("-n", b, "link", "set", "lo", "up"),
        ]
        for step in steps:
            res = _ip(*step)
            if res.returncode != 0:
                pytest.skip(f"veth setup failed: ip {' '.join(step)}: {res.stderr.strip()}")
        yield a, b, f"{subnet}.1"
    finally:
        _ip("netns", "del", a)
        _ip("netns", "del", b)


def test_tcp_between_namespaces(two_hosts: tuple[str, str, str]) -> None:
    ns_node, ns_client, node_ip = two_hosts
    env = {**os.environ, "KVPOOL_TRANSPORT": ""}
    node = subprocess.Popen(
        ["ip", "netns", "exec", ns_node, sys.executable, "-c", NODE, node_ip],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert node.stdin is not None and node.stdout is not None
    try:
        info = node.stdout.readline().strip()
        assert info, "node failed to start"
        client = subprocess.run(
            ["ip", "netns", "exec", ns_client, sys.executable, "-c", CLIENT, info],
            capture_output=True,
            text=True,
            timeout=60,
            env=env,
        )
        assert client.returncode == 0, client.stderr
        assert client.stdout.split() == ["tcp", "ok"]
    finally:
        node.stdin.close()
        node.wait(timeout=20)

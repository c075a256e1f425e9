"""UCX data path against a node process; skipped where ucxx is not installed.

The node's listener needs a token: UCXX 0.52 binds it on every interface
(kvpool.transport.ucx_server)."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("ucxx")

from kvpool.transport.base import RegionInfo, UcxInfo
from kvpool.transport.ucx import UcxTransport

NODE = r"""
import sys
import numpy as np
from kvpool.transport.base import host_identity
from kvpool.transport.ucx_server import UcxDataServer
region = np.resize(np.arange(251, dtype=np.uint8), 16 << 20)
srv = UcxDataServer(region, host="127.0.0.1", port=0, token="ucx-test")
print(srv.port, srv.worker_address.hex(), host_identity(), flush=True)
sys.stdin.read()
srv.close()
"""


@pytest.mark.parametrize("same_host", [True, False])
def test_ucx_exact_bytes(same_host: bool) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", NODE], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None and proc.stdin is not None
    try:
        port, addr, host_id = proc.stdout.readline().split()
        ucx = UcxInfo("127.0.0.1", int(port), bytes.fromhex(addr))
        info = RegionInfo("n1", 16 << 20, host_id if same_host else "elsewhere", ucx=ucx)
        with UcxTransport(info, token="ucx-test", timeout=30) as t:
            for n in (1, 4096, 1 << 20, 4 << 20):
                out = np.empty(n, np.uint8)
                t.read_into(7, out)
                assert np.array_equal(
                    out, np.resize(np.roll(np.arange(251, dtype=np.uint8), -7), n)
                )
                data = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8)
                t.write(8 << 20, data)
                t.read_into(8 << 20, out)
                assert np.array_equal(out, data)
    finally:
        proc.stdin.close()
        proc.wait(timeout=20)

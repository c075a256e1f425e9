"""A real etcd for the HA tests (kvpool.cluster.ha.local_etcd).

Skips the test when no ``etcd`` binary is installed, unless
``KVPOOL_REQUIRE_ETCD=1`` (set by .ci/run), which turns that into a failure.
"""

from __future__ import annotations

import os

import pytest

from kvpool.cluster.ha.local_etcd import LocalEtcd, etcd_binary, free_port
from kvpool.cluster.ha.local_etcd import start_etcd as _start

Etcd = LocalEtcd
__all__ = ["Etcd", "free_port", "start_etcd"]


def start_etcd() -> LocalEtcd:
    binary = etcd_binary()
    if binary is None:
        if os.environ.get("KVPOOL_REQUIRE_ETCD") == "1":
            pytest.fail("KVPOOL_REQUIRE_ETCD=1 but no etcd binary (apt-get install etcd-server)")
        pytest.skip("no etcd binary installed (apt-get install etcd-server)")
    return _start(binary)

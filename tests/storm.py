"""The storm tests' client processes (tests/ha_client.py) and the checks of their reports.

Shared by the master storm (tests/test_ha.py: the leader killed under load)
and the node storm (tests/test_node_storm.py: a node killed under load): two
writers and two readers run for a fixed time while the test kills things;
then no client may have raised, no read may have returned wrong bytes, each
kill must be followed by a put within 5 s, and every acknowledged put must
read back exactly.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from ha_client import BLOCK, key_of, payload

import kvpool

ROLES = [("writer", 0), ("writer", 1), ("reader", 0), ("reader", 1)]
GAP_S = 5.0  # the longest a writer may go without an acknowledged put after a kill


@dataclass
class Storm:
    """The running clients; ``collect`` then fills in their reports."""

    clients: list[subprocess.Popen[str]]
    seconds: float
    writers: list[dict[str, Any]] = field(default_factory=list)
    readers: list[dict[str, Any]] = field(default_factory=list)

    def collect(self) -> None:
        """Wait for every client to end and read its report."""
        reports = [json.loads(c.communicate(timeout=self.seconds + 60)[0]) for c in self.clients]
        self.writers, self.readers = reports[:2], reports[2:]

    def check(self, kills: list[float], each_writer: bool) -> None:
        """No client raised, no read was wrong, both readers read, and a put was
        acknowledged within ``GAP_S`` of each kill: by each writer, or by either."""
        reports = self.writers + self.readers
        assert not [e for r in reports for e in r["errors"]], [r["errors"][:3] for r in reports]
        assert not [w for r in self.readers for w in r["wrong"]]
        assert all(r["done"] for r in self.readers)  # readers did read
        dones = (
            [w["done"] for w in self.writers]
            if each_writer
            else [sorted(t for w in self.writers for t in w["done"])]
        )
        for done in dones:
            gaps = [min((t for t in done if t > k), default=float("inf")) - k for k in kills]
            assert all(g <= GAP_S for g in gaps), gaps

    def check_read_back(self, pool: kvpool.RemotePool) -> None:
        """Every acknowledged put reads back exactly (nothing was evicted)."""
        assert pool.stats()["evictions"] == 0  # so every acknowledged put must be there
        out = np.empty(BLOCK, np.uint8)
        for w, report in enumerate(self.writers):
            for i in report["acked"]:
                assert pool.get_into(key_of(w, i), out) == BLOCK, (w, i)
                assert np.array_equal(out, payload(w, i)), (w, i)


@contextmanager
def storm_clients(url: str, seconds: float, mode: str) -> Iterator[Storm]:
    """Start the four clients against ``url`` for ``seconds`` (``mode``: see
    tests/ha_client.py); killed on the way out, whatever happened."""
    script = str(Path(__file__).with_name("ha_client.py"))
    clients = [
        subprocess.Popen(
            [sys.executable, script, url, role, str(ident), str(seconds), mode],
            stdout=subprocess.PIPE,
            text=True,
        )
        for role, ident in ROLES
    ]
    try:
        yield Storm(clients, seconds)
    finally:
        for c in clients:
            c.kill()

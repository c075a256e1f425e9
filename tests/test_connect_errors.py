"""``kvpool.connect``'s options: a bad one is a ValueError naming it, raised before
anything connects (the address below has no master: an option checked only after
connecting would surface as a connection error instead)."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import pytest

import kvpool

NOWHERE = "kvpool://127.0.0.1:9"  # the discard port: nothing listens there

BAD_OPTIONS = [
    ({"timeout": -1}, "timeout must be a positive number of seconds, got -1"),
    ({"timeout": 0}, "timeout must be a positive number of seconds, got 0"),
    ({"timeout": float("nan")}, "timeout must be a positive number of seconds, got nan"),
    ({"lease_cache_s": -1.0}, "lease_cache_s must be >= 0 seconds"),
    ({"lease_cache_s": float("inf")}, "lease_cache_s must be >= 0 seconds"),
    ({"lease_cache_bytes": -5}, "lease_cache_bytes must be an integer >= 0"),
    ({"lease_cache_bytes": 1.5}, "lease_cache_bytes must be an integer >= 0"),
    ({"contribute_dram": -1}, "contribute_dram must be an integer >= 0"),
    ({"put_grant_bytes": -1}, "put_grant_bytes must be an integer >= 0"),
    ({"failover_s": float("nan")}, "the failover deadline must be >= 0 seconds"),
    ({"failover_s": float("inf")}, "the failover deadline must be >= 0 seconds"),
    ({"failover_s": -2}, "the failover deadline must be >= 0 seconds"),
]


@pytest.mark.parametrize(("options", "message"), BAD_OPTIONS, ids=lambda v: str(v)[:30])
def test_a_bad_option_is_refused_before_connecting(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        kvpool.connect(NOWHERE, **options)


def test_a_bad_failover_setting_in_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVPOOL_FAILOVER_S", "nan")
    with pytest.raises(ValueError, match="the failover deadline must be >= 0 seconds"):
        kvpool.connect(NOWHERE)


def test_a_bad_grant_budget_in_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVPOOL_PUT_GRANT_BYTES", "-3")
    with pytest.raises(ValueError, match="KVPOOL_PUT_GRANT_BYTES must be an integer >= 0"):
        kvpool.connect(NOWHERE)


def test_a_bad_lease_hold_in_the_environment_names_it() -> None:
    """Read once at import (``kvpool.config.env_seconds``, as ``env_int`` reads the
    other tuning knobs)."""
    proc = subprocess.run(
        [sys.executable, "-c", "import kvpool.cluster.client.lease_cache"],
        env={**os.environ, "KVPOOL_LEASE_CACHE_S": "nan"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode != 0
    assert "$KVPOOL_LEASE_CACHE_S must be a number of seconds >= 0, got 'nan'" in proc.stderr

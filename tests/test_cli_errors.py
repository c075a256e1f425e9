"""One way to fail on the command line: a clear line on stderr, a non-zero exit, no traceback.

Bad arguments are argparse usage errors (exit 2, from the ``kvpool.args``
types); expected failures while running are ``kvpool CMD: error: MSG``
(exit 1, from ``kvpool.cli.main``).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvpool.cli import main

MISSING = "/nonexistent/kvpool-trace.jsonl"

BAD_ARGUMENTS = [
    (["node", "--master", "127.0.0.1:7480", "--dram", "64XB"], "--dram: not a size: '64XB'"),
    (["node", "--master", "nohost"], "--master: address must be HOST:PORT"),
    (["node", "--master", "h:1", "--ssd-size", "lots"], "--ssd-size: not a size"),
    (["master", "--port", "99999"], "--port: a port is 0-65535"),
    (["master", "--log-level", "LOUD"], "--log-level: invalid choice"),
    (["demo", "--dram", "0"], "--dram: a size must be positive"),
    (["demo", "--requests", "-1"], "--requests: expected an integer >= 0"),
    (["bench", "local", "--sizes", "1XB"], "--sizes: not a size: '1XB'"),
    (["bench", "local", "--tiers", "tape"], "--tiers: unknown tier(s) ['tape']"),
    (["bench", "prefix", "--tokens", "-5"], "--tokens: expected a positive integer"),
    (["bench", "remote", "--working-set", "big"], "--working-set: not a size"),
    (["bench", "hot", "--nodes", "0"], "--nodes: expected a positive integer"),
    (["bench", "layerwise", "--layers", "0"], "--layers: expected a positive integer"),
]


@pytest.mark.parametrize(("argv", "message"), BAD_ARGUMENTS, ids=lambda v: " ".join(v[:3]))
def test_bad_argument_is_a_usage_error(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err
    assert err.strip().splitlines()[-1].startswith(f"kvpool {argv[0]}")
    assert "Traceback" not in err


EXPECTED_FAILURES = [
    (["master", "--host", "0.0.0.0"], "kvpool master: error: refusing to listen on '0.0.0.0'"),
    (["trace", "stats", MISSING], "No such file or directory"),
    (["cachesim", MISSING], "No such file or directory"),
    (["demo", "--ssd-dir", "/proc/kvpool-nope", "--requests", "1"], "not a writable directory"),
]


@pytest.mark.parametrize(("argv", "message"), EXPECTED_FAILURES, ids=lambda v: " ".join(v[:2]))
def test_expected_failure_is_one_line(
    argv: list[str],
    message: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("KVPOOL_TOKEN", raising=False)
    monkeypatch.delenv("KVPOOL_TRACEBACK", raising=False)
    code = main(argv)
    assert code != 0
    err = capsys.readouterr().err
    assert message in err
    assert len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"kvpool {argv[0]}")


def test_traceback_on_request(monkeypatch: pytest.MonkeyPatch) -> None:
    """``KVPOOL_TRACEBACK=1`` lets the exception through, for bug reports."""
    monkeypatch.delenv("KVPOOL_TOKEN", raising=False)
    monkeypatch.setenv("KVPOOL_TRACEBACK", "1")
    with pytest.raises(ValueError, match="refusing to listen"):
        main(["master", "--host", "0.0.0.0"])


def test_real_command_prints_no_traceback() -> None:
    """The installed entry point, as a user runs it."""
    env = {k: v for k, v in os.environ.items() if k not in ("KVPOOL_TOKEN", "KVPOOL_TRACEBACK")}
    for argv in (
        ["node", "--master", "127.0.0.1:7480", "--dram", "64XB"],
        ["master", "--host", "0.0.0.0"],
    ):
        done = subprocess.run(
            [sys.executable, "-m", "kvpool", *argv],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
        )
        assert done.returncode != 0
        assert "Traceback" not in done.stderr
        assert done.stderr.strip().splitlines()[-1].startswith(f"kvpool {argv[0]}")

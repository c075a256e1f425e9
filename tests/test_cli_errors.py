"""One way to fail on the command line: a clear line on stderr, a non-zero exit, no traceback.

Bad arguments are argparse usage errors (exit 2, from the ``kvpool.args``
types); expected failures while running are ``kvpool CMD: error: MSG``
(exit 1, from ``kvpool.failures.run_command``); ``kvpool-serve`` fails
exactly like ``kvpool serve``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvpool.cli import build_parser, main

MISSING = "/nonexistent/kvpool-trace.jsonl"
NO_FILE = f"No such file or directory: {MISSING!r}"


def _fails(capsys: pytest.CaptureFixture[str], argv: list[str]) -> tuple[int, str]:
    """Run ``kvpool ARGV`` in-process; (exit status, stderr). An argparse usage error
    exits with 2; anything escaping ``main`` would fail the test with its traceback."""
    try:
        rc = main(argv)
    except SystemExit as exc:
        rc = int(exc.code or 0)
    return rc, capsys.readouterr().err


def _one_error_line(err: str, prefix: str) -> str:
    """The last stderr line (argparse prints its usage above it), checked."""
    assert "Traceback" not in err
    line = err.strip().splitlines()[-1]
    assert line.startswith(prefix), line
    return line


BAD_ARGUMENTS = [
    (
        ["node", "--master", "h:1", "--dram", "64XB"],
        "node: error: argument --dram: not a size: '64XB'",
    ),
    (["node", "--master", "nohost"], "node: error: argument --master: address must be HOST:PORT"),
    (
        ["node", "--master", "h:1", "--ssd-size", "lots"],
        "node: error: argument --ssd-size: not a size",
    ),
    (["master", "--port", "99999"], "master: error: argument --port: a port is 0-65535"),
    (["master", "--log-level", "LOUD"], "master: error: argument --log-level: invalid choice"),
    (
        ["master", "--grant-share", "1.5"],
        "master: error: argument --grant-share: expected a share from 0 to 1, got '1.5'",
    ),
    (
        ["master", "--grant-share", "nan"],
        "master: error: argument --grant-share: expected a share from 0 to 1, got 'nan'",
    ),
    (
        ["master", "--alloc-ttl", "0"],
        "master: error: argument --alloc-ttl: expected a positive number of seconds, got '0'",
    ),
    (
        ["master", "--alloc-ttl", "inf"],
        "master: error: argument --alloc-ttl: expected a positive number of seconds, got 'inf'",
    ),
    (
        ["master", "--node-ttl", "-1"],
        "master: error: argument --node-ttl: expected a positive number of seconds, got '-1'",
    ),
    (
        ["master", "--lease-ttl", "nan"],
        "master: error: argument --lease-ttl: expected a positive number of seconds, got 'nan'",
    ),
    (
        ["master", "--half-life", "0"],
        "master: error: argument --half-life: expected a positive number of seconds, got '0'",
    ),
    (
        ["master", "--hot-reads", "-1"],
        "master: error: argument --hot-reads: expected a positive number, got '-1'",
    ),
    (
        ["master", "--cool-reads", "inf"],
        "master: error: argument --cool-reads: expected a number >= 0, got 'inf'",
    ),
    (
        ["node", "--master", "h:1", "--heartbeat", "-1"],
        "node: error: argument --heartbeat: expected a positive number of seconds, got '-1'",
    ),
    (["sim", MISSING, "--speed", "0"], "sim: error: argument --speed: expected a positive number"),
    (
        ["sim", MISSING, "--balance-threshold", "1.5"],
        "sim: error: argument --balance-threshold: expected a share from 0 to 1",
    ),
    (["plan", MISSING, "--attainment", "nan"], "plan: error: argument --attainment: expected"),
    (["replay", MISSING, "--timeout", "0"], "replay: error: argument --timeout: expected"),
    (
        ["trace", "synth", "--rate", "-2"],
        "trace synth: error: argument --rate: expected a positive number, got '-2'",
    ),
    (
        ["trace", "synth", "--system-prompts", "0"],
        "trace synth: error: argument --system-prompts: expected a positive integer",
    ),
    (["demo", "--dram", "0"], "demo: error: argument --dram: a size must be positive"),
    (["demo", "--requests", "-1"], "demo: error: argument --requests: expected an integer >= 0"),
    (
        ["bench", "local", "--sizes", "1XB"],
        "bench local: error: argument --sizes: not a size: '1XB'",
    ),
    (
        ["bench", "local", "--tiers", "tape"],
        "bench local: error: argument --tiers: unknown tier(s) ['tape']",
    ),
    (
        ["bench", "prefix", "--tokens", "-5"],
        "bench prefix: error: argument --tokens: expected a positive",
    ),
    (
        ["bench", "remote", "--working-set", "big"],
        "bench remote: error: argument --working-set: not a size",
    ),
    (
        ["bench", "hot", "--nodes", "0"],
        "bench hot: error: argument --nodes: expected a positive integer",
    ),
    (
        ["bench", "layerwise", "--layers", "0"],
        "bench layerwise: error: argument --layers: expected a positive",
    ),
    (["serve", "--prefill", "0"], "serve: error: argument --prefill"),
    (["serve", "--dram", "64XB"], "serve: error: argument --dram"),
    (["serve", "--pool", "http://h:1"], "serve: error: argument --pool"),
    (["serve", "--port", "70000"], "serve: error: argument --port"),
    (["serve", "--log-level", "loud"], "serve: error: argument --log-level"),
    (["calibrate", "--points", "-1"], "calibrate: error: argument --points"),
    (["sim", MISSING, "--cpp-group", "0"], "sim: error: argument --cpp-group"),
    (["sim-cpp", "--lengths", "8k"], "sim-cpp: error: argument --lengths"),
    (["plan", MISSING, "--cpp-groups", "1,x"], "plan: error: argument --cpp-groups"),
    (["replay", MISSING, "--limit", "-3"], "replay: error: argument --limit"),
    (["bench", "serve", "--requests", "0"], "bench serve: error: argument --requests"),
    (["bench", "cpp", "--chunks", "512,-1"], "bench cpp: error: argument --chunks"),
    (["bench", "cpp", "--dram", "lots"], "bench cpp: error: argument --dram"),
]


@pytest.mark.parametrize(("argv", "line"), BAD_ARGUMENTS, ids=lambda v: " ".join(v[:3]))
def test_bad_argument_is_a_usage_error(
    capsys: pytest.CaptureFixture[str], argv: list[str], line: str
) -> None:
    rc, err = _fails(capsys, argv)
    assert rc == 2
    _one_error_line(err, f"kvpool {line}")


EXPECTED_FAILURES = [
    (["master", "--host", "0.0.0.0"], 1, "master: error: ", "refusing to listen on '0.0.0.0'"),
    (
        ["master", "--etcd", "http://127.0.0.1:9", "--leader-ttl", "0.5"],
        1,
        "master: error: ",
        "the leader TTL must be >= 1 s",
    ),
    (
        ["demo", "--ssd-dir", "/proc/kvpool-nope", "--requests", "1"],
        1,
        "demo: error: ",
        "not a writable directory",
    ),
    (
        ["serve", "--prefill", "3", "--cpp-group", "2"],
        1,
        "serve: error: ",
        "is not a multiple of --cpp-group",
    ),
    (["serve", "--model", "nope"], 1, "serve: error: ", "unknown model preset 'nope'"),
    (
        ["bench", "layerwise", "--transport", "tcp"],
        1,
        "bench layerwise: error: ",
        "--transport names the data path to a cluster: give --url too",
    ),
    (
        ["master", "--cool-reads", "9"],  # not below the default --hot-reads 8: would flap
        1,
        "master: error: ",
        "replication needs 0 <= cool reads < hot reads (finite), got cool 9.0, hot 8.0",
    ),
    # A trace that cannot be read: the trace loader's own line (exit status 2).
    (["trace", "stats", MISSING], 2, "trace stats: ", NO_FILE),
    (["cachesim", MISSING], 2, "cachesim: ", NO_FILE),
    (["sim", MISSING], 2, "sim: ", NO_FILE),
    (["plan", MISSING], 2, "plan: ", NO_FILE),
    (["replay", MISSING], 2, "replay: ", NO_FILE),
]


@pytest.mark.parametrize(
    ("argv", "status", "start", "message"), EXPECTED_FAILURES, ids=lambda v: str(v)[:40]
)
def test_expected_failure_is_one_line(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    argv: list[str],
    status: int,
    start: str,
    message: str,
) -> None:
    """Checked before any child process starts; nothing but the one line on stderr."""
    monkeypatch.delenv("KVPOOL_TOKEN", raising=False)
    monkeypatch.delenv("KVPOOL_TRACEBACK", raising=False)
    rc, err = _fails(capsys, argv)
    assert rc == status
    assert len(err.strip().splitlines()) == 1, err
    assert message in _one_error_line(err, f"kvpool {start}")


def test_sim_bad_value_is_one_line(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    record = '{"timestamp": 0, "input_length": 600, "output_length": 4, "hash_ids": [1, 2]}'
    trace.write_text(record + "\n")
    rc, err = _fails(capsys, ["sim", str(trace), "--decode-headroom", "0"])
    assert rc == 1
    assert "decode_headroom must be in (0, 1]" in _one_error_line(err, "kvpool sim: error: ")


def test_traceback_on_request(monkeypatch: pytest.MonkeyPatch) -> None:
    """``KVPOOL_TRACEBACK=1`` lets the exception through, for bug reports."""
    monkeypatch.delenv("KVPOOL_TOKEN", raising=False)
    monkeypatch.setenv("KVPOOL_TRACEBACK", "1")
    with pytest.raises(ValueError, match="refusing to listen"):
        main(["master", "--host", "0.0.0.0"])


SERVE_MAIN = "import sys; from kvpool.serve.cli import main; sys.exit(main())"


@pytest.mark.parametrize(
    ("python_args", "status", "line"),
    [
        (
            ["-m", "kvpool", "node", "--master", "h:1", "--dram", "64XB"],
            2,
            "kvpool node: error: argument --dram",
        ),
        (
            ["-m", "kvpool", "master", "--host", "0.0.0.0"],
            1,
            "kvpool master: error: refusing to listen",
        ),
        (["-c", SERVE_MAIN, "--dram", "64XB"], 2, "kvpool-serve: error: argument --dram"),
        (
            ["-c", SERVE_MAIN, "--prefill", "3", "--cpp-group", "2"],
            1,
            "kvpool-serve: error: --prefill 3 is not",
        ),
    ],
    ids=["kvpool node", "kvpool master", "kvpool-serve usage", "kvpool-serve failure"],
)
def test_installed_entry_points_as_processes(
    python_args: list[str], status: int, line: str
) -> None:
    """``kvpool`` and ``kvpool-serve`` (``kvpool.serve.cli:main``) as a user runs them."""
    env = {k: v for k, v in os.environ.items() if k not in ("KVPOOL_TOKEN", "KVPOOL_TRACEBACK")}
    done = subprocess.run(
        [sys.executable, *python_args], capture_output=True, text=True, env=env, timeout=120
    )
    assert done.returncode == status, done.stderr
    _one_error_line(done.stderr, line)


def _float_options(parser: argparse.ArgumentParser, words: str) -> list[str]:
    """``COMMAND --option`` for each option of ``parser`` and its subcommands parsed
    by a bare ``float``. (argparse lists its actions only in ``_actions``.)"""
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found += _float_options(sub, f"{words} {name}")
        elif action.type is float:
            found.append(f"{words} {'/'.join(action.option_strings) or action.dest}")
    return found


def test_no_option_parses_a_bare_float() -> None:
    """A bare ``float`` takes nan, inf and negative values (a master ran with
    ``--node-ttl -1`` and dropped every node); each float option has a checked type
    from ``kvpool.args`` instead."""
    assert _float_options(build_parser(), "kvpool") == []

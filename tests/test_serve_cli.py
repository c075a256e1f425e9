"""One way to fail: every serve-side command reports a bad argument or an expected
failure (a missing trace file, a bad value) as one stderr line with a non-zero exit
status, never a traceback; ``kvpool-serve`` fails exactly like ``kvpool serve``."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvpool.cli import main

MISSING = "/nonexistent/trace.jsonl"


def _fails(capsys: pytest.CaptureFixture[str], argv: list[str]) -> tuple[int, str]:
    """Run ``kvpool ARGV`` in-process; (exit status, stderr). An argparse usage error
    exits with 2; anything escaping ``main`` would fail the test with its traceback."""
    try:
        rc = main(argv)
    except SystemExit as exc:
        rc = int(exc.code or 0)
    err = capsys.readouterr().err
    return rc, err


def _one_error_line(err: str, prefix: str) -> str:
    """The last stderr line (argparse prints its usage above it), checked."""
    assert "Traceback" not in err
    line = err.strip().splitlines()[-1]
    assert line.startswith(prefix), line
    return line


@pytest.mark.parametrize(
    ("argv", "prefix"),
    [
        (["serve", "--prefill", "0"], "kvpool serve: error: argument --prefill"),
        (["serve", "--dram", "64XB"], "kvpool serve: error: argument --dram"),
        (["serve", "--pool", "http://h:1"], "kvpool serve: error: argument --pool"),
        (["serve", "--port", "70000"], "kvpool serve: error: argument --port"),
        (["serve", "--log-level", "loud"], "kvpool serve: error: argument --log-level"),
        (["calibrate", "--points", "-1"], "kvpool calibrate: error: argument --points"),
        (["sim", MISSING, "--cpp-group", "0"], "kvpool sim: error: argument --cpp-group"),
        (["sim-cpp", "--lengths", "8k"], "kvpool sim-cpp: error: argument --lengths"),
        (["plan", MISSING, "--cpp-groups", "1,x"], "kvpool plan: error: argument --cpp-groups"),
        (["replay", MISSING, "--limit", "-3"], "kvpool replay: error: argument --limit"),
        (["bench", "serve", "--requests", "0"], "kvpool bench serve: error: argument --requests"),
        (["bench", "cpp", "--chunks", "512,-1"], "kvpool bench cpp: error: argument --chunks"),
        (["bench", "cpp", "--dram", "lots"], "kvpool bench cpp: error: argument --dram"),
    ],
)
def test_bad_argument_is_a_usage_error(
    capsys: pytest.CaptureFixture[str], argv: list[str], prefix: str
) -> None:
    rc, err = _fails(capsys, argv)
    assert rc == 2
    _one_error_line(err, prefix)


@pytest.mark.parametrize("command", ["sim", "plan", "replay"])
def test_missing_trace_is_one_line(capsys: pytest.CaptureFixture[str], command: str) -> None:
    rc, err = _fails(capsys, [command, MISSING])
    assert rc != 0
    assert len(err.strip().splitlines()) == 1
    _one_error_line(err, f"kvpool {command}: ")
    assert MISSING in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["serve", "--prefill", "3", "--cpp-group", "2"], "is not a multiple of --cpp-group"),
        (["serve", "--model", "nope"], "unknown model preset 'nope'"),
    ],
)
def test_serve_expected_failure_is_one_line(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    """Checked before any child process starts."""
    rc, err = _fails(capsys, argv)
    assert rc == 1
    assert len(err.strip().splitlines()) == 1
    assert message in _one_error_line(err, "kvpool serve: error: ")


def test_sim_bad_value_is_one_line(capsys: pytest.CaptureFixture[str], tmp_path) -> None:  # type: ignore[no-untyped-def]
    trace = tmp_path / "t.jsonl"
    record = '{"timestamp": 0, "input_length": 600, "output_length": 4, "hash_ids": [1, 2]}'
    trace.write_text(record + "\n")
    rc, err = _fails(capsys, ["sim", str(trace), "--speed", "0"])
    assert rc == 1
    assert "speed must be > 0" in _one_error_line(err, "kvpool sim: error: ")


def test_kvpool_serve_entry_point_fails_like_kvpool_serve() -> None:
    """The installed ``kvpool-serve`` (``kvpool.serve.cli:main``), as a process."""
    code = "import sys; from kvpool.serve.cli import main; sys.exit(main())"
    for argv, status, prefix in (
        (["--dram", "64XB"], 2, "kvpool-serve: error: argument --dram"),
        (["--prefill", "3", "--cpp-group", "2"], 1, "kvpool-serve: error: --prefill 3 is not"),
    ):
        proc = subprocess.run(
            [sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=120
        )
        assert proc.returncode == status, proc.stderr
        _one_error_line(proc.stderr, prefix)

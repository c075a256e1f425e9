"""Child processes: start one, wait for its ready line, stop it. The one helper for
``kvpool serve``, the benchmarks and the tests.

Ready-line convention: a server prints, once it accepts connections, one
stdout line naming where it listens as ``on HOST:PORT`` or ``on
SCHEME://HOST:PORT`` (``kvpool master ready on 127.0.0.1:5000 ...``,
``kvpool node n0 serving ... on 127.0.0.1:5001``, ``kvpool serve ready on
http://127.0.0.1:8000 ...``). ``READY`` matches it; the first matching line
is the ready line.

Every child runs in its own process group (so a terminal's Ctrl-C reaches
only the parent, which then stops its children in order) and, on Linux,
with ``PR_SET_PDEATHSIG`` = SIGTERM (so a parent killed with SIGKILL still
takes its children down; the signal fires when the *thread* that started
the child exits, so start children from a long-lived thread). A reader
thread drains the child's stdout for as long as it runs, keeping the last
lines for diagnostics. Stopping sends SIGTERM to the child's group, waits,
then SIGKILL. Waiting always has a deadline: a silent child never hangs
its parent.

This module sits at the bottom layer: it imports only ``kvpool.errors``.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from kvpool.errors import KVPoolError

#: The ready line: ``... on HOST:PORT`` or ``... on SCHEME://HOST:PORT``.
READY = re.compile(
    r"\bon (?:(?P<scheme>[a-z][a-z0-9+.-]*)://)?"
    r"(?P<host>[\w.-]+|\[[0-9a-fA-F:.]+\]):(?P<port>\d+)"
)
_SHM = "/dev/shm"


class ChildStartError(KVPoolError, RuntimeError):
    """A child exited, or stayed silent past its deadline, before its ready line."""


_TAIL_LINES = 20


@dataclass
class Child:
    """A started child process and, once ready, where its ready line said it listens."""

    name: str
    popen: subprocess.Popen[str]
    host: str = ""
    port: int = 0
    scheme: str = ""  # "http" for ``on http://HOST:PORT``, else ""
    line: str = ""  # the ready line, stripped
    tail: list[str] = field(default_factory=list)  # last lines of its stdout
    ready: threading.Event = field(default_factory=threading.Event)

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def url(self) -> str:
        """``SCHEME://HOST:PORT`` as the ready line named it (HOST:PORT without a scheme)."""
        return f"{self.scheme}://{self.address}" if self.scheme else self.address

    def alive(self) -> bool:
        return self.popen.poll() is None

    def signal_group(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.popen.pid, sig)
        with contextlib.suppress(ProcessLookupError):
            self.popen.send_signal(sig)

    def kill(self) -> None:
        """SIGKILL the child's group now (no clean shutdown) and reap it."""
        if self.popen.returncode is not None:
            return
        self.signal_group(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(10)

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM its group, wait up to ``timeout``, then SIGKILL the group.

        A child already reaped earlier is left alone: its pid (and so its
        group id) may belong to another process by now."""
        if self.popen.returncode is not None:
            return
        self.signal_group(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout)
        # right after the leader exits its group id is still reserved while any
        # member (a grandchild) lives, so this reaches only what it left behind
        self.signal_group(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(5)


def _pdeathsig() -> None:  # runs in the child between fork and exec
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _preexec(cpus: set[int] | None) -> Callable[[], None] | None:
    if sys.platform != "linux":
        return None

    def setup() -> None:
        _pdeathsig()
        if cpus:
            os.sched_setaffinity(0, cpus)

    return setup


def start(
    name: str,
    args: Sequence[str],
    *,
    prefix: Sequence[str] = (),
    cpus: set[int] | None = None,
    stderr: int | None = None,
    env: Mapping[str, str] | None = None,
) -> Child:
    """Start ``[PREFIX] python ARGS`` in its own process group (``wait_ready`` next).

    ``prefix``: a command to run Python under (``taskset``, ``ip netns exec``);
    ``cpus``: pin the child to these CPUs; ``stderr``: None inherits ours;
    ``env``: variables to set on top of ours."""
    popen = subprocess.Popen(
        [*prefix, sys.executable, *args],
        stdout=subprocess.PIPE,
        stderr=stderr,
        stdin=subprocess.DEVNULL,
        text=True,
        env={**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"},
        process_group=0,
        preexec_fn=_preexec(cpus),
    )
    child = Child(name, popen)

    def read() -> None:
        assert popen.stdout is not None
        for line in popen.stdout:  # keeps draining after the ready line
            child.tail = [*child.tail[-(_TAIL_LINES - 1) :], line.rstrip()]
            if not child.ready.is_set():
                m = READY.search(line)
                if m:
                    child.host, child.port = m["host"], int(m["port"])
                    child.scheme, child.line = m["scheme"] or "", line.strip()
                    child.ready.set()

    threading.Thread(target=read, name=f"kvpool-child-out-{name}", daemon=True).start()
    return child


def wait_ready(child: Child, timeout: float = 60.0, cancel: threading.Event | None = None) -> Child:
    """Wait for the child's ready line; stop it and raise ChildStartError if the child
    exits, ``timeout`` seconds pass or ``cancel`` is set first."""
    deadline = time.monotonic() + timeout
    while not child.ready.wait(0.05):
        if (
            child.popen.poll() is not None
            or time.monotonic() > deadline
            or (cancel is not None and cancel.is_set())
        ):
            child.stop(1.0)
            raise ChildStartError(f"{child.name} did not start; last output: {child.tail[-5:]}")
    return child


def spawn(
    name: str,
    args: Sequence[str],
    *,
    timeout: float = 60.0,
    prefix: Sequence[str] = (),
    cpus: set[int] | None = None,
    stderr: int | None = None,
    env: Mapping[str, str] | None = None,
) -> Child:
    """``start`` + ``wait_ready``."""
    child = start(name, args, prefix=prefix, cpus=cpus, stderr=stderr, env=env)
    return wait_ready(child, timeout)


def kvpool_args(*args: str) -> list[str]:
    """Python arguments that run ``kvpool ARGS``."""
    return ["-m", "kvpool", *args]


def spawn_kvpool(
    args: Sequence[str],
    *,
    prefix: Sequence[str] = (),
    cpus: set[int] | None = None,
    timeout: float = 30.0,
    stderr: int | None = subprocess.DEVNULL,
    env: Mapping[str, str] | None = None,
) -> Child:
    """Run ``[PREFIX] python -m kvpool ARGS`` (a master or a node) and wait until it is
    ready; its stderr (logs) is dropped unless ``stderr`` says otherwise; ``env``:
    variables to set on top of ours."""
    return spawn(
        args[0] if args else "kvpool",
        kvpool_args(*args),
        timeout=timeout,
        prefix=prefix,
        cpus=cpus,
        stderr=stderr,
        env=env,
    )


def stop_by_stdin(popen: subprocess.Popen[str], wait_s: float) -> None:
    """Stop a child that exits when its stdin closes; SIGKILL it after ``wait_s``."""
    with contextlib.suppress(OSError):
        assert popen.stdin is not None
        popen.stdin.close()
    try:
        popen.wait(wait_s)
    except subprocess.TimeoutExpired:
        popen.kill()
        popen.wait(10)


def leftover_shm(pids: Sequence[int]) -> list[str]:
    """Names of ``/dev/shm/kvpool-<pid>-*`` segments of the given pids."""
    names = []
    with contextlib.suppress(FileNotFoundError):
        for n in os.listdir(_SHM):
            if any(n.startswith(f"kvpool-{pid}-") for pid in pids):
                names.append(n)
    return names


def unlink_shm(pids: Sequence[int]) -> list[str]:
    """Unlink every ``/dev/shm/kvpool-<pid>-*`` of the given (dead) pids (a child killed
    with -9 cannot unlink its arena)."""
    removed = []
    for n in leftover_shm(pids):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(_SHM, n))
            removed.append(n)
    return removed

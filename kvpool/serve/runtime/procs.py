"""Child processes of ``kvpool serve``: start, wait for the ready line, stop, clean up.

Every child runs in its own process group (so a terminal's Ctrl-C reaches
only ``kvpool serve``, which then stops the children in order: workers, node,
master) and with ``PR_SET_PDEATHSIG`` = SIGTERM on Linux (so a ``kvpool
serve`` killed with SIGKILL still takes its children down). Stopping sends
SIGTERM to the child's group, waits, then SIGKILL. Afterwards any
``/dev/shm/kvpool-<pid>-*`` segment a child left (one killed with -9 cannot
unlink its arena) is unlinked.
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
from collections.abc import Sequence
from dataclasses import dataclass, field

_READY = re.compile(
    r"\bon ([\w.-]+|\[[0-9a-fA-F:.]+\]):(\d+)"
)  # "... ready on H:P", node: "on H:P"
_SHM = "/dev/shm"


def _pdeathsig() -> None:  # runs in the child between fork and exec
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


@dataclass
class Child:
    name: str
    popen: subprocess.Popen[str]
    host: str = ""
    port: int = 0
    line: str = ""
    tail: list[str] = field(default_factory=list)  # last lines of its stdout
    ready: threading.Event = field(default_factory=threading.Event)

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def alive(self) -> bool:
        return self.popen.poll() is None

    def signal_group(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.popen.pid, sig)
        with contextlib.suppress(ProcessLookupError):
            self.popen.send_signal(sig)

    def stop(self, timeout: float = 5.0) -> None:
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


def start(name: str, args: Sequence[str], *, stderr: int | None = None) -> Child:
    """Start ``python ARGS`` (call from a long-lived thread: the parent-death signal
    fires when the thread that started the child exits). ``wait_ready`` next."""
    popen = subprocess.Popen(
        [sys.executable, *args],
        stdout=subprocess.PIPE,
        stderr=stderr,
        stdin=subprocess.DEVNULL,
        text=True,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
        process_group=0,
        preexec_fn=_pdeathsig if sys.platform == "linux" else None,
    )
    child = Child(name, popen)

    def read() -> None:
        assert popen.stdout is not None
        for line in popen.stdout:  # keeps draining after the ready line
            child.tail = [*child.tail[-19:], line.rstrip()]
            if not child.ready.is_set():
                m = _READY.search(line)
                if m:
                    child.host, child.port, child.line = m.group(1), int(m.group(2)), line.strip()
                    child.ready.set()

    threading.Thread(target=read, name=f"kvpool-serve-out-{name}", daemon=True).start()
    return child


def wait_ready(child: Child, timeout: float = 60.0, cancel: threading.Event | None = None) -> Child:
    """Wait for the child's ``on HOST:PORT`` line; stop it and raise if it never comes."""
    deadline = time.monotonic() + timeout
    while not child.ready.wait(0.05):
        if (
            child.popen.poll() is not None
            or time.monotonic() > deadline
            or (cancel is not None and cancel.is_set())
        ):
            child.stop(1.0)
            raise RuntimeError(f"{child.name} did not start; last output: {child.tail[-5:]}")
    return child


def spawn(name: str, args: Sequence[str], *, timeout: float = 60.0) -> Child:
    """``start`` + ``wait_ready``."""
    return wait_ready(start(name, args), timeout)


def kvpool_args(*args: str) -> list[str]:
    return ["-m", "kvpool", *args]


def leftover_shm(pids: Sequence[int]) -> list[str]:
    names = []
    with contextlib.suppress(FileNotFoundError):
        for n in os.listdir(_SHM):
            if any(n.startswith(f"kvpool-{pid}-") for pid in pids):
                names.append(n)
    return names


def unlink_shm(pids: Sequence[int]) -> list[str]:
    """Unlink every ``/dev/shm/kvpool-<pid>-*`` of the given (dead) pids."""
    removed = []
    for n in leftover_shm(pids):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(_SHM, n))
            removed.append(n)
    return removed

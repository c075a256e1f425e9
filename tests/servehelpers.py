"""Start ``kvpool serve`` as a subprocess for end-to-end tests."""

from __future__ import annotations

import subprocess
from collections.abc import Sequence
from dataclasses import dataclass

from kvpool import procs


@dataclass
class Server:
    """A ready ``kvpool serve`` child (in its own process group)."""

    child: procs.Child

    @property
    def popen(self) -> subprocess.Popen[str]:
        return self.child.popen

    @property
    def url(self) -> str:
        return self.child.url

    @property
    def lines(self) -> list[str]:
        """The last lines the server printed (kept up to date by a thread)."""
        return self.child.tail


def start_serve(args: Sequence[str], *, timeout: float = 90) -> Server:
    """``python -m kvpool serve ARGS``, waiting for its ready line (the test fails with
    the server's last output if it never comes)."""
    return Server(procs.spawn("kvpool serve", procs.kvpool_args("serve", *args), timeout=timeout))

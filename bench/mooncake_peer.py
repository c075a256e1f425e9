"""Mooncake Store as the peer of ``kvpool bench remote --peer mooncake``.

It runs beside kvpool's bench cluster for the whole run: its master, a second
process that lends the memory the blocks live in (so every byte crosses a
process boundary over Mooncake's TCP transport), and this process as its client,
with ``MooncakePeer.rows`` measuring the same ops, sizes and working set as
kvpool's rows against the same raw-socket baseline server.

Why beside, not after: ``run_remote`` measures each size's Mooncake rows right
after kvpool's rows of that size, so a slow spell of this shared machine lands
on both stores' rows of a size, not on one store's. When every Mooncake row came
after every kvpool row, one run's 16 MiB TCP batch read was 1.34 GB/s for kvpool
(its raw socket 1.2) against 1.57 for Mooncake (its raw socket 2.98) minutes
later: 0.86x, while each store's ratio to its own raw socket put kvpool 2.1x
ahead (issue 17, session 14).

Absent ``mooncake-transfer-engine-non-cuda`` (or its libibverbs), or where its
processes do not start, ``mooncake_peer`` yields None and says why.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from typing import Any

from kvpool.bench.common import faulted, paired
from kvpool.bench.remote_rows import Baselines, RemoteRow, on_cpus, remote_row
from kvpool.bench.remote_transport import RawClient
from kvpool.procs import stop_by_stdin

_HOLDER = r"""
import sys, time
from mooncake.store import MooncakeDistributedStore
store = MooncakeDistributedStore()
rc = store.setup("127.0.0.1", "P2PHANDSHAKE", int(sys.argv[1]), 16 << 20, "tcp", "", sys.argv[2])
print("mooncake holder ready", rc, flush=True)
sys.stdin.read()
"""


def mooncake_missing() -> str:
    """'' when Mooncake Store can be tried here, else why not."""
    try:
        from mooncake.store import MooncakeDistributedStore  # noqa: F401
    except Exception as exc:  # ImportError, or OSError when libibverbs is missing
        return (
            f"mooncake is not importable ({type(exc).__name__}: {exc}); "
            "pip install mooncake-transfer-engine-non-cuda and apt-get install libibverbs1"
        )
    if _master_binary() is None:
        return "the mooncake_master binary was not found"
    return ""


@dataclass
class MooncakePeer:
    """A Mooncake Store client whose blocks live in another process."""

    store: Any  # mooncake.store.MooncakeDistributedStore

    def rows(
        self, size: int, count: int, raw: RawClient, batch: int, rounds: int
    ) -> list[RemoteRow]:
        """put, get_into, put_batch, get_into_batch of ``count`` blocks of ``size``
        bytes, each paired op by op with the raw socket doing the same."""
        store = self.store
        srcs = [faulted(size) for _ in range(count)]
        outs = [faulted(size, fill=0) for _ in range(count)]
        for buf in [*srcs, *outs]:
            if store.register_buffer(buf.ctypes.data, size) != 0:
                raise RuntimeError("mooncake register_buffer failed")
        keys = [f"bench-{size}-{i}" for i in range(count)]
        groups = [list(range(g, g + batch)) for g in range(0, count, batch)]

        def remove_all() -> None:
            for key in keys:
                store.remove(key, True)  # force: a just-read object is leased for a while

        def put(i: int) -> None:
            if store.put_from(keys[i], srcs[i].ctypes.data, size) != 0:
                raise RuntimeError("mooncake put_from failed")

        def get(i: int) -> None:
            if store.get_into(keys[i], outs[i].ctypes.data, size) != size:
                raise RuntimeError("mooncake get_into failed")

        def put_batch(g: int) -> None:
            idx = groups[g]
            rcs = store.batch_put_from(
                [keys[i] for i in idx], [srcs[i].ctypes.data for i in idx], [size] * len(idx)
            )
            if any(rc != 0 for rc in rcs):
                raise RuntimeError("mooncake batch_put_from failed")

        def get_batch(g: int) -> None:
            idx = groups[g]
            got = store.batch_get_into(
                [keys[i] for i in idx], [outs[i].ctypes.data for i in idx], [size] * len(idx)
            )
            if list(got) != [size] * len(idx):
                raise RuntimeError("mooncake batch_get_into failed")

        base_ops = Baselines.raw_socket(raw, size, srcs, outs, groups)
        what, n = base_ops.name, len(groups)
        rows = []
        remove_all()
        base, ours = paired(size, base_ops.put, put, count, rounds, remove_all)
        rows.append(remote_row("put", "tcp", size, ours, base, what, store="mooncake"))
        base, ours = paired(size, base_ops.get, get, count, rounds)
        rows.append(remote_row("get_into", "tcp", size, ours, base, what, store="mooncake"))
        base, ours = paired(size * batch, base_ops.put_batch, put_batch, n, rounds, remove_all)
        rows.append(remote_row("put_batch", "tcp", size, ours, base, base_ops.put_batch_name,
                               batch, "mooncake"))  # fmt: skip
        base, ours = paired(size * batch, base_ops.get_batch, get_batch, n, rounds)
        rows.append(remote_row("get_into_batch", "tcp", size, ours, base,
                               base_ops.get_batch_name, batch, "mooncake"))  # fmt: skip
        remove_all()
        for buf in [*srcs, *outs]:
            store.unregister_buffer(buf.ctypes.data)
        return rows


@contextmanager
def mooncake_peer(region: int, server_cpus: set[int] | None) -> Iterator[MooncakePeer | None]:
    """Mooncake Store for the duration, its processes on ``server_cpus``, holding up
    to ``region`` bytes of blocks; None (after saying why) where it cannot run.
    Its log (glog, every step at INFO on stderr) goes to a file, shown if the run
    fails meanwhile."""
    os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    why = mooncake_missing()
    if why:
        print(f"peer mooncake: skipped ({why})")
        yield None
        return
    with _stderr_to_file() as log:
        try:
            with _started(region, server_cpus) as peer:
                yield peer
        except BaseException:
            log.seek(0)
            tail = log.read()[-4000:].decode(errors="replace")
            print(f"the run failed with Mooncake Store up; stderr ends with:\n{tail}",
                  file=sys.__stdout__)  # fmt: skip
            raise


@contextmanager
def _started(region: int, server_cpus: set[int] | None) -> Iterator[MooncakePeer | None]:
    from mooncake.store import MooncakeDistributedStore

    port = _free_port()
    master = subprocess.Popen(
        [
            str(_master_binary()),
            f"--rpc_port={port}",
            f"--metrics_port={_free_port()}",
            "--rpc_address=127.0.0.1",
            "--default_kv_lease_ttl=5000",  # 100 ms expired 8 x 16 MiB batches under load
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        preexec_fn=on_cpus(server_cpus),
    )
    holder = None
    try:
        time.sleep(1.0)
        lent = region + region // 2 + (64 << 20)
        holder = subprocess.Popen(
            [sys.executable, "-c", _HOLDER, str(lent), f"127.0.0.1:{port}"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=dict(os.environ),
            preexec_fn=on_cpus(server_cpus),
        )
        assert holder.stdout is not None
        line = holder.stdout.readline()
        if "ready 0" not in line:
            print(f"peer mooncake: skipped (holder process failed: {line.strip()!r})")
            yield None
            return
        store = MooncakeDistributedStore()
        # This process lends no memory (segment 0), so every block lives in the holder.
        rc = store.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", f"127.0.0.1:{port}")
        if rc != 0:
            print(f"peer mooncake: skipped (client setup returned {rc})")
            yield None
            return
        try:
            yield MooncakePeer(store)
        finally:
            with suppress(Exception):
                store.close()
    finally:
        if holder is not None:
            stop_by_stdin(holder, 15)
        master.terminate()
        try:
            master.wait(10)
        except subprocess.TimeoutExpired:
            master.kill()
            master.wait(10)


@contextmanager
def _stderr_to_file() -> Iterator[Any]:
    """Point file descriptor 2 at a temporary file for the duration (C++ logs included)."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as log:
        os.dup2(log.fileno(), 2)
        try:
            yield log
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)


def _master_binary() -> str | None:
    """The mooncake_master executable shipped inside the wheel (else on PATH)."""
    import mooncake

    path = os.path.join(os.path.dirname(mooncake.__file__), "mooncake_master")
    return path if os.access(path, os.X_OK) else shutil.which("mooncake_master")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])

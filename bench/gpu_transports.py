"""Sections ``transports`` and ``ucx`` of ``kvpool bench gpu``: CUDA buffers on the wire paths.

transports: a node's arena served in this process (``expose_region``: a
TCP data server over a shared-memory arena); a same-host client
(``ShmTransport``: maps the arena, registers the mapping with CUDA on its
first GPU copy) and a TCP client (``TcpTransport``: a page-locked bounce
buffer) read into and write from torch CUDA tensors and cupy arrays. Every
transfer is checked byte for byte, in the arena too; GB/s per path against
a torch pinned-memory copy of the same size.

ucx: a node process (``kvpool.bench.gpu_ucx_node``) serves a host arena
over TCP and UCX and a CUDA region over UCX; this process reads into and
writes from CUDA tensors: TCP (bounce buffer) vs UCX from host memory
(cuda_copy) vs UCX from device memory on both ends (cuda_ipc), GB/s and
the UCX/TCP ratio, bytes checked.

Dry run: CPU torch tensors through shm and TCP (the bounce buffer, cupy
and page-locking are named as skipped); the UCX section runs with host
memory on both ends when ucxx is installed, else is skipped.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from functools import partial
from typing import Any

from kvpool.bench.gpu_common import MiB, Section, gbps, interleaved_medians, pattern, same_bytes


def _buffers(s: Section, size: int, seed: int) -> list[tuple[str, Any, Any]]:
    """(kind, source, destination) pairs: torch on the section's device, cupy on CUDA."""
    import torch

    pairs = [
        (
            "torch",
            pattern(size, s.device, seed),
            torch.empty(size, dtype=torch.uint8, device=s.device),
        )
    ]
    if not s.cuda:
        return pairs
    try:
        import cupy
    except ImportError as exc:
        s.skip("cupy buffers", f"cupy is not importable: {exc}")
        return pairs
    src = cupy.asarray(pattern(size, "cuda", seed + 1))
    pairs.append(("cupy", src, cupy.empty(size, dtype=cupy.uint8)))
    return pairs


def run_transports(s: Section, sizes: list[int]) -> None:
    import torch

    from kvpool.storage.arena import SharedArena
    from kvpool.transport.peers import expose_region
    from kvpool.transport.shm import ShmTransport
    from kvpool.transport.tcp import TcpTransport

    # The node stands in for another process: its own registration of the arena
    # would be a second one of the same pages in this process, which a deployment
    # never makes. What is checked is the client's registration of its mapping.
    arena = SharedArena(2 * max(sizes) + MiB, page_lock=False)
    exposed = expose_region(arena.view, node_id="gpu-check", shm_name=arena.name, ucx=False)
    transports = {"shm": ShmTransport(exposed.info), "tcp": TcpTransport(exposed.info)}
    if not s.cuda:
        s.skip(
            "TCP pinned bounce buffer",
            "host destinations are filled directly; the bounce buffer is for CUDA buffers",
        )
    try:
        for size in sizes:
            s.check_time(f"transports {size >> 20} MiB")
            mib = size >> 20
            for kind, src, dst in _buffers(s, size, seed=size):
                for name, t in transports.items():
                    offset = size if name == "tcp" else 0  # both halves of the arena get written
                    t.write(offset, src)
                    t.read_into(offset, dst)
                    ok = same_bytes(dst, src) and same_bytes(
                        arena.view[offset : offset + size], src
                    )
                    s.check(f"{name} {kind} {s.device} {mib} MiB write+read exact (arena too)", ok)
                ops: dict[str, Callable[[], object]] = {}
                for name, t in transports.items():
                    ops[f"{name}_read"] = partial(t.read_into, 0, dst)
                    ops[f"{name}_write"] = partial(t.write, 0, src)
                if s.cuda and kind == "torch":
                    pinned = torch.empty(size, dtype=torch.uint8, pin_memory=True)
                    ops["torch_pinned_h2d"] = partial(dst.copy_, pinned)
                    ops["torch_pinned_d2h"] = partial(pinned.copy_, src)
                t_ = interleaved_medians(ops, device=s.device, rounds=9, section=s)
                for op in ops:
                    s.figure(f"{kind}_{mib}MiB_{op}_gbps", gbps(size, t_[op]))
        shm_status = str(transports["shm"].page_lock_status)
        s.figure("shm_client_page_lock", shm_status)
        if s.cuda:
            s.check(
                "shm client mapping registered with CUDA", shm_status == "registered", shm_status
            )
        else:
            s.check(
                "shm client reports it never needed page-locking",
                shm_status.startswith("not yet"),
                shm_status,
            )
    finally:
        for t in transports.values():
            t.close()
        exposed.close()
        arena.close()


def run_ucx(s: Section, sizes: list[int]) -> None:
    import importlib.util

    if importlib.util.find_spec("ucxx") is None:
        s.skip("UCX two-process", "ucxx is not installed (carry ucxx-cu13/libucxx-cu13 wheels)")
        return
    import msgpack

    from kvpool import procs
    from kvpool.transport.base import RegionInfo
    from kvpool.transport.tcp import TcpTransport
    from kvpool.transport.ucx import UcxTransport

    size = max(sizes)
    with tempfile.TemporaryDirectory(dir=s.scratch) as tmp:
        info_path = os.path.join(tmp, "node.msgpack")
        args = ["-m", "kvpool.bench.gpu_ucx_node", "--size", str(size)]
        args += ["--device", s.device, "--info", info_path]
        child = procs.spawn("gpu ucx node", args, timeout=max(10.0, min(90.0, s.time_left())))
        paths: dict[str, Any] = {}
        try:
            with open(info_path, "rb") as f:
                infos = msgpack.unpackb(f.read(), raw=False)
            host_info = RegionInfo.from_dict(infos["host"])
            dev_info = RegionInfo.from_dict(infos["device"]) if infos.get("device") else None
            token = infos.get("token")  # the node's (kvpool.bench.gpu_ucx_node)
            paths["tcp_from_host"] = TcpTransport(host_info, token=token, timeout=30)
            paths["ucx_from_host"] = UcxTransport(host_info, token=token, timeout=30)
            if dev_info is not None:
                paths["ucx_from_device"] = UcxTransport(dev_info, token=token, timeout=30)
            else:
                s.skip("UCX device-to-device", "needs CUDA on both ends")
            _ucx_rounds(s, paths, size)
        finally:
            for t in paths.values():
                t.close()
            child.stop(10.0)
    if "ucx_from_host_read_gbps" in s.figures and "tcp_from_host_read_gbps" in s.figures:
        s.figure(
            "ucx_host_vs_tcp",
            round(s.figures["ucx_from_host_read_gbps"] / s.figures["tcp_from_host_read_gbps"], 3),
        )
    if "ucx_from_device_read_gbps" in s.figures:
        s.figure(
            "ucx_device_vs_tcp",
            round(s.figures["ucx_from_device_read_gbps"] / s.figures["tcp_from_host_read_gbps"], 3),
        )


def _ucx_rounds(s: Section, paths: dict[str, Any], size: int) -> None:
    import torch

    from kvpool.bench.gpu_ucx_node import SEED

    expected = pattern(size, "cpu", SEED).to(s.device)  # what the node filled its regions with
    dst = torch.empty(size, dtype=torch.uint8, device=s.device)
    src = pattern(size, s.device, SEED + 1)
    for name, t in paths.items():
        s.check_time(name)
        t.read_into(0, dst)
        s.check(f"{name} read into {s.device} exact", same_bytes(dst, expected))
        t.write(0, src)
        t.read_into(0, dst)
        s.check(f"{name} write from {s.device} exact", same_bytes(dst, src))
        t.write(0, expected)  # the node's pattern again, for the next path's first read
    ops: dict[str, Callable[[], object]] = {}
    for n, t in paths.items():
        ops[f"{n}_read"] = partial(t.read_into, 0, dst)
        ops[f"{n}_write"] = partial(t.write, 0, src)
    timed = interleaved_medians(ops, device=s.device, rounds=9, section=s)
    for op in ops:
        s.figure(f"{op}_gbps", gbps(size, timed[op]))
    s.figure("ucx_size_mib", size // MiB)

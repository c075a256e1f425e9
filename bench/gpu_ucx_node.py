"""The node process of ``kvpool bench gpu``'s UCX section (``python -m kvpool.bench.gpu_ucx_node``).

Serves a shared-memory host arena over TCP and UCX (``expose_region``) and,
with ``--device cuda``, a CUDA region over UCX (``UcxDataServer``), both
filled with ``pattern(size, "cpu", SEED)``. Writes both ``RegionInfo``s
(msgpack: worker addresses are bytes) and the token its servers want to
``--info``, prints its ready line, and serves until SIGTERM/SIGINT
(``kvpool.procs`` stops it so). The token is ``$KVPOOL_TOKEN`` or a fresh
one: a UCXX that cannot bind its listener to an address (0.52) listens on
every interface, which kvpool serves only with a token.
"""

from __future__ import annotations

import argparse
import os
import secrets
import signal
import sys

SEED = 4242


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvpool.bench.gpu_ucx_node")
    p.add_argument("--size", type=int, required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--info", required=True, help="where to write the regions (msgpack)")
    args = p.parse_args(argv)

    import msgpack

    from kvpool.bench.gpu_common import pattern
    from kvpool.storage.arena import SharedArena
    from kvpool.transport.base import RegionInfo, host_identity
    from kvpool.transport.peers import expose_region
    from kvpool.transport.ucx_server import UcxDataServer

    fill = pattern(args.size, "cpu", SEED)
    # CUDA first: UCX looks for CUDA (cuda_copy, cuda_ipc) when its context is made.
    region = fill.to("cuda") if args.device == "cuda" else None
    arena = SharedArena(args.size)
    arena.view[:] = fill.numpy()
    token = os.environ.get("KVPOOL_TOKEN") or secrets.token_hex(16)
    host = expose_region(arena.view, node_id="gpu-ucx-host", shm_name="", ucx=True, token=token)
    infos = {"host": host.info.to_dict(), "device": None, "token": token}
    device_server = None
    if region is not None:
        device_server = UcxDataServer(region, host="127.0.0.1", token=token)
        info = RegionInfo(
            "gpu-ucx-device", args.size, host_id=host_identity(), ucx=device_server.info()
        )
        infos["device"] = info.to_dict()
    tmp = args.info + ".tmp"
    with open(tmp, "wb") as f:
        f.write(msgpack.packb(infos, use_bin_type=True))
    os.replace(tmp, args.info)
    print(f"kvpool gpu ucx node ready on 127.0.0.1:{host.info.tcp_port}", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        while True:
            signal.pause()
    finally:
        if device_server is not None:
            device_server.close()
        host.close()
        arena.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

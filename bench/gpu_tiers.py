"""Sections ``tier`` and ``pinned`` of ``kvpool bench gpu``: the pool's own tiers.

tier: put/get_into of 1-64 MiB CUDA tensors into the GPU tier against a
plain device-to-device ``copy_`` (the baseline), bytes checked; then a pool
with small GPU and DRAM tiers over an SSD tier, filled until blocks demote
GPU -> DRAM -> SSD, and read back (SSD hits promote to DRAM), every byte
checked.

pinned: host-to-device ``get_into`` and device-to-host ``put`` between the
DRAM arena and CUDA tensors, with the arena page-locked (``cudaHostRegister``)
and not, against torch's own pinned-memory copies (``pin_memory=True``) and
pageable copies; the target is >= 0.9x the pinned baseline. The arena's
page-lock status comes from ``stats()``, where it must be reported.

Dry run (no CUDA): the same calls with CPU torch tensors into the DRAM tier;
the GPU tier and the pinned baselines are skipped with the reason.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from functools import partial

from kvpool.bench.gpu_common import MiB, Section, gbps, interleaved_medians, pattern, same_bytes


def _pool(dram: int, gpu: int = 0, ssd_dir: str | None = None, ssd: int = 0, lock: bool = True):
    from kvpool.config import PoolConfig
    from kvpool.embedded.pool import Pool

    return Pool(
        PoolConfig(dram_bytes=dram, gpu_bytes=gpu, ssd_path=ssd_dir, ssd_bytes=ssd, page_lock=lock)
    )


def _key(i: int) -> bytes:
    return i.to_bytes(4, "little") * 4


def run_tier(s: Section, sizes: list[int]) -> None:
    import torch

    if not s.cuda:
        s.skip("GPU tier", "needs CUDA: gpu_bytes>0 raises TierUnavailableError here")
    gpu_bytes = (2 * max(sizes) + 8 * MiB) if s.cuda else 0
    pool = _pool(dram=2 * max(sizes) + 8 * MiB, gpu=gpu_bytes)
    tier = "gpu" if s.cuda else "dram"
    try:
        for size in sizes:
            s.check_time(f"put/get_into {size >> 20} MiB")
            src = pattern(size, s.device, seed=size)
            dst = torch.empty(size, dtype=torch.uint8, device=s.device)
            base = torch.empty_like(src)
            key = _key(size)
            pool.put(key, src)
            got = pool.get_into(key, dst)
            s.check(
                f"{tier} tier get_into {size >> 20} MiB exact bytes",
                got == size and same_bytes(dst, src),
            )
            ops: dict[str, Callable[[], object]] = {
                "put": partial(pool.put, key, src),
                "get_into": partial(pool.get_into, key, dst),
                "copy_": partial(base.copy_, src),
            }
            resets: dict[str, Callable[[], object]] = {"put": partial(pool.remove, key)}
            t = interleaved_medians(ops, device=s.device, rounds=15, section=s, resets=resets)
            mib = size >> 20
            s.figure(f"{mib}MiB_put_gbps", gbps(size, t["put"]))
            s.figure(f"{mib}MiB_get_into_gbps", gbps(size, t["get_into"]))
            s.figure(f"{mib}MiB_copy_baseline_gbps", gbps(size, t["copy_"]))
            s.figure(f"{mib}MiB_get_into_ratio", round(t["copy_"] / t["get_into"], 3))
            s.check(
                f"{tier} tier holds the {mib} MiB block", pool.stats()["tiers"][tier]["blocks"] >= 1
            )
            pool.remove(key)
    finally:
        held = torch.cuda.memory_allocated() if s.cuda else 0
        pool.close()
    if s.cuda:  # the tier's buffer goes at close, not when the pool object is collected
        freed = held - torch.cuda.memory_allocated()
        s.check("closing the pool frees the GPU tier's memory", freed >= gpu_bytes, f"{freed} B")
    _demotion(s)


def _demotion(s: Section) -> None:
    """Blocks put from the device demote GPU -> DRAM -> SSD and come back exact."""
    import torch

    try:
        import lmdb  # noqa: F401  (the SSD tier's index)
    except ImportError:
        s.skip("demotion to SSD", "lmdb is not installed (carry its wheel)")
        return
    s.check_time("demotion")
    block, n = 1 * MiB, 12
    with tempfile.TemporaryDirectory(dir=s.scratch) as ssd_dir:
        pool = _pool(
            dram=4 * block, gpu=(4 * block if s.cuda else 0), ssd_dir=ssd_dir, ssd=32 * block
        )
        try:
            srcs = [pattern(block, s.device, seed=1000 + i) for i in range(n)]
            for i, src in enumerate(srcs):
                pool.put(_key(1000 + i), src)
            st = pool.stats()
            tiers = st["tiers"]
            s.figure("demotion_blocks_per_tier", {k: v["blocks"] for k, v in tiers.items()})
            if s.cuda:
                s.check("GPU tier demoted to DRAM", tiers["gpu"]["demotions"] > 0, tiers["gpu"])
            s.check("DRAM tier demoted to SSD", tiers["dram"]["demotions"] > 0, tiers["dram"])
            out = torch.empty(block, dtype=torch.uint8, device=s.device)
            bad = [
                i
                for i, src in enumerate(srcs)
                if pool.get_into(_key(1000 + i), out) != block or not same_bytes(out, src)
            ]
            s.check(
                f"all {n} demoted blocks read back exact into {s.device}", not bad, f"bad: {bad}"
            )
            s.check(
                "SSD hits promoted to DRAM",
                pool.stats()["promotions"] > 0,
                pool.stats()["promotions"],
            )
        finally:
            pool.close()


def run_pinned(s: Section, sizes: list[int]) -> None:
    import numpy as np
    import torch

    locked = _pool(dram=max(sizes) + 8 * MiB, lock=True)
    pageable = _pool(dram=max(sizes) + 8 * MiB, lock=False)
    try:
        status = locked.stats()["tiers"]["dram"].get("page_lock")
        s.figure("page_lock_status", status)
        s.figure("page_lock_status_off", pageable.stats()["tiers"]["dram"].get("page_lock"))
        if s.cuda:
            s.check("arena registered with CUDA (stats)", status == "registered", status)
        else:
            s.check(
                "page-lock outcome reported in stats",
                isinstance(status, str) and status != "",
                status,
            )
            s.skip("pinned baselines", "torch pin_memory needs CUDA; CPU tensors only")
        for size in sizes:
            s.check_time(f"pinned {size >> 20} MiB")
            mib = size >> 20
            dev = pattern(size, s.device, seed=7 + size)
            out = torch.empty(size, dtype=torch.uint8, device=s.device)
            ops = {}
            resets = {}
            for name, pool in (("locked", locked), ("pageable", pageable)):
                key = _key(size)
                pool.put(key, dev)
                ok = pool.get_into(key, out) == size and same_bytes(out, dev)
                s.check(f"{name} arena {mib} MiB round trip exact", ok)
                ops[f"h2d_{name}"] = partial(pool.get_into, key, out)
                ops[f"d2h_{name}"] = partial(pool.put, key, dev)
                resets[f"d2h_{name}"] = partial(pool.remove, key)
            host = {"pageable": torch.from_numpy(np.zeros(size, np.uint8))}
            if s.cuda:
                host["pinned"] = torch.empty(size, dtype=torch.uint8, pin_memory=True)
            for kind, h in host.items():
                ops[f"h2d_torch_{kind}"] = partial(out.copy_, h)
                ops[f"d2h_torch_{kind}"] = partial(h.copy_, dev)
            t = interleaved_medians(ops, device=s.device, rounds=15, section=s, resets=resets)
            for name in ops:
                s.figure(f"{mib}MiB_{name}_gbps", gbps(size, t[name]))
            base = "pinned" if s.cuda else "pageable"
            for way in ("h2d", "d2h"):
                ratio = round(t[f"{way}_torch_{base}"] / t[f"{way}_locked"], 3)
                s.figure(f"{mib}MiB_{way}_locked_vs_torch_{base}", ratio)
                if s.cuda:
                    s.check(f"{mib} MiB {way} >= 0.9x torch pinned", ratio >= 0.9, ratio)
            for pool in (locked, pageable):
                pool.remove(_key(size))
    finally:
        locked.close()
        pageable.close()

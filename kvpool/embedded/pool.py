"""The embedded tiered pool: catalog, tiers and eviction in one process.

Blocks live in exactly one tier at a time (GPU, DRAM or SSD). New puts land in
the GPU tier when the data is on a GPU and that tier exists, else in DRAM.
Eviction demotes a block one tier down (GPU -> DRAM -> SSD -> gone); a hit on
SSD promotes the block back to DRAM.

Invariants:
- Writes are two-phase: allocate (under the lock) -> copy (outside it) ->
  commit (under the lock). Until commit the key is invisible to every reader
  and to ``exists``/``prefix_match``; a failed copy frees its allocation.
- Committed blocks are immutable; putting an existing key is a no-op.
- A reader pins the block for the length of its copy. Pinned blocks are never
  evicted, moved or freed; ``remove`` of a pinned block hides it at once and
  frees its bytes when the last reader unpins.
- Bad input raises before any state changes.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvpool.api import Buffer
from kvpool.args import (
    block_range,
    check_batch,
    check_key,
    check_keys,
    check_out_fits,
    check_parent,
    check_read_range,
    check_reserve_size,
    data_region,
    out_region,
)
from kvpool.bindings.buffers import Region, copy_region, region_is_device, region_nbytes
from kvpool.config import PoolConfig
from kvpool.embedded.blocks import BlockTable, Entry, open_tiers
from kvpool.embedded.handles import EmbeddedBlockWriter, EmbeddedLease
from kvpool.embedded.stats import PoolStats
from kvpool.errors import KVPoolError, PoolClosedError
from kvpool.eviction import make_policy
from kvpool.layerwise.api import LayerwiseMethods
from kvpool.storage.ssd_tier import SsdRecord, SsdTier

EMBEDDED_NODE = "embedded"


class Pool(LayerwiseMethods):
    """A KV block store implementing ``kvpool.api.KVStore``; thread-safe."""

    @classmethod
    def embedded(
        cls,
        dram_bytes: int | None = None,
        ssd_path: str | None = None,
        ssd_bytes: int = 0,
        gpu_bytes: int = 0,
        policy: str = "lru",
    ) -> Pool:
        """A pool living entirely in this process: no servers to start."""
        config = PoolConfig(
            dram_bytes=PoolConfig.dram_bytes if dram_bytes is None else dram_bytes,
            ssd_path=ssd_path,
            ssd_bytes=ssd_bytes,
            gpu_bytes=gpu_bytes,
            policy=policy,
        )
        return cls(config)

    def __init__(self, config: PoolConfig) -> None:
        make_policy(config.policy)  # fail early on an unknown name
        self.config = config
        self._lock = threading.Condition()
        self._writing: dict[bytes, EmbeddedBlockWriter] = {}  # reserved, not yet committed
        self._active = 0  # operations copying outside the lock
        self._closed = False
        self._stats = PoolStats()
        self._tiers = open_tiers(config)
        self._blocks = BlockTable(self._tiers, self._stats)
        self._blocks.load_ssd_blocks()

    # -- public API -------------------------------------------------------

    def put(
        self, key: bytes, data: Buffer, *, parent: bytes | None = None, replicas: int = 1
    ) -> bool:
        """Store ``data`` under ``key``; False if the key is already stored (or not admitted).

        ``replicas`` exists for parity with the distributed pool: an embedded
        pool is one node, so it always keeps one copy.
        """
        check_key(key)
        check_parent(parent)
        src = data_region(data)
        return self._put_region(key, src, parent)

    def put_batch(
        self,
        keys: Sequence[bytes],
        datas: Sequence[Buffer],
        parents: Sequence[bytes | None] | None = None,
        *,
        replicas: int = 1,
    ) -> list[bool]:
        """``put`` for each item; every key and buffer is checked before any is stored."""
        filled = check_batch(keys, datas, parents)
        regions = [data_region(d) for d in datas]
        return [self._put_region(k, r, p) for k, r, p in zip(keys, regions, filled, strict=True)]

    def reserve(
        self, key: bytes, size: int, *, parent: bytes | None = None, device: bool = False
    ) -> EmbeddedBlockWriter | None:
        """Reserve ``size`` bytes for ``key`` to be filled piecewise; None if already stored.

        ``device=True`` places the block in the GPU tier when there is one.
        """
        check_key(key)
        check_parent(parent)
        check_reserve_size(size)
        return self._reserve(key, size, parent, device)

    def lease(self, keys: Sequence[bytes], *, prefix: bool = True) -> EmbeddedLease:
        """Pin the longest stored prefix of ``keys`` (every stored key with
        ``prefix=False``) until the lease is released.

        Leased blocks cannot be evicted, moved or freed, so a reader can take
        them piecewise (layer by layer) and never see one vanish half-way.
        Blocks found on SSD are promoted to DRAM first, so the pieces are
        memory copies. ``len(lease)`` is the number of blocks leased.
        """
        check_keys(keys)
        leased: list[bytes] = []
        entries: list[Entry] = []
        for key in keys:
            entry = self._pin_for_lease(key)
            if entry is None:
                if prefix:
                    break
                continue
            leased.append(key)
            entries.append(entry)
        return EmbeddedLease(leased, entries, self._release)

    def locate(self, keys: Sequence[bytes]) -> list[list[str]]:
        """Nodes holding each key: ``["embedded"]`` or ``[]`` (parity with the cluster)."""
        return [[EMBEDDED_NODE] if ok else [] for ok in self.exists(keys)]

    def replicate(self, keys: Sequence[bytes], node: str | None = None) -> int:
        """Extra replicas added: always 0, an embedded pool is a single node."""
        check_keys(keys)
        return 0

    def get(self, key: bytes) -> bytes | None:
        """A copy of the block's bytes, or None on a miss."""
        check_key(key)
        size = self._size_or_miss(key)
        if size is None:
            return None
        out = np.empty(size, dtype=np.uint8)
        got = self._get_into_region(key, out)
        return None if got is None else out[:got].tobytes()

    def get_into(
        self, key: bytes, out: Buffer, *, offset: int = 0, length: int | None = None
    ) -> int | None:
        """Copy the block (or its bytes [offset, offset+length)) into the start of ``out``.

        Returns the number of bytes copied, or None on a miss. ``out`` must be
        at least that large. Byte ranges let a reader take one layer of a
        block (see ``KVLayout``) without touching the rest.
        """
        check_key(key)
        dst = out_region(out)
        check_read_range(offset, length)
        return self._get_into_region(key, dst, offset, length)

    def get_into_batch(self, keys: Sequence[bytes], outs: Sequence[Buffer]) -> list[int | None]:
        """``get_into`` for each pair; all keys and buffers are checked first."""
        check_batch(keys, outs, what="outs")
        regions = [out_region(o) for o in outs]
        return [self._get_into_region(k, r) for k, r in zip(keys, regions, strict=True)]

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        """For each key, whether a committed block is stored under it."""
        check_keys(keys)
        with self._lock:
            self._check_open()
            return [key in self._blocks.entries for key in keys]

    def prefix_match(self, keys: Sequence[bytes]) -> int:
        """Number of leading ``keys`` that are stored (the reusable prefix, in blocks)."""
        check_keys(keys)
        with self._lock:
            self._check_open()
            entries = self._blocks.entries
            for i, key in enumerate(keys):
                if key not in entries:
                    return i
            return len(keys)

    def remove(self, key: bytes) -> bool:
        """Forget the block; False if it was not stored."""
        check_key(key)
        with self._lock:
            self._check_open()
            if not self._blocks.remove(key):
                return False
            self._stats.removes += 1
            return True

    def stats(self) -> dict[str, Any]:
        """Counters and per-tier capacity/usage, as plain data."""
        with self._lock:
            return self._stats.snapshot(
                self._tiers.chain, len(self._blocks.entries), self.config.policy
            )

    def close(self) -> None:
        """Wait for in-flight copies, then release every tier. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._lock.wait_for(lambda: self._active == 0)
        self._tiers.close()

    def __enter__(self) -> Pool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __len__(self) -> int:
        with self._lock:
            return len(self._blocks.entries)

    # -- put path ---------------------------------------------------------

    def _put_region(self, key: bytes, src: Region, parent: bytes | None) -> bool:
        """put's fast path: reserve (already counted as copying), copy, commit: two
        trips through the lock, since the writer never escapes."""
        writer = self._reserve(key, region_nbytes(src), parent, region_is_device(src), True)
        if writer is None:
            return False
        copied = False
        try:
            copy_region(writer.tier.region(writer.offset, writer.size), src)
            copied = True
        finally:
            self._finish(writer, commit=copied, copying=True)
        return True

    def _reserve(
        self, key: bytes, size: int, parent: bytes | None, device: bool, copying: bool = False
    ) -> EmbeddedBlockWriter | None:
        with self._lock:
            self._check_open()
            tier = self._tiers.gpu if device and self._tiers.gpu is not None else self._tiers.dram
            if key in self._blocks.entries or key in self._writing:
                return None
            if not tier.policy.admit(key):
                self._stats.not_admitted += 1
                return None
            offset = self._blocks.make_room(tier, size)
            writer = EmbeddedBlockWriter(
                key,
                tier,
                offset,
                size,
                parent,
                write_range=self._write_reserved,
                finish=self._finish,
            )
            self._writing[key] = writer
            if copying:
                writer.copies += 1
                self._active += 1
            return writer

    def _write_reserved(self, writer: EmbeddedBlockWriter, offset: int, src: Region) -> None:
        with self._lock:
            self._check_open()
            if writer.done:
                raise KVPoolError("this block writer is already committed or aborted")
            writer.copies += 1
            self._active += 1
        try:
            copy_region(writer.tier.region(writer.offset + offset, region_nbytes(src)), src)
        finally:
            with self._lock:
                writer.copies -= 1
                self._active -= 1
                self._lock.notify_all()

    def _finish(self, writer: EmbeddedBlockWriter, commit: bool, copying: bool = False) -> None:
        """Make a reserved block visible (commit) or give its space back (abort).

        ``copying``: the caller's own copy (counted by ``_reserve``) just ended.
        """
        with self._lock:
            if copying:
                writer.copies -= 1
                self._active -= 1
                self._lock.notify_all()
            self._lock.wait_for(lambda: writer.copies == 0)
            if writer.done:
                if commit:
                    raise KVPoolError("this block writer is already committed or aborted")
                return
            writer.done = True
            del self._writing[writer.key]
            if not commit:
                writer.tier.free(writer.offset)
                return
            if self._closed:
                raise PoolClosedError("the pool was closed before this block was committed")
            self._blocks.insert(writer.key, writer.tier, writer.offset, writer.size, writer.parent)

    # -- read path --------------------------------------------------------

    def _pin_for_lease(self, key: bytes) -> Entry | None:
        with self._lock:
            self._check_open()
            entry = self._blocks.entries.get(key)
            if entry is None:
                return None
            entry.pins += 1
            entry.tier.policy.on_access(key)
            if not isinstance(entry.tier, SsdTier):
                return entry
            ssd, record = entry.tier, entry.record
            self._active += 1
        assert record is not None
        valid = False
        try:
            valid = self._read_from_ssd(key, entry, ssd, record, None, 0, record.size)
        finally:
            with self._lock:
                self._active -= 1
                if not valid:
                    self._blocks.unpin(entry)
                self._lock.notify_all()
        return entry if valid else None

    def _release(self, entries: Sequence[Entry]) -> None:
        with self._lock:
            for entry in entries:
                self._blocks.unpin(entry)

    def _size_or_miss(self, key: bytes) -> int | None:
        """The block's size, or None (counted as a miss) if it is not stored."""
        with self._lock:
            entry = self._entry_or_miss(key)
            return None if entry is None else entry.size

    def _entry_or_miss(self, key: bytes) -> Entry | None:
        """The block's entry, or None counted as a miss (caller holds the lock)."""
        self._check_open()
        entry = self._blocks.entries.get(key)
        if entry is None:
            self._stats.misses += 1
        return entry

    def _get_into_region(
        self, key: bytes, dst: Region, start: int = 0, length: int | None = None
    ) -> int | None:
        with self._lock:
            entry = self._entry_or_miss(key)
            if entry is None:
                return None
            want = block_range(start, length, entry.size)
            check_out_fits(dst, want)
            entry.pins += 1
            self._active += 1
            entry.tier.policy.on_access(key)
            tier, offset, record = entry.tier, entry.offset, entry.record
            self._stats.count_hit(tier.name, want)
        try:
            if isinstance(tier, SsdTier):
                assert record is not None
                valid = self._read_from_ssd(key, entry, tier, record, dst, start, want)
                return want if valid else None
            copy_region(dst, tier.region(offset + start, want))
            return want
        finally:
            with self._lock:
                self._blocks.unpin(entry)
                self._active -= 1
                self._lock.notify_all()

    def _read_from_ssd(
        self,
        key: bytes,
        entry: Entry,
        ssd: SsdTier,
        record: SsdRecord,
        dst: Region | None,
        start: int,
        length: int,
    ) -> bool:
        """Read bytes of a pinned SSD block into ``dst`` through a DRAM slot, promoting
        the whole block there; False (and the block dropped) if its checksum fails.

        With ``dst=None`` the block is only verified and promoted.
        """
        dram = self._tiers.dram
        with self._lock:
            slot_offset = self._blocks.dram_slot(record.size)
        if slot_offset is not None:
            staging = dram.region(slot_offset, dram.allocator.size_of(slot_offset))
        elif dst is None or region_is_device(dst) or length != record.size:
            staging = np.empty(record.size, np.uint8)
        else:
            staging = dst
        valid = ssd.read_into(record, staging)
        if valid and dst is not None and staging is not dst:
            copy_region(dst, staging[start : start + length])
        with self._lock:
            self._blocks.settle_ssd_read(key, entry, ssd, slot_offset, valid)
        return valid

    def _check_open(self) -> None:
        if self._closed:
            raise PoolClosedError("the pool is closed")

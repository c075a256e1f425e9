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
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvpool.args import check_key, check_keys, data_region
from kvpool.bindings.buffers import Region, as_region, copy_region, region_is_device, region_nbytes
from kvpool.config import PoolConfig
from kvpool.embedded.handles import BlockWriter, Lease
from kvpool.embedded.stats import PoolStats
from kvpool.errors import (
    BlockTooLargeError,
    BufferSpecError,
    KVPoolError,
    PoolClosedError,
    PoolFullError,
    StorageError,
)
from kvpool.eviction import make_policy
from kvpool.layerwise.api import LayerwiseMethods
from kvpool.storage.memory_tier import DramTier, GpuTier, MemoryTier
from kvpool.storage.ssd_tier import SsdRecord, SsdTier

Tier = MemoryTier | SsdTier
EMBEDDED_NODE = "embedded"


@dataclass(eq=False)
class _Entry:
    """Where one committed block lives now."""

    tier: Tier
    offset: int
    size: int
    parent: bytes | None
    record: SsdRecord | None = None  # set while the block is on SSD
    pins: int = 0
    dead: bool = False  # removed while pinned: free on last unpin


@dataclass
class _Tiers:
    gpu: GpuTier | None
    dram: DramTier
    ssd: SsdTier | None
    chain: list[Tier] = field(default_factory=list)  # top to bottom

    def __post_init__(self) -> None:
        self.chain = [t for t in (self.gpu, self.dram, self.ssd) if t is not None]

    def below(self, tier: Tier) -> Tier | None:
        i = self.chain.index(tier)
        return self.chain[i + 1] if i + 1 < len(self.chain) else None


class Pool(LayerwiseMethods):
    """A KV block store with put/get/get_into/exists/prefix_match/remove; thread-safe."""

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
        self._entries: dict[bytes, _Entry] = {}
        self._writing: dict[bytes, BlockWriter] = {}  # reserved, not yet committed
        self._active = 0  # operations copying outside the lock
        self._closed = False
        self._stats = PoolStats()
        self._tiers = self._open_tiers(config)
        self._load_ssd_blocks()

    # -- public API -------------------------------------------------------

    def put(self, key: bytes, data: Any, *, parent: bytes | None = None, replicas: int = 1) -> bool:
        """Store ``data`` under ``key``; False if the key is already stored (or not admitted).

        ``replicas`` exists for parity with the distributed pool: an embedded
        pool is one node, so it always keeps one copy.
        """
        check_key(key)
        if parent is not None:
            check_key(parent, what="parent")
        src = data_region(data)
        return self._put_region(key, src, parent)

    def put_batch(
        self,
        keys: Sequence[bytes],
        datas: Sequence[Any],
        parents: Sequence[bytes | None] | None = None,
        *,
        replicas: int = 1,
    ) -> list[bool]:
        """``put`` for each item; every key and buffer is checked before any is stored."""
        parents = list(parents) if parents is not None else [None] * len(keys)
        if not len(keys) == len(datas) == len(parents):
            raise ValueError("keys, datas and parents must have the same length")
        check_keys(keys, parents)
        regions = [data_region(d) for d in datas]
        return [self._put_region(k, r, p) for k, r, p in zip(keys, regions, parents, strict=True)]

    def reserve(
        self, key: bytes, size: int, *, parent: bytes | None = None, device: bool = False
    ) -> BlockWriter | None:
        """Reserve ``size`` bytes for ``key`` to be filled piecewise; None if already stored.

        ``device=True`` places the block in the GPU tier when there is one.
        """
        check_key(key)
        if parent is not None:
            check_key(parent, what="parent")
        if not isinstance(size, int) or size <= 0:
            raise BufferSpecError(f"size must be a positive int, got {size!r}")
        return self._reserve(key, size, parent, device)

    def lease(self, keys: Sequence[bytes]) -> Lease:
        """Pin the longest stored prefix of ``keys`` until the lease is released.

        Leased blocks cannot be evicted, moved or freed, so a reader can take
        them piecewise (layer by layer) and never see one vanish half-way.
        Blocks found on SSD are promoted to DRAM first, so the pieces are
        memory copies. ``len(lease)`` is the number of blocks leased.
        """
        check_keys(keys)
        pinned: list[tuple[bytes, _Entry]] = []
        for key in keys:
            entry = self._pin_for_lease(key)
            if entry is None:
                break
            pinned.append((key, entry))
        return Lease(self, pinned)

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
        self, key: bytes, out: Any, *, offset: int = 0, length: int | None = None
    ) -> int | None:
        """Copy the block (or its bytes [offset, offset+length)) into the start of ``out``.

        Returns the number of bytes copied, or None on a miss. ``out`` must be
        at least that large. Byte ranges let a reader take one layer of a
        block (see ``KVLayout``) without touching the rest.
        """
        check_key(key)
        if offset < 0 or (length is not None and length <= 0):
            raise BufferSpecError(f"bad range: offset={offset}, length={length}")
        return self._get_into_region(key, as_region(out, writable=True, what="out"), offset, length)

    def get_into_batch(self, keys: Sequence[bytes], outs: Sequence[Any]) -> list[int | None]:
        """``get_into`` for each pair; all keys and buffers are checked first."""
        if len(keys) != len(outs):
            raise ValueError("keys and outs must have the same length")
        check_keys(keys)
        regions = [as_region(o, writable=True, what="out") for o in outs]
        return [self._get_into_region(k, r) for k, r in zip(keys, regions, strict=True)]

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        """For each key, whether a committed block is stored under it."""
        check_keys(keys)
        with self._lock:
            self._check_open()
            return [key in self._entries for key in keys]

    def prefix_match(self, keys: Sequence[bytes]) -> int:
        """Number of leading ``keys`` that are stored (the reusable prefix, in blocks)."""
        check_keys(keys)
        with self._lock:
            self._check_open()
            entries = self._entries
            for i, key in enumerate(keys):
                if key not in entries:
                    return i
            return len(keys)

    def remove(self, key: bytes) -> bool:
        """Forget the block; False if it was not stored."""
        check_key(key)
        with self._lock:
            self._check_open()
            entry = self._entries.pop(key, None)
            if entry is None:
                return False
            entry.tier.policy.on_remove(key)
            self._drop(key, entry)
            self._stats.removes += 1
            return True

    def stats(self) -> dict[str, Any]:
        """Counters and per-tier capacity/usage, as plain data."""
        with self._lock:
            return self._stats.snapshot(self._tiers.chain, len(self._entries), self.config.policy)

    def close(self) -> None:
        """Wait for in-flight copies, then release every tier. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._lock.wait_for(lambda: self._active == 0)
        for tier in self._tiers.chain:
            tier.close()

    def __enter__(self) -> Pool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

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
    ) -> BlockWriter | None:
        with self._lock:
            self._check_open()
            tier = self._tiers.gpu if device and self._tiers.gpu is not None else self._tiers.dram
            if key in self._entries or key in self._writing:
                return None
            if not tier.policy.admit(key):
                self._stats.not_admitted += 1
                return None
            offset = self._make_room(tier, size)
            writer = BlockWriter(self, key, tier, offset, size, parent)
            self._writing[key] = writer
            if copying:
                writer.copies += 1
                self._active += 1
            return writer

    def _write_reserved(self, writer: BlockWriter, offset: int, src: Region) -> None:
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

    def _finish(self, writer: BlockWriter, commit: bool, copying: bool = False) -> None:
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
            self._entries[writer.key] = _Entry(
                writer.tier, writer.offset, writer.size, writer.parent
            )
            writer.tier.policy.on_insert(writer.key, writer.parent)
            self._stats.count_put(writer.tier.name, writer.size)

    def _make_room(self, tier: Tier, size: int) -> int:
        """Allocate ``size`` bytes in ``tier``, evicting unpinned blocks as needed."""
        if not tier.fits(size):
            raise BlockTooLargeError(
                f"block of {size} bytes is larger than the {tier.name} tier ({tier.capacity} bytes)"
            )
        while True:
            offset = tier.allocator.allocate(size)
            if offset is not None:
                return offset
            victim = tier.policy.victim(self._evictable)
            if victim is None:
                raise PoolFullError(
                    f"{tier.name} tier has no room for {size} bytes: every block is pinned by a "
                    "reader or too fragmented; retry later or enlarge the tier"
                )
            self._demote(victim)

    def _evictable(self, key: bytes) -> bool:
        return self._entries[key].pins == 0

    def _demote(self, key: bytes) -> None:
        """Move an unpinned block (already untracked by its tier's policy) one tier down.

        With no lower tier, or no room there, the block is dropped.
        """
        entry = self._entries[key]
        source, old_offset = entry.tier, entry.offset
        self._stats.count_eviction(source.name)
        target = self._tiers.below(source)
        if target is not None and target.fits(entry.size) and self._copy_down(key, entry, target):
            source.free(old_offset)
            self._stats.count_demotion(source.name)
        else:
            del self._entries[key]
            self._drop(key, entry)

    def _copy_down(self, key: bytes, entry: _Entry, target: Tier) -> bool:
        """Copy the block into ``target`` and point the entry there; False if impossible."""
        source = entry.tier
        assert isinstance(source, MemoryTier)
        if isinstance(target, SsdTier):
            slot = source.region(entry.offset, source.allocator.size_of(entry.offset))
            record = self._store_on_ssd(target, key, slot, entry.size, entry.parent)
            if record is None:
                return False
            entry.record, offset = record, record.offset
        else:
            try:
                offset = self._make_room(target, entry.size)
            except PoolFullError:
                return False
            copy_region(target.region(offset, entry.size), source.region(entry.offset, entry.size))
        entry.tier, entry.offset = target, offset
        target.policy.on_insert(key, entry.parent)
        return True

    def _store_on_ssd(
        self, ssd: SsdTier, key: bytes, slot: Region, size: int, parent: bytes | None
    ) -> SsdRecord | None:
        while True:
            try:
                record = ssd.store(key, slot, size, parent)
            except StorageError:
                self._stats.ssd_errors += 1
                return None
            if record is not None:
                return record
            victim = ssd.policy.victim(self._evictable)
            if victim is None:
                return None
            self._demote(victim)

    def _drop(self, key: bytes, entry: _Entry) -> None:
        """Forget a block already taken out of the catalog; free now or on last unpin."""
        if isinstance(entry.tier, SsdTier):
            entry.tier.delete(key)
        if entry.pins:
            entry.dead = True
        else:
            entry.tier.free(entry.offset)

    # -- read path --------------------------------------------------------

    def _pin_for_lease(self, key: bytes) -> _Entry | None:
        with self._lock:
            self._check_open()
            entry = self._entries.get(key)
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
                    self._unpin(entry)
                self._lock.notify_all()
        return entry if valid else None

    def _release(self, entries: Sequence[_Entry]) -> None:
        with self._lock:
            for entry in entries:
                self._unpin(entry)

    def _size_or_miss(self, key: bytes) -> int | None:
        """The block's size, or None (counted as a miss) if it is not stored."""
        with self._lock:
            entry = self._entry_or_miss(key)
            return None if entry is None else entry.size

    def _entry_or_miss(self, key: bytes) -> _Entry | None:
        """The block's entry, or None counted as a miss (caller holds the lock)."""
        self._check_open()
        entry = self._entries.get(key)
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
            want = entry.size - start if length is None else length
            if start + want > entry.size or want <= 0:
                raise BufferSpecError(
                    f"range [{start}, {start + want}) is outside the block of {entry.size} bytes"
                )
            if region_nbytes(dst) < want:
                raise BufferSpecError(f"out has {region_nbytes(dst)} bytes but {want} are asked")
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
                self._unpin(entry)
                self._active -= 1
                self._lock.notify_all()

    def _read_from_ssd(
        self,
        key: bytes,
        entry: _Entry,
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
            try:
                slot_offset: int | None = self._make_room(dram, record.size)
            except PoolFullError:
                slot_offset = None
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
            current = self._entries.get(key) is entry
            if not valid:
                self._stats.corrupt_dropped += 1
                if current:
                    del self._entries[key]
                    ssd.policy.on_remove(key)
                    self._drop(key, entry)
            if slot_offset is not None:
                if valid and current and entry.pins == 1:
                    self._promote(key, entry, ssd, slot_offset)
                else:
                    dram.free(slot_offset)
        return valid

    def _promote(self, key: bytes, entry: _Entry, ssd: SsdTier, dram_offset: int) -> None:
        """Point an SSD block (pinned only by the caller) at its fresh DRAM copy."""
        ssd.delete(key)
        ssd.policy.on_remove(key)
        ssd.free(entry.offset)
        entry.tier, entry.offset, entry.record = self._tiers.dram, dram_offset, None
        self._tiers.dram.policy.on_insert(key, entry.parent)
        self._stats.promotions += 1

    def _unpin(self, entry: _Entry) -> None:
        entry.pins -= 1
        if entry.pins == 0 and entry.dead:
            entry.tier.free(entry.offset)

    # -- set-up -----------------------------------------------------------

    def _open_tiers(self, config: PoolConfig) -> _Tiers:
        opened: list[Tier] = []
        try:
            gpu = None
            if config.gpu_bytes:
                gpu = GpuTier(config.gpu_bytes, make_policy(config.policy), config.alignment)
                opened.append(gpu)
            dram = DramTier(config.dram_bytes, make_policy(config.policy), config.alignment)
            opened.append(dram)
            ssd = None
            if config.ssd_path is not None:
                ssd = SsdTier(config.ssd_path, config.ssd_bytes, make_policy(config.policy))
            return _Tiers(gpu, dram, ssd)
        except BaseException:
            for tier in opened:
                tier.close()
            raise

    def _load_ssd_blocks(self) -> None:
        ssd = self._tiers.ssd
        if ssd is None:
            return
        for key, record in ssd.load_records():
            self._entries[key] = _Entry(ssd, record.offset, record.size, record.parent, record)
            ssd.policy.on_insert(key, record.parent)

    def _check_open(self) -> None:
        if self._closed:
            raise PoolClosedError("the pool is closed")

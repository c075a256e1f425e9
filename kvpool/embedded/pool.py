"""The embedded tiered pool: catalog, tiers and eviction in one process.

Blocks live in exactly one tier at a time (GPU, DRAM or SSD). New puts land in
the GPU tier when the data is on a GPU and that tier exists, else in DRAM.
Eviction demotes a block one tier down (GPU -> DRAM -> SSD -> gone); a hit on
SSD promotes the block back to DRAM.

The parts: ``blocks`` (the table of committed blocks, the tiers, the lock),
``reservations`` (the two-phase write path), ``handles`` (writer, lease),
``ssd_reads`` (an SSD hit read through DRAM); this module is the public API
and the read path.

Invariants:
- Writes are two-phase (kvpool.embedded.reservations): until commit a key is
  invisible to every reader and to ``exists``/``prefix_match``.
- Committed blocks are immutable; putting an existing key is a no-op.
- A reader pins the block for the length of its copy. Pinned blocks are never
  evicted, moved or freed; ``remove`` of a pinned block hides it at once and
  frees its bytes when the last reader unpins.
- Bad input raises before any state changes.
"""

from __future__ import annotations

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
    check_read_ranges,
    check_reserve_batch,
    check_reserve_size,
    data_region,
    out_region,
)
from kvpool.bindings.buffers import Region, copy_region_out, plain_host
from kvpool.config import PoolConfig
from kvpool.embedded.blocks import BlockTable, Entry, open_tiers
from kvpool.embedded.handles import EmbeddedBlockWriter, EmbeddedLease
from kvpool.embedded.reservations import Reservations
from kvpool.embedded.ssd_reads import read_ssd_block
from kvpool.embedded.stats import PoolStats
from kvpool.eviction import make_policy
from kvpool.index.keys import KEY_BYTES
from kvpool.layerwise.api import LayerwiseMethods
from kvpool.storage.ssd_tier import SsdTier

_NDARRAY = np.ndarray  # a global, not a module attribute load, on the hot paths
_U8 = np.dtype(np.uint8)  # a singleton: ``is`` compares it

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
        self._stats = PoolStats()
        self._tiers = open_tiers(config)
        self._blocks = BlockTable(self._tiers, self._stats)
        self._blocks.load_ssd_blocks()
        self._lock = self._blocks.mutex  # the blocks' lock (see BlockTable)
        self._reservations = Reservations(self._blocks)

    # -- public API -------------------------------------------------------

    def put(
        self, key: bytes, data: Buffer, *, parent: bytes | None = None, replicas: int = 1
    ) -> bool:
        """Store ``data`` under ``key``; False if the key is already stored (or not admitted).

        ``replicas`` exists for parity with the distributed pool: an embedded
        pool is one node, so it always keeps one copy.
        """
        if type(key) is not bytes or len(key) != KEY_BYTES:  # inline: ~0.2 us per put
            check_key(key)
        if parent is not None:
            check_parent(parent)
        if (  # bindings.buffers.plain_host(data), inlined: already a host region
            type(data) is _NDARRAY
            and data.dtype is _U8
            and data.ndim == 1
            and data.flags.c_contiguous
            and data.size
        ):
            return self._reservations.put(key, data, parent)
        return self._reservations.put(key, data_region(data), parent)

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
        put = self._reservations.put
        return [put(k, r, p) for k, r, p in zip(keys, regions, filled, strict=True)]

    def reserve(
        self, key: bytes, size: int, *, parent: bytes | None = None, device: bool = False
    ) -> EmbeddedBlockWriter | None:
        """Reserve ``size`` bytes for ``key`` to be filled piecewise; None if already stored.

        ``device=True`` places the block in the GPU tier when there is one.
        """
        check_key(key)
        check_parent(parent)
        check_reserve_size(size)
        return self._reservations.reserve(key, size, parent, device)

    def reserve_batch(
        self,
        keys: Sequence[bytes],
        sizes: Sequence[int],
        parents: Sequence[bytes | None] | None = None,
        *,
        device: bool = False,
    ) -> list[EmbeddedBlockWriter | None]:
        """``reserve`` for each item, every argument checked first; all or nothing."""
        filled = check_reserve_batch(keys, sizes, parents)
        return self._reservations.reserve_batch(keys, sizes, filled, device)

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
        if type(key) is not bytes or len(key) != KEY_BYTES:
            check_key(key)
        if type(offset) is not int or offset or length is not None:  # skip for whole blocks
            check_read_range(offset, length)
        if (  # bindings.buffers.plain_host(out, writable=True), inlined: a host region
            type(out) is _NDARRAY
            and out.dtype is _U8
            and out.ndim == 1
            and out.flags.c_contiguous
            and out.flags.writeable
            and out.size
        ):
            return self._get_into_region(key, out, offset, length)
        return self._get_into_region(key, out_region(out), offset, length)

    def get_into_batch(
        self,
        keys: Sequence[bytes],
        outs: Sequence[Buffer],
        *,
        offsets: Sequence[int] | None = None,
        lengths: Sequence[int | None] | None = None,
    ) -> list[int | None]:
        """``get_into`` for each pair (each its range, ``KVStore.get_into_batch``): keys,
        buffers and range arguments checked first, each range against its block as
        that read comes."""
        check_batch(keys, outs, what="outs")
        n = len(keys)
        starts, takes = check_read_ranges(n, offsets, lengths) or ([0] * n, [None] * n)
        regions = [o if plain_host(o, writable=True) and o.size else out_region(o) for o in outs]
        return [
            self._get_into_region(k, r, start, take)
            for k, r, start, take in zip(keys, regions, starts, takes, strict=True)
        ]

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        """For each key, whether a committed block is stored under it."""
        check_keys(keys)
        with self._lock:
            self._blocks.check_open()
            return [key in self._blocks.entries for key in keys]

    def prefix_match(self, keys: Sequence[bytes]) -> int:
        """Number of leading ``keys`` that are stored (the reusable prefix, in blocks)."""
        check_keys(keys)
        with self._lock:
            self._blocks.check_open()
            entries = self._blocks.entries
            for i, key in enumerate(keys):
                if key not in entries:
                    return i
            return len(keys)

    def remove(self, key: bytes) -> bool:
        """Forget the block; False if it was not stored."""
        check_key(key)
        with self._lock:
            self._blocks.check_open()
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
        self._blocks.close()

    def __enter__(self) -> Pool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __len__(self) -> int:
        with self._lock:
            return len(self._blocks.entries)

    # -- read path --------------------------------------------------------

    def _pin_for_lease(self, key: bytes) -> Entry | None:
        with self._lock:
            self._blocks.check_open()
            entry = self._blocks.entries.get(key)
            if entry is None:
                return None
            entry.pins += 1
            entry.tier.policy.on_access(key)
            if not isinstance(entry.tier, SsdTier):
                return entry
            ssd, record = entry.tier, entry.record
            self._blocks.active += 1
        assert record is not None
        valid = False
        try:
            valid = read_ssd_block(self._blocks, key, entry, ssd, record, None, 0, record.size)
        finally:
            with self._lock:
                if not valid:
                    self._blocks.unpin(entry)
                self._blocks.copy_ended()
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
        self._blocks.check_open()
        entry = self._blocks.entries.get(key)
        if entry is None:
            self._stats.misses += 1
        return entry

    def _get_into_region(
        self, key: bytes, dst: Region, start: int = 0, length: int | None = None
    ) -> int | None:
        blocks = self._blocks
        mutex = self._lock
        mutex.acquire()  # not ``with``: see Reservations.put
        try:
            if blocks.closed:  # _entry_or_miss, inlined
                blocks.check_open()  # raises
            entry = blocks.entries.get(key)
            if entry is None:
                self._stats.misses += 1
                return None
            if start or length is not None or type(dst) is not _NDARRAY:
                want = block_range(start, length, entry.size)
                check_out_fits(dst, want)
            else:  # the whole block into a host array (the hot case, inlined)
                want = entry.size
                if dst.nbytes < want:
                    check_out_fits(dst, want)  # raises its error
            entry.pins += 1
            blocks.active += 1
            tier, offset, record = entry.tier, entry.offset, entry.record
            tier.policy.on_access(key)
            stats = self._stats
            stats.hits += 1
            stats.bytes_read += want
            stats.tier_hits[tier.name] += 1
        finally:
            mutex.release()
        try:
            if isinstance(tier, SsdTier):
                assert record is not None
                valid = read_ssd_block(blocks, key, entry, tier, record, dst, start, want)
                return want if valid else None
            offset += start
            copy_region_out(dst, tier.buffer[offset : offset + want])  # tier.region, inlined
            return want
        finally:
            mutex.acquire()
            try:
                blocks.unpin(entry)
                blocks.active -= 1  # blocks.copy_ended(), inlined
                if blocks.waiting:
                    blocks.lock.notify_all()
            finally:
                mutex.release()

"""The embedded pool's committed blocks and the tier chain they move along.

``BlockTable`` is the pool's state: which tier and offset holds each
committed block, the tiers themselves (GPU -> DRAM -> SSD, top to bottom),
the counters, and the lock guarding all of it. It makes room by evicting,
demotes a victim one tier down and promotes an SSD block back to DRAM. Its
methods do not take ``lock`` themselves: callers hold it, which is what keeps
the table, the tiers' allocators and their eviction policies consistent with
each other across a whole operation.

Invariants:
- a committed block lives in exactly one tier (``Entry.tier``); its SSD
  ``record`` is set exactly while it lives on SSD;
- a pinned entry (``pins > 0``) is never chosen as a victim, moved or freed;
  removing it hides it at once and frees its bytes on the last unpin (``dead``);
- ``active`` counts copies running outside the lock; ``close`` waits for them,
  and once ``closed`` no operation starts (``check_open``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from kvpool.bindings.buffers import Region, copy_region
from kvpool.config import PoolConfig
from kvpool.embedded.stats import PoolStats
from kvpool.errors import BlockTooLargeError, PoolClosedError, PoolFullError, StorageError
from kvpool.eviction import make_policy
from kvpool.storage.memory_tier import DramTier, GpuTier, MemoryTier
from kvpool.storage.ssd_record import SsdRecord
from kvpool.storage.ssd_tier import SsdTier

Tier = MemoryTier | SsdTier


@dataclass(eq=False, slots=True)
class Entry:
    """Where one committed block lives now (slots: one is built per put, and its
    fields are read and written on every get)."""

    tier: Tier
    offset: int
    size: int
    parent: bytes | None
    record: SsdRecord | None = None  # set while the block is on SSD
    pins: int = 0
    dead: bool = False  # removed while pinned: free on last unpin


@dataclass
class Tiers:
    gpu: GpuTier | None
    dram: DramTier
    ssd: SsdTier | None
    chain: list[Tier] = field(default_factory=list)  # top to bottom

    def __post_init__(self) -> None:
        self.chain = [t for t in (self.gpu, self.dram, self.ssd) if t is not None]

    def below(self, tier: Tier) -> Tier | None:
        i = self.chain.index(tier)
        return self.chain[i + 1] if i + 1 < len(self.chain) else None

    def close(self) -> None:
        for tier in self.chain:
            tier.close()


def open_tiers(config: PoolConfig) -> Tiers:
    """Open the tiers ``config`` asks for; on failure close the ones already open."""
    opened: list[Tier] = []
    try:
        gpu = None
        if config.gpu_bytes:
            gpu = GpuTier(config.gpu_bytes, make_policy(config.policy), config.alignment)
            opened.append(gpu)
        dram = DramTier(
            config.dram_bytes,
            make_policy(config.policy),
            config.alignment,
            page_lock=config.page_lock,
        )
        opened.append(dram)
        ssd = None
        if config.ssd_path is not None:
            ssd = SsdTier(config.ssd_path, config.ssd_bytes, make_policy(config.policy))
        return Tiers(gpu, dram, ssd)
    except BaseException:
        for tier in opened:
            tier.close()
        raise


class BlockTable:
    """Committed blocks, their tiers and the pool's counters (callers hold ``lock``).

    ``mutex`` is ``lock``'s own RLock: hot paths take it directly (a C-level
    enter/exit instead of Condition's Python wrappers); only waiters need the
    Condition, and ``copy_ended`` notifies only when one is waiting.
    """

    def __init__(self, tiers: Tiers, stats: PoolStats) -> None:
        self.mutex = threading.RLock()
        self.lock = threading.Condition(self.mutex)
        self.waiting = 0  # threads inside wait_until (under the lock)
        self.tiers = tiers
        self.stats = stats
        self.entries: dict[bytes, Entry] = {}
        self.active = 0  # copies running outside the lock
        self.closed = False

    def check_open(self) -> None:
        if self.closed:
            raise PoolClosedError("the pool is closed")

    def copy_ended(self) -> None:
        """A copy counted in ``active`` finished (wakes ``close`` and waiting writers)."""
        self.active -= 1
        if self.waiting:
            self.lock.notify_all()

    def wait_until(self, done: Callable[[], bool]) -> None:
        """Wait (caller holds the lock) until ``done()``, re-checked after every copy."""
        if done():
            return
        self.waiting += 1
        try:
            self.lock.wait_for(done)
        finally:
            self.waiting -= 1

    def close(self) -> None:
        """Refuse new operations, wait for running copies, close the tiers. Idempotent."""
        with self.mutex:
            if self.closed:
                return
            self.closed = True
            self.wait_until(lambda: self.active == 0)
        self.tiers.close()

    def load_ssd_blocks(self) -> None:
        """Adopt the blocks a previous pool left on the SSD tier."""
        ssd = self.tiers.ssd
        if ssd is None:
            return
        for key, record in ssd.load_records():
            self.entries[key] = Entry(ssd, record.offset, record.size, record.parent, record)
            ssd.policy.on_insert(key, record.parent)

    def insert(
        self, key: bytes, tier: MemoryTier, offset: int, size: int, parent: bytes | None
    ) -> None:
        """Make a just-copied block visible and count the put (every put ends here)."""
        self.entries[key] = Entry(tier, offset, size, parent)
        tier.policy.on_insert(key, parent)
        stats = self.stats
        stats.puts += 1
        stats.bytes_written += size
        stats.tier_puts[tier.name] += 1

    def remove(self, key: bytes) -> bool:
        """Forget ``key``'s block (freed now, or on its last unpin); False if absent."""
        entry = self.entries.pop(key, None)
        if entry is None:
            return False
        entry.tier.policy.on_remove(key)
        self.drop(key, entry)
        return True

    def make_room(self, tier: Tier, size: int) -> int:
        """Allocate ``size`` bytes in ``tier``, evicting unpinned blocks as needed."""
        offset = tier.allocator.allocate(size)  # the common case: room without eviction
        if offset is not None:
            return offset
        if not tier.fits(size):
            raise BlockTooLargeError(
                f"block of {size} bytes is larger than the {tier.name} tier ({tier.capacity} bytes)"
            )
        while True:
            victim = tier.policy.victim(self.evictable)
            if victim is None:
                raise PoolFullError(
                    f"{tier.name} tier has no room for {size} bytes: every block is pinned by a "
                    "reader or too fragmented; retry later or enlarge the tier"
                )
            self.demote(victim)
            offset = tier.allocator.allocate(size)
            if offset is not None:
                return offset

    def evictable(self, key: bytes) -> bool:
        return self.entries[key].pins == 0

    def demote(self, key: bytes) -> None:
        """Move an unpinned block (already untracked by its tier's policy) one tier down.

        With no lower tier, or no room there, the block is dropped.
        """
        entry = self.entries[key]
        source, old_offset = entry.tier, entry.offset
        self.stats.count_eviction(source.name)
        target = self.tiers.below(source)
        if target is not None and target.fits(entry.size) and self._copy_down(key, entry, target):
            source.free(old_offset)
            self.stats.count_demotion(source.name)
        else:
            del self.entries[key]
            self.drop(key, entry)

    def _copy_down(self, key: bytes, entry: Entry, target: Tier) -> bool:
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
                offset = self.make_room(target, entry.size)
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
                self.stats.ssd_errors += 1
                return None
            if record is not None:
                return record
            victim = ssd.policy.victim(self.evictable)
            if victim is None:
                return None
            self.demote(victim)

    def drop(self, key: bytes, entry: Entry) -> None:
        """Forget a block already taken out of the table; free now or on last unpin."""
        if isinstance(entry.tier, SsdTier):
            entry.tier.delete(key)
        if entry.pins:
            entry.dead = True
        else:
            entry.tier.free(entry.offset)

    def dram_slot(self, size: int) -> int | None:
        """Room in DRAM to read an SSD block through (and promote it into), or
        None when DRAM holds only pinned blocks (the read then bypasses DRAM)."""
        try:
            return self.make_room(self.tiers.dram, size)
        except PoolFullError:
            return None

    def settle_ssd_read(
        self, key: bytes, entry: Entry, ssd: SsdTier, slot: int | None, valid: bool
    ) -> None:
        """After an SSD block was read into the DRAM ``slot`` (or around it): forget
        it if its checksum failed; promote it into the slot if it is still the
        current block and only the reader pins it; else give the slot back."""
        current = self.entries.get(key) is entry
        if not valid:
            self.stats.corrupt_dropped += 1
            if current:
                del self.entries[key]
                ssd.policy.on_remove(key)
                self.drop(key, entry)
        if slot is None:
            return
        if valid and current and entry.pins == 1:
            self._promote(key, entry, ssd, slot)
        else:
            self.tiers.dram.free(slot)

    def _promote(self, key: bytes, entry: Entry, ssd: SsdTier, dram_offset: int) -> None:
        """Point an SSD block (pinned only by the caller) at its fresh DRAM copy."""
        ssd.delete(key)
        ssd.policy.on_remove(key)
        ssd.free(entry.offset)
        entry.tier, entry.offset, entry.record = self.tiers.dram, dram_offset, None
        self.tiers.dram.policy.on_insert(key, entry.parent)
        self.stats.promotions += 1

    def unpin(self, entry: Entry) -> None:
        entry.pins -= 1
        if entry.pins == 0 and entry.dead:
            entry.tier.free(entry.offset)

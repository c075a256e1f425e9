"""A storage node's SSD tier: DRAM-arena blocks copied to disk and back on the master's word.

Wraps kvpool.storage.ssd_tier.SsdTier (preallocated data file, O_DIRECT, LMDB
index, checksums) with the node's own eviction order: when the SSD is full,
the least recently stored or loaded block goes first, and the master hears
about it in the reply. Thread-safe (RPC workers and the heartbeat thread).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from typing import Any

import numpy as np

from kvpool.errors import BlockTooLargeError, StorageError
from kvpool.eviction import make_policy
from kvpool.storage.ssd_record import SsdRecord
from kvpool.storage.ssd_tier import SsdTier

_PAGE = 4096
log = logging.getLogger("kvpool.cluster.node")


class NodeSsd:
    def __init__(self, path: str, capacity: int, arena: np.ndarray) -> None:
        self.tier = SsdTier(path, capacity, make_policy("lru"))
        self.arena = arena
        self._lock = threading.Lock()
        self._records: OrderedDict[bytes, SsdRecord] = OrderedDict(self.tier.load_records())

    def listing(self) -> list[list[Any]]:
        """[key, size, parent] of every block on the SSD (for registration)."""
        with self._lock:
            return [[k, r.size, r.parent] for k, r in self._records.items()]

    def store(self, items: list[list[Any]]) -> dict[str, list[bytes]]:
        """Copy arena ranges [offset, offset+size) to the SSD under their keys."""
        stored: list[bytes] = []
        dropped: list[bytes] = []
        batch = {item[0] for item in items}
        with self._lock:
            for key, offset, size, parent in items:
                if key in self._records:
                    self._records.move_to_end(key)
                    stored.append(key)
                    continue
                slot = self.arena[offset : offset + -(-size // _PAGE) * _PAGE]
                if self._store_one(key, slot, size, parent, batch, dropped):
                    stored.append(key)
        return {"stored": stored, "dropped": dropped}

    def load(self, items: list[list[Any]]) -> list[bool]:
        """Read SSD blocks into arena ranges; False (and the block dropped) if missing or
        its checksum fails."""
        results = []
        with self._lock:
            for key, offset, *_ in items:  # [key, offset, alloc_id]
                record = self._records.get(key)
                if record is None:
                    results.append(False)
                    continue
                slot = self.arena[offset : offset + -(-record.size // _PAGE) * _PAGE]
                ok = self.tier.read_into(record, slot)
                if ok:
                    self._records.move_to_end(key)
                else:
                    log.warning("SSD block %s failed its checksum: dropped", key.hex())
                    self._drop(key)
                results.append(ok)
        return results

    def describe(self, key: bytes) -> tuple[int, bytes | None] | None:
        """(size, parent) of ``key`` on the SSD, or None."""
        with self._lock:
            record = self._records.get(key)
            return None if record is None else (record.size, record.parent)

    def drop(self, key: bytes) -> None:
        with self._lock:
            self._drop(key)

    def close(self) -> None:
        with self._lock:
            self.tier.close()

    def _store_one(
        self,
        key: bytes,
        slot: np.ndarray,
        size: int,
        parent: bytes | None,
        batch: set[bytes],
        dropped: list[bytes],
    ) -> bool:
        while True:
            try:
                record = self.tier.store(key, slot, size, parent)
            except (BlockTooLargeError, StorageError):
                return False
            if record is not None:
                self._records[key] = record
                return True
            victim = next((k for k in self._records if k not in batch), None)
            if victim is None:
                return False
            self._drop(victim)
            dropped.append(victim)

    def _drop(self, key: bytes) -> None:
        record = self._records.pop(key, None)
        if record is not None:
            self.tier.delete(key)
            self.tier.free(record.offset)

"""Reading a pinned SSD block of the embedded pool: through a DRAM slot, promoting it.

An SSD hit reads the whole block (its checksum covers the whole record) into a
DRAM slot made for it, and the block then lives in DRAM (one tier up); where
DRAM holds only pinned blocks, the read bypasses DRAM (straight into the
caller's buffer when that takes the whole block, else a temporary one). The
block table's lock is held only to take the slot and to settle the read
(``BlockTable.dram_slot``, ``settle_ssd_read``), never across the disk I/O.
"""

from __future__ import annotations

import numpy as np

from kvpool.bindings.buffers import Region, region_is_device
from kvpool.embedded.blocks import BlockTable, Entry
from kvpool.storage.ssd_record import SsdRecord
from kvpool.storage.ssd_tier import SsdTier


def read_ssd_block(
    blocks: BlockTable,
    key: bytes,
    entry: Entry,
    ssd: SsdTier,
    record: SsdRecord,
    dst: Region | None,
    start: int,
    length: int,
) -> bool:
    """Read bytes [start, start+length) of a pinned SSD block into ``dst`` through a
    DRAM slot, promoting the whole block there; False (and the block dropped) if
    its checksum fails. A large block is copied on to ``dst`` piece by piece as it
    lands, while the rest still reads (on False ``dst`` holds no meaningful bytes,
    as on any miss).

    With ``dst=None`` the block is only verified and promoted.
    """
    dram = blocks.tiers.dram
    with blocks.mutex:
        slot_offset = blocks.dram_slot(record.size)
    if slot_offset is not None:
        staging = dram.region(slot_offset, dram.allocator.size_of(slot_offset))
    elif dst is None or region_is_device(dst) or length != record.size:
        staging = np.empty(record.size, np.uint8)
    else:
        staging = dst
    if dst is None or staging is dst:
        valid = ssd.read_into(record, staging)
    else:
        valid = ssd.read_copying(record, staging, dst, start, length)
    with blocks.mutex:
        blocks.settle_ssd_read(key, entry, ssd, slot_offset, valid)
    return valid

"""Block identities in shared memory: what lets a same-host read check its block.

A same-host client copies a block straight out of the node's arena mapping
(kvpool.transport.shm), so the node cannot check the read the way it checks
a TCP read (``IDENT``, kvpool.transport.fencing). A reader whose lease is
outdated (it expired, the master restarted, the block was removed and its
range given to another block) would copy another block's bytes. The node
therefore publishes, beside the arena, one record per block start
(``ALIGN``-byte granule of the region): a sequence number, the block's size
and its key. Layout of record ``offset // ALIGN`` (``RECORD``, 32 bytes,
native byte order):

- ``seq`` (u64): even: the record describes the block starting there, whole
  and readable; odd: the range is being claimed, rewritten or freed (no
  block may be read there). 0: never published (a fresh node). It only
  grows, so a record republished between two reads of it never looks
  unchanged.
- ``size`` (u64), ``key`` (16 bytes): the block's size and key.

Writer (the node's BlockTable, under its lock; the only writer): ``retract``
makes the record odd *before* any byte of a new claim may land in the range
(the claim is answered only after it); ``publish`` writes size and key
between two increments (odd, then even) once the block is whole.

Reader (``check_then`` / ``still``): seq even and the record names the
expected key and covers the range, then copy, then seq unchanged: the copy
came from that block, whole; anything else is a miss, never wrong bytes.
This relies on the CPU keeping loads in order and stores in order (x86-64
TSO): the record's seq is read before the copy and again after it, and the
node's odd seq is stored before it answers the claim that lets a writer
store bytes. On weakly ordered CPUs (ARM) a load fence would be needed
around the copy; that is untested here.

The file is named after the arena (``ident_name``); a node that publishes no
identities (an older release) leaves none, and readers then copy unchecked.
"""

from __future__ import annotations

import struct

from kvpool.transport.shm_side_file import SideFile

#: The granule of block starts (the master's allocator aligns every extent to it).
ALIGN = 4096
#: seq, size, key
RECORD = struct.Struct("=QQ16s")
_BODY = struct.Struct("=Q16s")
_SEQ = 0  # index of seq in a record viewed as 4 x u64


def ident_name(arena_name: str) -> str:
    """The identity file's shared-memory name for the arena ``arena_name``."""
    return f"{arena_name}.ident"


def ident_bytes(arena_size: int) -> int:
    return max(1, -(-arena_size // ALIGN)) * RECORD.size


class BlockIdents(SideFile):
    """The identity records of one arena, mapped from a /dev/shm file.

    The node creates it (``create=True``: the only writer; ``close`` unlinks
    it); same-host readers map it read-only.
    """

    def __init__(self, path: str, arena_size: int, *, create: bool) -> None:
        size = ident_bytes(arena_size)
        what = f"the identity file of a {arena_size} B arena"
        super().__init__(path, size, create=create, writable=False, what=what)
        self._records = size // RECORD.size

    # -- the writer (the node, under its table's lock) ---------------------------------

    def retract(self, offset: int) -> None:
        """No block may be read at ``offset`` any more (odd seq)."""
        slot = self._slot(offset)
        if slot is not None and self._words is not None:
            seq = self._words[slot * 4 + _SEQ]
            if not seq & 1:
                self._words[slot * 4 + _SEQ] = seq + 1

    def publish(self, offset: int, size: int, key: bytes) -> None:
        """Block ``key`` (``size`` bytes) starts at ``offset`` and is whole."""
        slot = self._slot(offset)
        words = self._words
        if slot is None or words is None or len(key) != 16:
            return
        assert self._mmap is not None
        seq = words[slot * 4 + _SEQ]
        if not seq & 1:
            seq += 1
            words[slot * 4 + _SEQ] = seq
        _BODY.pack_into(self._mmap, slot * RECORD.size + 8, size, key)
        words[slot * 4 + _SEQ] = seq + 1

    # -- the reader ---------------------------------------------------------------------

    def check_then(self, key: bytes, block_offset: int, start: int, length: int) -> int:
        """Before a copy: the seq to compare afterwards (``still``), or -1 if the
        record does not name block ``key`` covering [start, start + length) now."""
        words, mm = self._words, self._mmap
        if block_offset < 0 or block_offset % ALIGN or words is None or mm is None:
            return -1
        slot = block_offset // ALIGN
        if slot >= self._records:
            return -1
        at = slot * 4
        seq = words[at + _SEQ]  # first: the size and key read next belong to it or later
        if seq & 1 or seq == 0 or start < 0 or start + length > words[at + 1]:
            return -1
        found = mm[at * 8 + 16 : at * 8 + 32]
        return seq if found == key else -1

    def still(self, block_offset: int, seq: int) -> bool:
        """After the copy: nothing touched the block since ``check_then`` returned
        ``seq`` (``block_offset`` is one ``check_then`` accepted)."""
        words = self._words
        return words is not None and words[block_offset // ALIGN * 4 + _SEQ] == seq

    def seq(self, offset: int) -> int:
        slot = self._slot(offset)
        return -1 if slot is None or self._words is None else self._words[slot * 4 + _SEQ]

    def _slot(self, offset: int) -> int | None:
        if offset < 0 or offset % ALIGN:
            return None
        slot = offset // ALIGN
        return slot if slot < self._records else None

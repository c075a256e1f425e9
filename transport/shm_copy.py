"""Same-host copies with their block's record, in one native call each (issue 17).

A same-host read copies a block out of the node's arena between two reads of
its identity record (kvpool.transport.shm_ident); a same-host put copies it
in and then writes its seal record (kvpool.transport.shm_seal). Done in
Python, the calls around the copy (the record's checks, the arena slice, the
copy's dispatch, the record's packing) cost ~1.5-2.5 us of a 1 MiB read or put
once the copy has pushed the interpreter's state out of the CPU caches
(bench/RESULTS.md, "Session 22"). The compiled ``kvpool.transport._shm_copy``
does each in one call, with the copy way that ``kvpool.bindings.stream_copy``
learned for the size (``read_way`` / ``put_way``); ``ShmTransport.read_block``
and ``ShmTransport.write_sealed`` use it when the way is settled, and the
Python path otherwise (a size class still learning, the extension absent).

``read_checked(dst, arena, idents, block_offset, start, key, way)``,
``read_checked_many(plan, arena, idents, length, way)`` (a batch of reads of one
size: ``ShmTransport.read_blocks``) and ``write_sealed(arena, src, seals, offset,
epoch, alloc_id, key, parent, mark, way)`` are the compiled functions themselves
(no Python frame between), None
where the extension was not built (no C compiler at install time: it is an
optional extension) or ``$KVPOOL_SHM_COPY=0`` turns them off. Their contract
and the record layouts they share with the Python modules: transport/_shm_copy.c.
``STATUS`` says which path runs, and why.
"""

from __future__ import annotations

from collections.abc import Callable

from kvpool.config import optional_extension

_module, _missing = optional_extension("kvpool.transport._shm_copy", "KVPOOL_SHM_COPY")
STATUS = (
    "one native call per checked read and per sealed put"
    if _module is not None
    else f"checked in Python ({_missing})"
)

#: A checked same-host read (1 read, 0 miss, -1 outside the arena); None: not built.
read_checked: Callable[..., int] | None = None if _module is None else _module.read_checked
#: ``read_checked`` of each read of a batch of one size, one call: per read 1 / 0 / -1,
#: or None (nothing copied) when a destination is not writable contiguous memory of
#: that size; None: not built.
read_checked_many: Callable[..., list[int] | None] | None = (
    None if _module is None else _module.read_checked_many
)
#: A same-host put's copy and seal record (1 sealed, 0 no record, -1 outside the
#: arena); None: not built.
write_sealed: Callable[..., int] | None = None if _module is None else _module.write_sealed

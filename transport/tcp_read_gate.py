"""A node's checked TCP reads served in one native call, each holding its block by a count.

The data server's Python path for a checked read (``READ_BLOCK``,
kvpool.transport.tcp_checked_reads) asks the node's block table, under its
lock, whether the block still holds the range and holds its entry until the
send ends. Each read finds those objects out of the caches the previous reply's
megabyte went through: ~8-12 us of a 1 MiB read, seen by the client (issue 17,
session 49). The gate serves the common read without them: the compiled
``kvpool.transport._tcp_serve.serve_reads`` checks the block's identity record
(kvpool.transport.shm_ident: the table publishes a block's record once it is
whole and retracts it when it goes), raises the block's reader count, sends the
reply with the GIL released and lowers the count -- a pipelined batch's replies
in one gather send, as the Python path sends them. Any read
it does not take (no such record now, a claim sealed in shared memory the table
has not adopted, the extension not built) takes the Python path, which answers it.

Invariants: a block a native read is sending is never overwritten. The table
(kvpool.cluster.block_table) retracts the records of the blocks a claim or an
SSD load overlaps before it looks at their counts (``reading``), and keeps an
entry whose count is up until a writer finds it idle; the record check and the
count's rise happen in one native call holding the GIL, so either the table
sees the count or the read sees the retraction. The count is per 4 KiB granule
of block start (one u32: 0.1% of the arena, its pages touched only where reads
land). ``KVPOOL_TCP_SERVE=0`` turns the gate off (every read in Python).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from functools import partial

import numpy as np

from kvpool.config import optional_extension
from kvpool.transport.shm_ident import ALIGN, BlockIdents

_module, _missing = optional_extension("kvpool.transport._tcp_serve", "KVPOOL_TCP_SERVE")
#: Whether checked reads are served natively, and why not (for ``kvpool bench`` reports).
STATUS = (
    "native: one call per checked read or pipelined batch"
    if _module is not None
    else f"Python ({_missing})"
)


class ReadGate:
    """The native checked reads of one node's region and their counts per block start.

    ``serve(fd, inbox, at, end, sent, max_n, max_bytes)``: the pipelined checked
    reads in ``inbox[at:end]``, as many from the first as it takes (at most
    ``max_n``, up to ``max_bytes`` of payload), served in one gather send: (served,
    bytes sent, payload bytes); or None when it takes none -- nothing sent, the
    caller's Python path answers them. None itself where the gate is off; else the
    compiled function with the region, its records and the counts bound (a C
    partial: no Python frame per call)."""

    def __init__(self, idents: BlockIdents, region: np.ndarray) -> None:
        self.size = region.nbytes
        self.readers = np.zeros(max(1, -(-self.size // ALIGN)), np.uint32)
        records, module = idents.mapping, _module
        self.serve: Callable[..., tuple[int, int, int] | None] | None = None
        if module is not None and records is not None:
            self.serve = partial(module.serve_reads, region, records, self.readers)

    def reading(self, block_offsets: Iterable[int]) -> bool:
        """Whether a native read of a block starting at any of these offsets is being
        sent now (the table asks under its lock, after retracting their records)."""
        readers = self.readers
        return any(readers[offset // ALIGN] for offset in block_offsets)

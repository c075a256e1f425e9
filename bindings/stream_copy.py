"""Large host copies with streaming stores: the bytes go to memory, not the caches.

A kvpool copy of a large block moves bytes that this core will not read back
soon: a put writes the node's shared arena, which other processes read later;
a get fills the caller's buffer, usually its share of a KV cache far bigger
than this core's caches. An ordinary copy (numpy's, glibc's ``memcpy``) reads each
destination line into the cache before writing it (read-for-ownership) and
evicts the caller's own working set on the way; glibc switches to streaming
stores only above ``x86_non_temporal_threshold``, 240 MiB on these VMs.

``copy_into(dst, src)`` streams copies of ``STREAM_FROM`` bytes and more through
the compiled ``kvpool.bindings._stream_copy`` (AVX2 or SSE2, GIL released,
fenced before it returns), and leaves smaller ones to numpy. Measured on a 2
vCPU AMD EPYC (``kvpool bench copy``, ``kvpool bench all``): bench/RESULTS.md,
"Session 10".

Where streaming starts is the machine's: on one 2 vCPU AMD EPYC class of VM a
cold 64 KiB block streams 1.2-1.4x faster than numpy copies it, on another (twice
the memory bandwidth) 0.72x as fast, and the two only draw level from 1 MiB
(bench/RESULTS.md, "Session 18"). ``$KVPOOL_STREAM_MIN=BYTES`` (at least
``STREAM_MIN``) makes copies stream only from that size: run ``kvpool bench copy``
on the machine and set it to the smallest size whose ``cold`` row, and every
larger one, reads 1.0 or more.

Where the extension was not built (no C compiler at install time: it is an
optional extension) or ``$KVPOOL_STREAM_COPY=0``, every copy is numpy's:
``STATUS`` says which, and why.

Invariant: ``copy_into`` leaves ``dst`` byte-equal to ``src`` whichever path it
takes, and its stores are ordered before the caller's next store (the SFENCE in
the kernel, and numpy's ordinary stores), so a seal record written after it
never announces bytes that are not there yet.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable

import numpy as np

#: copies smaller than this never stream; by default, larger ones do. A pool's
#: destinations are cold (a put writes a range of a GiB-sized arena; a get fills the
#: caller's share of its KV cache), where, on the VMs of sessions 10-17, streaming
#: wins from 4 KiB (``kvpool bench copy``: 1.2-1.4x at 4-128 KiB). It loses where the
#: destination is still in this core's caches: 0.75-0.8x at 64 KiB copied again and
#: again into the same four buffers. Below 64 KiB the
#: gain (0.1-0.5 us a copy) is about what the call costs over numpy's.
STREAM_MIN = 64 << 10


def _stream_from() -> int:
    """``$KVPOOL_STREAM_MIN`` (bytes, >= ``STREAM_MIN``), else ``STREAM_MIN``."""
    text = os.environ.get("KVPOOL_STREAM_MIN")
    if text is None:
        return STREAM_MIN
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < STREAM_MIN:
        raise ValueError(
            f"$KVPOOL_STREAM_MIN must be a whole number of bytes >= {STREAM_MIN} "
            f"(the smallest copy that may stream), not {text!r}"
        )
    return value


#: copies of at least this many bytes stream: ``STREAM_MIN`` unless
#: ``$KVPOOL_STREAM_MIN`` says otherwise.
STREAM_FROM = _stream_from()
_SOURCE = " ($KVPOOL_STREAM_MIN)" if STREAM_FROM != STREAM_MIN else ""


def _load() -> tuple[Callable[[object, object], None] | None, str]:
    """The streaming kernel and a line saying which copy runs, and why."""
    if os.environ.get("KVPOOL_STREAM_COPY", "1") == "0":
        return None, "numpy copy ($KVPOOL_STREAM_COPY=0)"
    try:  # by name: the compiled module, not the package's Python adapters
        _stream_copy = importlib.import_module("kvpool.bindings._stream_copy")
    except ImportError as exc:  # built without a compiler: the optional extension is absent
        return None, f"numpy copy (kvpool.bindings._stream_copy not built: {exc})"
    kernel = _stream_copy.KERNEL
    return _stream_copy.copy, f"streaming stores ({kernel}) from {STREAM_FROM} B{_SOURCE}"


_kernel, STATUS = _load()


def copy_into(dst: np.ndarray, src: np.ndarray) -> None:
    """Copy ``src`` into ``dst``: flat, C-contiguous uint8 arrays of the same length
    (``dst`` writable), as the hot paths hold them (``buffers.plain_host``)."""
    kernel = _kernel
    if kernel is not None and src.nbytes >= STREAM_FROM:
        # the kernel refuses (ValueError) unequal lengths and strided views, as numpy
        # refuses a shape it cannot broadcast: callers never pass either
        kernel(dst, src)
    else:
        dst[...] = src  # np.copyto without its dispatcher frame


def kernel_or_none() -> Callable[[object, object], None] | None:
    """The streaming kernel itself, any size (``kvpool bench copy``); None where large
    copies do not stream (``STATUS`` says why)."""
    return _kernel

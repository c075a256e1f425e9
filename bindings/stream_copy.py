"""Large host copies with streaming stores: the bytes go to memory, not the caches.

A kvpool copy of a large block moves bytes that this core will not read back
soon: a put writes the node's shared arena, which other processes read later;
a get fills the caller's buffer, usually its share of a KV cache far bigger
than this core's caches. An ordinary copy (numpy's, glibc's ``memcpy``) reads each
destination line into the cache before writing it (read-for-ownership) and
evicts the caller's own working set on the way; glibc switches to streaming
stores only above ``x86_non_temporal_threshold``, 240 MiB on these VMs.

``copy_into(dst, src)`` (a put's copy into pool memory) and ``copy_out`` (a
read's, out of it) copy either through the compiled
``kvpool.bindings._stream_copy`` (AVX2 or SSE2 streaming stores, GIL released,
fenced before it returns) or with numpy's copy, by the size of the block:
below ``STREAM_MIN`` numpy's, from ``LEARN_BELOW`` streaming, and in between
whichever the process's first copies of that size class, in that direction,
timed faster, a near tie going to streaming for puts and to numpy's copy for reads
(kvpool.bindings.copy_choice: on one 2 vCPU AMD EPYC class of VM streaming wins
from 64 KiB, on another, with twice the memory bandwidth, only from 1 MiB;
bench/RESULTS.md, "Session 10", "Session 18" and "Session 19").
``$KVPOOL_STREAM_MIN=BYTES`` (a power of two, at least ``STREAM_MIN``) fixes the
bound instead: copies stream from that size, smaller ones are numpy's, nothing
is timed.

Where the extension was not built (no C compiler at install time: it is an
optional extension) or ``$KVPOOL_STREAM_COPY=0``, every copy is numpy's.
``status()`` says which copy runs, from what size, what each learning class
settled on, and why.

Invariant: ``copy_into`` and ``copy_out`` leave ``dst`` byte-equal to ``src``
whichever path they take, and their stores are ordered before the caller's next
store (the SFENCE in the kernel, and numpy's ordinary stores), so a seal record
written after a copy never announces bytes that are not there yet.
"""

from __future__ import annotations

import importlib
import os

import numpy as np

from kvpool.bindings.copy_choice import (
    LEARN_BELOW,
    NUMPY,
    STREAM,
    STREAM_MIN,
    TRIALS,
    CopyChoice,
    Kernel,
    initial_ways,
)
from kvpool.config import format_size


def _stream_from() -> int | None:
    """``$KVPOOL_STREAM_MIN`` (bytes: a power of two >= ``STREAM_MIN``), or None."""
    text = os.environ.get("KVPOOL_STREAM_MIN")
    if text is None:
        return None
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < STREAM_MIN or value & (value - 1):
        raise ValueError(
            f"$KVPOOL_STREAM_MIN must be a power of two >= {STREAM_MIN} (bytes: the "
            f"smallest copy that streams), not {text!r}"
        )
    return value


#: ``$KVPOOL_STREAM_MIN``: copies of at least this many bytes stream, smaller ones
#: are numpy's, nothing is learned; None (unset): the bound is learned per size class.
STREAM_FROM = _stream_from()


def _load() -> tuple[Kernel | None, str]:
    """The streaming kernel and a line saying which copy runs, and why."""
    if os.environ.get("KVPOOL_STREAM_COPY", "1") == "0":
        return None, "numpy copy ($KVPOOL_STREAM_COPY=0)"
    try:  # by name: the compiled module, not the package's Python adapters
        _stream_copy = importlib.import_module("kvpool.bindings._stream_copy")
    except ImportError as exc:  # built without a compiler: the optional extension is absent
        return None, f"numpy copy (kvpool.bindings._stream_copy not built: {exc})"
    name = f"streaming stores ({_stream_copy.KERNEL})"
    if STREAM_FROM is not None:
        return _stream_copy.copy, f"{name} from {format_size(STREAM_FROM)} ($KVPOOL_STREAM_MIN)"
    return _stream_copy.copy, (
        f"{name} from {format_size(LEARN_BELOW)}; from {format_size(STREAM_MIN)}, per size "
        f"class, whichever of it and numpy's copy its first {2 * TRIALS} copies timed faster, "
        "a near tie going to streaming for puts and to numpy's copy for reads"
    )


_kernel, STATUS = _load()
# Two tables: a copy into pool memory (a put: caller's buffer -> arena) and one out
# of it (a read: arena -> caller's buffer) learn apart: the winner can differ (one
# same-host client here: streaming 1.2x numpy's copy for its 1 MiB puts, 0.87x for
# its reads; bench/RESULTS.md, "Session 19"), and a near tie goes apart: to streaming
# for puts, to numpy's copy for reads (copy_choice; "Session 23").
_into = CopyChoice(_kernel, initial_ways(_kernel is not None, STREAM_FROM), prefer=STREAM)
_out = CopyChoice(_kernel, initial_ways(_kernel is not None, STREAM_FROM), prefer=NUMPY)
_into_ways, _out_ways = _into.ways, _out.ways  # read on every copy: one list item


def copy_into(dst: np.ndarray, src: np.ndarray) -> None:
    """Copy ``src`` into ``dst``, a range of pool memory (a put): flat, C-contiguous
    uint8 arrays of the same length (``dst`` writable), as the hot paths hold them
    (``buffers.plain_host``)."""
    way = _into_ways[src.nbytes.bit_length()]  # copy_choice.class_of, inlined
    if way == STREAM:
        # the kernel refuses (ValueError) unequal lengths and strided views, as numpy
        # refuses a shape it cannot broadcast: callers never pass either
        _kernel(dst, src)  # type: ignore[misc]  # STREAM only where the kernel exists
    elif way == NUMPY:
        dst[...] = src  # np.copyto without its dispatcher frame
    else:
        _into.trial_copy(dst, src)


def copy_out(dst: np.ndarray, src: np.ndarray) -> None:
    """``copy_into`` for a read: ``src`` is pool memory, ``dst`` the caller's buffer."""
    way = _out_ways[src.nbytes.bit_length()]
    if way == STREAM:
        _kernel(dst, src)  # type: ignore[misc]
    elif way == NUMPY:
        dst[...] = src
    else:
        _out.trial_copy(dst, src)


def put_way(nbytes: int) -> int:
    """How ``copy_into`` copies ``nbytes`` now: ``STREAM``, ``NUMPY`` or ``LEARN`` (its
    size class is still timing both), for native code that copies by itself
    (kvpool.transport.shm_copy: ``STREAM`` is this module's kernel, ``NUMPY`` a
    memcpy)."""
    return _into_ways[nbytes.bit_length()]


def read_way(nbytes: int) -> int:
    """``put_way`` for a read's copy (``copy_out``)."""
    return _out_ways[nbytes.bit_length()]


def copies_plainly(nbytes: int) -> bool:
    """Whether a put's copy of ``nbytes`` (``copy_into``) is numpy's for the rest of
    this process (below the streaming bound, or its size class settled on numpy's
    copy); False while the class is still learning."""
    return _into_ways[nbytes.bit_length()] == NUMPY


def learned() -> str:
    """What each learning class settled on, for puts and for reads (empty where no
    class learns)."""
    into, out = _into.describe(), _out.describe()
    return f"puts: {into or 'none'}; reads: {out or 'none'}" if into or out else ""


def status() -> str:
    """Which copy runs, from what size, and what each learning class settled on,
    for puts and for reads."""
    settled = learned()
    return f"{STATUS} ({settled})" if settled else STATUS


def kernel_or_none() -> Kernel | None:
    """The streaming kernel itself, any size (``kvpool bench copy``); None where large
    copies do not stream (``STATUS`` says why)."""
    return _kernel

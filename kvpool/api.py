"""The store contract: what every kvpool store offers, embedded or distributed.

``KVStore`` is the API an engine, the layer-wise writer/reader and the serving
runtime program against. ``kvpool.Pool`` (embedded) and ``kvpool.RemotePool``
(``kvpool.connect``) both implement it, and the contract test suite
(tests/test_store_contract.py) runs the same cases on each store.

Invariants every store keeps:

- A block is visible (``get``, ``exists``, ``prefix_match``) only once it is
  whole: ``put`` copies then commits, a ``BlockWriter`` commits explicitly.
- Committed blocks are immutable: ``put`` of a stored key answers False and
  changes nothing; ``reserve`` of a stored key answers None.
- A miss is a value, never an exception: ``get``/``get_into`` answer None.
- Bad input raises before anything changes (``kvpool.args`` holds the checks,
  so both stores raise the same error types with the same messages).
- Bytes leased by a ``Lease`` are neither evicted nor freed until it is
  released, so a reader may take them piecewise.
- After ``close`` every call, and every write or commit of a writer the store
  gave out, raises ``PoolClosedError``; ``close`` and ``abort`` stay harmless.

Documented differences (tested in tests/test_store_contract.py):

- a block larger than the whole store: the embedded pool raises
  ``BlockTooLargeError``, the cluster's master ``PoolFullError``;
- ``stats()`` shares ``mode``, ``policy``, ``blocks`` and ``transport``; the
  rest is per store (tiers, or nodes and the client's counters);
- only the cluster's writers can leave their process:
  ``RemoteBlockWriter.export()`` gives a wire-safe ticket that
  ``RemotePool.adopt`` in another process turns into a writer onto the same
  reservation (pipeline prefill's stages fill the layers they own that way).

Buffers (``data``, ``out``) are anything ``kvpool.bindings.buffers.as_region``
accepts: bytes, bytearray, memoryview, numpy arrays, torch tensors (CPU or
CUDA), cupy arrays; contiguous.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from kvpool.args import check_write_range
from kvpool.bindings.buffers import Region, as_region, region_nbytes

if TYPE_CHECKING:
    from types import TracebackType

    from kvpool.layerwise.reader import LayerReader
    from kvpool.layerwise.writer import LayerWriter
    from kvpool.layout import KVLayout

#: A buffer kvpool reads from or writes into (see the module docstring).
Buffer = Any


class BlockWriter(ABC):
    """A reserved block, invisible until ``commit``: fill its bytes in any order.

    Returned by ``KVStore.reserve``. Leaving the ``with`` block commits; an
    exception inside it aborts, so a failed producer never leaves a
    half-written block visible. ``write`` checks the range against ``size``
    before any byte moves; subclasses move the bytes (``_write``) and commit.
    ``BlockWriter.write_pieces`` / ``BlockWriter.commit_all`` batch the writes and
    commits of many writers (a store with round trips per call overrides
    ``write_group`` / ``commit_group`` to take a batch in fewer).
    """

    key: bytes
    size: int
    done: bool  # committed or aborted: the writer takes no more writes

    def write(self, offset: int, data: Buffer) -> None:
        """Copy ``data`` into bytes [offset, offset + len(data)) of the block."""
        src = as_region(data, what="data")
        check_write_range(offset, region_nbytes(src), self.size)
        self._write(offset, src)

    @abstractmethod
    def _write(self, offset: int, src: Region) -> None:
        """Move ``src`` to [offset, offset + its size) of the reserved space."""

    @abstractmethod
    def commit(self) -> None:
        """Make the block visible; the writer is finished afterwards."""

    @abstractmethod
    def abort(self) -> None:
        """Give the space back; nothing becomes visible. Idempotent."""

    @staticmethod
    def write_pieces(writes: Sequence[tuple[BlockWriter, int, Buffer]]) -> None:
        """``writer.write(offset, data)`` for each (writer, offset, data), as one batch:
        every range is checked before any byte moves, then each store's writers move
        their pieces together (the cluster client: one exchange per node, not a round
        trip or two per piece). Pieces of one writer land in order. On an error, which
        pieces landed is unspecified: abort the writers (their blocks never show)."""
        checked: dict[type[BlockWriter], list[tuple[BlockWriter, int, Region]]] = {}
        for writer, offset, data in writes:
            src = as_region(data, what="data")
            check_write_range(offset, region_nbytes(src), writer.size)
            checked.setdefault(type(writer), []).append((writer, offset, src))
        for cls, items in checked.items():
            cls.write_group(items)

    @staticmethod
    def commit_all(writers: Sequence[BlockWriter]) -> None:
        """``commit`` of each writer, as one batch per store (the cluster client: one
        seal exchange per node and one master round trip for the lot). On an error
        some of the blocks may be committed: abort the writers (a no-op on a
        finished one)."""
        by_class: dict[type[BlockWriter], list[BlockWriter]] = {}
        for writer in writers:
            by_class.setdefault(type(writer), []).append(writer)
        for cls, group in by_class.items():
            cls.commit_group(group)

    @classmethod
    def write_group(cls, writes: Sequence[tuple[BlockWriter, int, Region]]) -> None:
        """Move pieces of several writers of this class, (writer, offset, source)
        with every range already checked (``write_pieces``): ``_write`` of each, in
        order. A store whose writes cost round trips batches them instead."""
        for writer, offset, src in writes:
            writer._write(offset, src)

    @classmethod
    def commit_group(cls, writers: Sequence[BlockWriter]) -> None:
        """Commit several writers of this class (``commit_all``): ``commit`` of
        each, in order. A store whose commits cost round trips batches them."""
        for writer in writers:
            writer.commit()

    def __enter__(self) -> BlockWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.abort()


class Lease(ABC):
    """Blocks pinned by ``KVStore.lease``: safe to read piecewise until ``release``.

    ``keys`` are the leased keys in order (the stored prefix of the keys asked
    for); ``len(lease)`` their count. Releasing twice is harmless; leaving the
    ``with`` block releases.
    """

    keys: list[bytes]

    @abstractmethod
    def release(self) -> None:
        """Unpin every leased block. Idempotent."""

    def __len__(self) -> int:
        return len(self.keys)

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


@runtime_checkable
class KVStore(Protocol):
    """The public API of a kvpool store (see the module docstring for invariants)."""

    def put(
        self, key: bytes, data: Buffer, *, parent: bytes | None = None, replicas: int = 1
    ) -> bool:
        """Store ``data`` under ``key``; False if the key is already stored.

        ``replicas``: copies on up to that many distinct nodes (a cluster; fewer
        only where fewer live nodes have room: README, "Replicas under node failure").

        Either way the key then holds exactly one immutable block. A cluster
        client with pipelined commits answers False only for keys it put
        itself; another client's earlier block answers True (and is kept).
        True always leaves a block the writer reads at once. With another
        writer's reservation or put of the key in flight, a put either commits
        first (a cluster client's pipelined put: the master's first commit
        wins, the other becomes a no-op) or defers to it and answers False
        (the embedded store; a cluster client's first put), leaving the key
        absent if that writer aborts.
        """
        ...

    def put_batch(
        self,
        keys: Sequence[bytes],
        datas: Sequence[Buffer],
        parents: Sequence[bytes | None] | None = None,
        *,
        replicas: int = 1,
    ) -> list[bool]:
        """``put`` for each item; every argument is checked before any is stored."""
        ...

    def reserve(
        self, key: bytes, size: int, *, parent: bytes | None = None, device: bool = False
    ) -> BlockWriter | None:
        """Reserve ``size`` bytes for ``key`` to fill piecewise; None if already stored."""
        ...

    def reserve_batch(
        self,
        keys: Sequence[bytes],
        sizes: Sequence[int],
        parents: Sequence[bytes | None] | None = None,
        *,
        device: bool = False,
    ) -> Sequence[BlockWriter | None]:
        """``reserve`` for each item (a cluster: one master round trip for all).

        Every argument is checked before anything is reserved. All or nothing:
        a batch that raises (no room for some block) leaves no reservation. A
        key already stored, being written, or named earlier in the batch gets
        None in its place.
        """
        ...

    def get(self, key: bytes) -> bytes | None:
        """A copy of the block's bytes, or None on a miss."""
        ...

    def get_into(
        self, key: bytes, out: Buffer, *, offset: int = 0, length: int | None = None
    ) -> int | None:
        """Copy the block (or bytes [offset, offset+length)) into ``out``; None on a miss."""
        ...

    def get_into_batch(
        self,
        keys: Sequence[bytes],
        outs: Sequence[Buffer],
        *,
        offsets: Sequence[int] | None = None,
        lengths: Sequence[int | None] | None = None,
    ) -> list[int | None]:
        """``get_into`` for each pair: the bytes copied, None for a miss. With
        ``offsets`` / ``lengths`` (one per key each; a length None: to the block's
        end) read ``i`` takes bytes [offsets[i], offsets[i]+lengths[i]) of its block,
        as ``get_into(keys[i], outs[i], offset=, length=)`` would, so a layer-wise
        reader gets one layer of many blocks in one call (a key may appear more than
        once). Every argument is checked first; a range past its block's end raises
        ``BufferSpecError``."""
        ...

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        """For each key, whether a committed block is stored under it."""
        ...

    def prefix_match(self, keys: Sequence[bytes]) -> int:
        """Number of leading ``keys`` stored (the reusable prefix, in blocks)."""
        ...

    def remove(self, key: bytes) -> bool:
        """Forget the block; False if it was not stored."""
        ...

    def lease(self, keys: Sequence[bytes], *, prefix: bool = True) -> Lease:
        """Pin the longest stored prefix of ``keys`` (every stored key of ``keys``
        with ``prefix=False``) until the lease is released."""
        ...

    def locate(self, keys: Sequence[bytes]) -> list[list[str]]:
        """Node ids holding each key (empty where the key is not stored)."""
        ...

    def replicate(self, keys: Sequence[bytes], node: str | None = None) -> int:
        """Add extra replicas of stored blocks; how many were added."""
        ...

    def layer_writer(
        self,
        keys: Sequence[bytes],
        layout: KVLayout,
        parents: Sequence[bytes | None] | None = None,
        **options: Any,
    ) -> LayerWriter:
        """Store ``keys``' KV layer by layer in the background (``kvpool.layerwise``)."""
        ...

    def layer_reader(self, keys: Sequence[bytes], layout: KVLayout, **options: Any) -> LayerReader:
        """Load the stored prefix of ``keys`` layer by layer (``kvpool.layerwise``)."""
        ...

    def stats(self) -> dict[str, Any]:
        """Counters and capacity, as plain data: ``mode`` ("embedded" or
        "distributed"), ``policy``, ``blocks``, ``transport``, plus per-store keys."""
        ...

    def close(self) -> None:
        """Release everything the store holds. Idempotent."""
        ...

"""``layer_writer`` / ``layer_reader`` for every store (embedded and remote).

Both pools inherit these two methods; the writer and reader only use the
store contract (``reserve``, ``lease``, ranged ``get_into``; see
``kvpool.api.KVStore``), so they work the same against a local arena or a
cluster.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from kvpool.layerwise.reader import LayerReader
from kvpool.layerwise.writer import LayerWriter
from kvpool.layout import KVLayout

if TYPE_CHECKING:
    from kvpool.api import KVStore


class LayerwiseMethods:
    """Mixin: the layer-wise half of ``KVStore``, built on its other methods."""

    def layer_writer(
        self: KVStore,
        keys: Sequence[bytes],
        layout: KVLayout,
        parents: Sequence[bytes | None] | None = None,
        **options: Any,
    ) -> LayerWriter:
        """Store ``keys``' KV layer by layer in the background (``kvpool.layerwise``)."""
        return LayerWriter(self, keys, layout, parents, **options)

    def layer_reader(
        self: KVStore, keys: Sequence[bytes], layout: KVLayout, **options: Any
    ) -> LayerReader:
        """Load the stored prefix of ``keys`` layer by layer, prefetching (``kvpool.layerwise``)."""
        return LayerReader(self, keys, layout, **options)

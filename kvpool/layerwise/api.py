"""``layer_writer`` / ``layer_reader`` for every pool kind (embedded and remote).

Both pools inherit these two methods; the writer and reader only use the
pool's public API (reserve, lease, ranged get_into), so they work the same
against a local arena or a cluster.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class LayerwiseMethods:
    def layer_writer(
        self, keys: Sequence[bytes], layout: Any, parents: Any = None, **kw: Any
    ) -> Any:
        """Store ``keys``' KV layer by layer in the background (``kvpool.layerwise``)."""
        from kvpool.layerwise import LayerWriter

        return LayerWriter(self, keys, layout, parents, **kw)

    def layer_reader(self, keys: Sequence[bytes], layout: Any, **kw: Any) -> Any:
        """Load the stored prefix of ``keys`` layer by layer, prefetching (``kvpool.layerwise``)."""
        from kvpool.layerwise import LayerReader

        return LayerReader(self, keys, layout, **kw)

"""Layer-wise KV transfer: store each layer as prefill finishes it, load the
next layer while the current one is used (DESIGN.md, "Keys and blocks").

A block's (block key, layer) parts are byte ranges of the block, written by
layer and committed together, so a block is present only with all layers.

- ``LayerWriter`` (``pool.layer_writer(keys, layout)``): ``write_layer`` returns
  at once, copies run on a background thread, ``wait()`` commits all or none.
- ``LayerReader`` (``pool.layer_reader(keys, layout)``): leases the stored
  prefix and prefetches layers; ``wait_layer(l)`` returns (K, V).

Both use only ``reserve``/``BlockWriter``, ``lease`` and ranged ``get_into``,
which the embedded pool and the distributed client both provide.
"""

from __future__ import annotations

from kvpool.layerwise.common import LayerTransferError
from kvpool.layerwise.reader import LayerReader
from kvpool.layerwise.writer import LayerWriter

__all__ = ["LayerReader", "LayerTransferError", "LayerWriter"]

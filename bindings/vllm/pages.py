"""Pages of vLLM's registered KV cache tensors, as opaque bytes.

vLLM hands the connector one tensor per attention layer
(``register_kv_caches``). Whatever the backend's layout, one dimension runs
over the ``num_blocks`` physical blocks: the CPU backend's
``[num_blocks, kv_heads, block_size, 2*head_size]``, FlashAttention's
``[2, num_blocks, block_size, kv_heads, head_size]``, MLA's ``[num_blocks,
block_size, dim]``. A page is the slice at one block index of that
dimension; its bytes are never interpreted (no token is indexed inside a
page). ``gather`` copies pages out with ``index_select`` and lays them out
page after page; ``scatter`` writes such bytes back with ``index_copy_``; both
work on strided views (on CPU all layers are views into one buffer) and on
any device.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import torch

from kvpool.bindings.vllm.geometry import Geometry


class PagedLayers:
    """The registered layers in model order, with their page geometry."""

    def __init__(self, kv_caches: dict[str, torch.Tensor], num_blocks: int, geometry: Geometry):
        if len(kv_caches) != geometry.num_layers:
            raise ValueError(
                f"KVPoolConnector: {len(kv_caches)} KV cache tensors registered, "
                f"the KV cache config has {geometry.num_layers} layers"
            )
        names = list(kv_caches)
        numbers = [layer_number(name) for name in names]
        if all(n is not None for n in numbers):
            names = [name for _, name in sorted(zip(numbers, names, strict=True))]
        self.names = names
        self.index = {name: i for i, name in enumerate(names)}
        self.tensors = [kv_caches[name] for name in names]
        first = self.tensors[0]
        dims = [d for d, size in enumerate(first.shape) if size == num_blocks]
        if not dims:
            raise ValueError(
                f"KVPoolConnector: no dimension of the KV cache shape {tuple(first.shape)} "
                f"runs over the {num_blocks} blocks"
            )
        self.block_dim = dims[0]
        self.page_shape = first.shape[: self.block_dim] + first.shape[self.block_dim + 1 :]
        self.dtype = first.dtype
        self.device = first.device
        page_bytes = first.numel() // num_blocks * first.element_size()
        if page_bytes != geometry.page_bytes:
            raise ValueError(
                f"KVPoolConnector: a page of the registered KV cache is {page_bytes} bytes, "
                f"the KV cache spec says {geometry.page_bytes}"
            )
        for name, tensor in zip(self.names, self.tensors, strict=True):
            if tensor.shape != first.shape or tensor.dtype != first.dtype:
                raise ValueError(f"KVPoolConnector: layer {name} differs in shape or dtype")
        self.page_bytes = page_bytes
        self._staging = torch.empty(0, dtype=torch.uint8, device=self.device)

    def gather(self, kv_layer: torch.Tensor, block_ids: Sequence[int]) -> torch.Tensor:
        """A copy of the pages of ``block_ids``, page after page, as flat bytes."""
        ids = torch.tensor(block_ids, dtype=torch.long, device=kv_layer.device)
        pages = kv_layer.index_select(self.block_dim, ids).movedim(self.block_dim, 0)
        return pages.contiguous().view(torch.uint8).reshape(-1)

    def scatter(self, layer: int, block_ids: Sequence[int], data: torch.Tensor) -> None:
        """Write ``data`` (flat page bytes, as ``gather`` makes them) into ``block_ids``."""
        kv_layer = self.tensors[layer]
        ids = torch.tensor(block_ids, dtype=torch.long, device=kv_layer.device)
        pages = data.view(self.dtype).view(len(block_ids), *self.page_shape)
        kv_layer.index_copy_(self.block_dim, ids, pages.movedim(0, self.block_dim))

    def staging(self, num_pages: int) -> torch.Tensor:
        """A flat byte buffer for ``num_pages`` pages, reused from load to load
        (already faulted in) until ``drop_staging``."""
        need = num_pages * self.page_bytes
        if self._staging.numel() < need:
            self._staging = torch.empty(need, dtype=torch.uint8, device=self.device)
        return self._staging[:need]

    def drop_staging(self) -> None:
        """Forget the buffer (a failed load may still write into it); the next is new."""
        self._staging = torch.empty(0, dtype=torch.uint8, device=self.device)


_LAYER_INDEX = re.compile(r"(?:^|\.)(?:layers|h|blocks)\.(\d+)\.")


def layer_number(name: str) -> int | None:
    """The decoder layer index in a vLLM attention layer name (model.layers.3.self_attn.attn)."""
    match = _LAYER_INDEX.search(name)
    return int(match.group(1)) if match else None

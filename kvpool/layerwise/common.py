"""Pieces shared by the layer writer and the layer reader.

A block is one value of ``layout.block_bytes`` laid out layer-major: layer l
of a block is bytes [l*layer_bytes, (l+1)*layer_bytes), K first, then V. A
layer of *n* blocks, as an engine holds it, is one K tensor and one V tensor
of ``n*block_tokens`` tokens each; block i's K is bytes
[i*half_layer_bytes, (i+1)*half_layer_bytes) of the K tensor.
"""

from __future__ import annotations

from typing import Any

from kvpool.bindings.buffers import Region, as_region, region_is_device, region_nbytes
from kvpool.errors import BufferSpecError, KVPoolError
from kvpool.layout import KVLayout


class LayerTransferError(KVPoolError, RuntimeError):
    """A background layer copy failed (pool closed or full, node lost, ...).

    The original exception is chained as ``__cause__``. A failed writer has
    aborted every block it reserved; a failed reader has released its lease.
    """


def check_layout(layout: object) -> KVLayout:
    if not isinstance(layout, KVLayout):
        raise TypeError(f"layout must be a kvpool.KVLayout, got {type(layout).__name__}")
    return layout


def check_layer(layer: object, layout: KVLayout) -> int:
    if not isinstance(layer, int) or isinstance(layer, bool):
        raise TypeError(f"layer must be an int, got {type(layer).__name__}")
    if not 0 <= layer < layout.num_layers:
        raise IndexError(f"layer {layer} is out of range: the layout has {layout.num_layers}")
    return layer


def layer_region(obj: Any, nbytes: int, what: str, *, writable: bool) -> Region:
    """``obj`` as a flat uint8 region of exactly ``nbytes`` (at least, for outputs)."""
    region = as_region(obj, writable=writable, what=what)
    have = region_nbytes(region)
    if (have < nbytes) if writable else (have != nbytes):
        need = "at least " if writable else ""
        raise BufferSpecError(
            f"{what} has {have} bytes; {need}{nbytes} are needed (blocks x block_tokens x "
            "kv_heads x head_dim x dtype bytes)"
        )
    return region


def device_event(region: Region) -> Any:
    """A CUDA event marking the caller's current stream, so a copy on another
    stream waits for the kernels that produced (or will read) ``region``."""
    if not region_is_device(region):
        return None
    import torch

    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(region.device))
    return event


class SideStream:
    """A CUDA stream per worker thread, so background copies never queue
    behind the caller's compute on its stream; a no-op without CUDA buffers."""

    def __init__(self) -> None:
        self._streams: dict[Any, Any] = {}

    def enter(self, region: Region, event: Any) -> Any:
        """Context manager making the side stream current (after ``event``)."""
        import contextlib

        if not region_is_device(region):
            return contextlib.nullcontext()
        import torch

        stream = self._streams.get(region.device)
        if stream is None:
            stream = self._streams[region.device] = torch.cuda.Stream(region.device)
        if event is not None:
            stream.wait_event(event)
        return torch.cuda.stream(stream)

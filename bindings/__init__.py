"""Zero-copy adapters for numpy / torch / cupy buffers (installed as ``kvpool.bindings``)."""

from kvpool.bindings.buffers import (
    as_region,
    copy_region,
    copy_region_out,
    host_view,
    is_device,
    region_is_device,
    region_nbytes,
)

__all__ = [
    "as_region",
    "copy_region",
    "copy_region_out",
    "host_view",
    "is_device",
    "region_is_device",
    "region_nbytes",
]

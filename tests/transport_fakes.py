"""A fake one-sided transport for tests of the writer's bracket (claim, copy, seal)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from kvpool.transport.base import RegionInfo, Transport


class OneSided(Transport):
    """Writes straight into the node's region (what a shared-memory copy does)."""

    name = "one-sided"

    def __init__(self, info: RegionInfo, region: np.ndarray) -> None:
        super().__init__(info)
        self.region = region

    def read_into(self, offset: int, out: Any) -> None:
        out[:] = self.region[offset : offset + out.nbytes]

    def write(self, offset: int, data: Any) -> None:
        self.region[offset : offset + data.nbytes] = data

    def write_many(self, items: Sequence[tuple[int, Any]]) -> None:
        for offset, data in items:
            self.write(offset, data)

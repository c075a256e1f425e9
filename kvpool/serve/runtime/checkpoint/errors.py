"""The one error of checkpoint loading."""

from __future__ import annotations


class CheckpointError(ValueError):
    """The directory is not a checkpoint this runtime can serve exactly (says why).

    A ``ValueError``, so ``kvpool serve`` prints it as one line and exits 1."""

"""Workloads: request traces (format, synthesis, token ids), the offline cache
simulator, and the ``kvpool trace``, ``kvpool cachesim`` and ``kvpool demo`` commands."""

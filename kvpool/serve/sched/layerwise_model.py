"""Layer-wise KV streaming: how much of a KV transfer is left when prefill ends.

The runtime stores a prefill's KV layer by layer while the next layers
compute (``kvpool.layerwise.LayerWriter``; ``kvpool bench layerwise``), as
the paper's prefill nodes do. With ``L`` layers, compute ``C`` seconds in
all (``C / L`` per layer) and a transfer of ``T`` seconds in all (``T / L``
per layer, a layer's transfer starting when both its compute and the
previous layer's transfer are done), the last transfer ends after the
prefill by::

    remaining(T, C, L) = T / L + max(0, T - C) * (L - 1) / L

- transfer faster than compute (``T <= C``): only the last layer's share
  ``T / L`` is left;
- transfer slower: the transfers queue up behind the first layer and the
  part that exceeds compute is left as well (``T = C`` gives ``T / L``;
  ``C = 0`` gives ``T``, the unstreamed case).

``overhead_s`` per layer is the runtime's cost of handing one layer to the
writer (a queue hand-off and a call per layer); it lengthens the transfer
side to ``T + L * overhead_s``. ``fit_layer_overhead`` recovers it from one
``kvpool bench layerwise`` result (its ``layers``, ``compute_s``,
``store_s`` and ``overlapped_s``): ``overlapped_s - compute_s`` is the
measured ``remaining``, solved for ``overhead_s`` with the formula above.
Calibration (bench/RESULTS.md "Layer-wise store and load", 32 layers of
16 MiB, quiet runs; compute / transfer alone / overlapped, in ms):

| run | C | T | overlapped | fitted overhead | formula at 15 us |
|---|---:|---:|---:|---:|---:|
| embedded store | 27.6 | 28.6 | 29.9 | 13.7 us | 29.94 |
| embedded store (rerun) | 29.2 | 30.3 | 31.7 | 15.2 us | 31.69 |
| embedded load | 27.8 | 31.0 | 32.1 | 7.2 us | 32.35 |
| distributed (shm) store | 28.7 | 32.9 | 33.6 | 0 | 34.28 |

``DEFAULT_LAYER_OVERHEAD_S`` is 15 us (the embedded store runs); the
formula then reproduces every run within 0.7 ms of ~30 (2 %), erring long.
On the simulator's 80-layer llama2-70b that is 1.2 ms per prefill, next to
a 100k-token prompt's ~0.3 s transfer: streaming, not the overhead, decides.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

#: Per-layer hand-off cost measured on the runtime's layer-wise writer (see the module doc).
DEFAULT_LAYER_OVERHEAD_S = 15e-6


def remaining_transfer(
    transfer_s: float, compute_s: float, layers: int, overhead_s: float = 0.0
) -> float:
    """Seconds of KV transfer left after a prefill of ``compute_s`` that streams
    ``transfer_s`` of KV over ``layers`` layers (``layers <= 1``: nothing overlaps)."""
    if transfer_s <= 0:
        return 0.0
    if layers <= 1:
        return transfer_s + max(0.0, overhead_s)
    t = transfer_s + layers * max(0.0, overhead_s)
    c = max(0.0, compute_s)
    return t / layers + max(0.0, t - c) * (layers - 1) / layers


def fit_layer_overhead(layers: int, compute_s: float, store_s: float, overlapped_s: float) -> float:
    """Per-layer overhead (>= 0) that makes ``remaining_transfer`` match one measurement."""
    if layers < 2:
        raise ValueError("need a layer-wise measurement over at least 2 layers")
    measured = overlapped_s - compute_s
    lo, hi = 0.0, max(store_s, compute_s, 1e-9) / layers
    if remaining_transfer(store_s, compute_s, layers, 0.0) >= measured:
        return 0.0
    while remaining_transfer(store_s, compute_s, layers, hi) < measured:
        hi *= 2
    for _ in range(60):  # remaining is increasing in the overhead: bisect
        mid = (lo + hi) / 2
        if remaining_transfer(store_s, compute_s, layers, mid) < measured:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def overhead_from_bench(result: Mapping[str, Any]) -> float:
    """``fit_layer_overhead`` over a ``kvpool bench layerwise --json`` result."""
    try:
        return fit_layer_overhead(
            int(result["layers"]),
            float(result["compute_s"]),
            float(result["store_s"]),
            float(result["overlapped_s"]),
        )
    except KeyError as exc:
        raise ValueError(f"not a kvpool bench layerwise result: missing {exc.args[0]!r}") from None

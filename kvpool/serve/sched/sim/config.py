"""The simulator's configuration (``SimConfig``), state records and event kinds."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvpool.serve.sched.admission import normalize_rejection
from kvpool.serve.sched.conductor import ROUTE_FNS, SLO
from kvpool.serve.sched.cost_model import get_hardware
from kvpool.serve.sched.layerwise_model import DEFAULT_LAYER_OVERHEAD_S
from kvpool.serve.sched.sim.decode_engine import DecodeEngine

#: Event kinds of the simulator's heap, in tie-break order at equal times.
ARRIVAL, PREFILL_DONE, DECODE_JOIN, WAKE = 0, 1, 2, 3


@dataclass
class SimConfig:
    prefill: int = 10
    decode: int = 10
    coupled: int = 0  # > 0: N coupled nodes instead of P + D
    speed: float = 1.0  # arrival rate multiplier
    router: str = "conductor"
    rejection: str = "none"
    capacity_blocks: int = 8192  # per node (DRAM share of the pool), in blocks
    policy: str = "lru"
    slo: SLO = field(default_factory=SLO)
    balance_threshold: float = 0.8
    decode_headroom: float = 0.9  # admission aims at this share of the decode capacity
    seed: int = 0
    model: str = "llama2-70b"
    block_tokens: int = 512
    cpp_group: int = 1  # pipeline prefill across k nodes (sim.cpp.CppCluster)
    hardware: str = "h100"  # node preset (cost_model.HARDWARE)
    layerwise: bool = True  # KV streams to decode layer by layer during prefill
    layer_overhead_s: float = DEFAULT_LAYER_OVERHEAD_S  # per layer (layerwise_model)
    load_sample_s: float = 0.0  # > 0: sample prefill/decode load this often (load_series)

    def validate(self) -> None:
        if self.coupled < 0 or self.prefill < 0 or self.decode < 0:
            raise ValueError("node counts must be >= 0")
        if self.coupled == 0 and (self.prefill < 1 or self.decode < 1):
            raise ValueError("need --prefill >= 1 and --decode >= 1 (or --coupled N)")
        if self.speed <= 0:
            raise ValueError("speed must be > 0")
        if self.router not in ROUTE_FNS:
            raise ValueError(f"unknown router {self.router!r}; choose from {sorted(ROUTE_FNS)}")
        normalize_rejection(self.rejection)
        get_hardware(self.hardware)
        if self.load_sample_s < 0:
            raise ValueError("load_sample_s must be >= 0")
        if self.layer_overhead_s < 0:
            raise ValueError("layer_overhead_s must be >= 0")
        if self.capacity_blocks < 0:
            raise ValueError("capacity_blocks must be >= 0")
        if not 0.0 < self.decode_headroom <= 1.0:
            raise ValueError("decode_headroom must be in (0, 1]")
        if self.cpp_group != 1:
            raise ValueError(
                "cpp_group > 1: use simulate() (kvpool.serve.sched.sim.cpp.CppCluster)"
            )


@dataclass
class Node:
    name: str
    cache: Any  # an EvictionPolicy
    busy_until: float = 0.0  # prefill FIFO (disaggregated prefill nodes)
    engine: DecodeEngine | None = None


@dataclass
class Req:
    arrival: float
    input: int
    output: int
    keys: list[bytes]
    ttft_slo: float = 0.0
    tbt_slo: float = 0.0
    prefill_node: int = -1
    decode_node: int = -1
    prefill_s: float = 0.0  # on the prefill node: prefix fetch + compute
    compute_s: float = 0.0  # the compute alone (the layer-wise overlap window)
    first_token: float = -1.0
    join_step: int = -1
    join_context: int = 0
    ready: float = 0.0  # KV arrived at the decode node
    end: float = -1.0
    rejected: str | None = None
    tbt_ok: bool = True
    mean_tbt: float = 0.0
    reused_blocks: int = 0
    weight: float = 0.0  # admission weight: prompt + mean reply tokens (KV at decode)

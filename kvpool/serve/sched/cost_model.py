"""Cost models the conductor and the simulator predict with.

``PrefillCostModel``: seconds to prefill ``new`` tokens after ``cached``
reused ones::

    t = c0 + c_token * new + c_pair * pairs(new, cached) + c_cached * cached
    pairs(new, cached) = new * cached + new * (new + 1) / 2

``c_token`` is the per-token linear work (every projection and the MLP),
``c_pair`` the attention work per (query, key) pair (quadratic in the prompt
length, causal), ``c_cached`` the per-token cost of loading a reused prefix
and ``c0`` a fixed per-request overhead. The same features come out of
``ModelConfig.prefill_flops``, so the fit and the analytic model share one form.

Two ways to get one:

- ``fit_prefill(samples)``: least squares over measured (new, cached,
  seconds) samples with non-negative coefficients (``kvpool calibrate``
  times the real ``PrefillWorker`` over a grid and writes the JSON that
  ``PrefillCostModel.load`` reads);
- ``analytic_cluster(...)``: the llama2-70b shape on 8-GPU nodes for the
  simulator, from the preset's FLOPs and bytes and the hardware constants
  below.

``TransferModel``: seconds to move KV between nodes (latency + bytes /
bandwidth). ``DecodeCostModel``: seconds of one continuous-batching step,
linear in the batch size and the batch's total context (memory-bound:
weights once, every request's KV).

Hardware constants (``HardwareSpec`` defaults, H100 SXM 80 GB class; all
public datasheet figures; ``A800`` is the paper's testbed class, ``HARDWARE``
names both for ``--hardware``):

- peak dense BF16 tensor FLOPs: 989 TFLOP/s per GPU (NVIDIA H100 SXM
  datasheet; A100 SXM: 312);
- HBM bandwidth: 3.35 TB/s per GPU (H100 SXM datasheet; A100 80 GB: 2.04),
  80 GB per GPU;
- MFU 0.5 for prefill (large-batch GEMMs reach 40–60 % on H100; Megatron-LM
  and vLLM/SGLang reports), memory-bandwidth utilisation 0.7 for decode;
- KV transfer between nodes: 8 x 100 Gb/s RDMA NICs = 100 GB/s per node
  (Mooncake's testbed class; DGX H100 has 8 x 400 Gb/s, so this is
  conservative); 50 us latency per transfer;
- 8 GPUs per node, tensor parallel inside the node (NVLink), so a node acts
  as one device with 8x the FLOPs, bandwidth and memory.

FLOPs per token come from the preset (``ModelConfig.prefill_flops``: 2 x
matmul parameters per token + 4 x layers x heads x head_dim per attention
pair); KV bytes per token from ``kv_bytes_per_token`` (327,680 B for 70B).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from kvpool.serve.sched.presets import ModelConfig, get_preset

FEATURES = ("c0", "c_token", "c_pair", "c_cached")


def attention_pairs(new: float, cached: float) -> float:
    """(query, key) pairs of a causal prefill of ``new`` tokens after ``cached``."""
    return new * cached + new * (new + 1) / 2


@dataclass
class PrefillCostModel:
    """Prefill seconds as a quadratic in the prompt length (see the module doc)."""

    c0: float = 0.0
    c_token: float = 0.0
    c_pair: float = 0.0
    c_cached: float = 0.0
    model: str = ""
    source: str = ""
    meta: dict[str, Any] = field(default_factory=dict)

    def predict(self, new: int, cached: int = 0) -> float:
        """Seconds to prefill ``new`` tokens after ``cached`` reused ones."""
        new = max(int(new), 0)
        cached = max(int(cached), 0)
        return (
            self.c0
            + self.c_token * new
            + self.c_pair * attention_pairs(new, cached)
            + self.c_cached * cached
        )

    def unloaded_ttft(self, prompt_tokens: int) -> float:
        """TTFT of the prompt alone on an idle worker with nothing cached (the SLO's unit)."""
        return self.predict(prompt_tokens, 0)

    def coefficients(self) -> list[float]:
        return [self.c0, self.c_token, self.c_pair, self.c_cached]

    # -- JSON --------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return {"kind": "prefill-quadratic", **asdict(self)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PrefillCostModel:
        return cls(
            c0=float(d.get("c0", 0.0)),
            c_token=float(d.get("c_token", 0.0)),
            c_pair=float(d.get("c_pair", 0.0)),
            c_cached=float(d.get("c_cached", 0.0)),
            model=str(d.get("model", "")),
            source=str(d.get("source", "")),
            meta=dict(d.get("meta", {})),
        )

    def save(self, path: str | os.PathLike[str]) -> None:
        with open(path, "w", encoding="utf-8") as fh:
            json.dump(self.to_dict(), fh, indent=2)
            fh.write("\n")

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> PrefillCostModel:
        with open(path, encoding="utf-8") as fh:
            d = json.load(fh)
        # a calibration file holds the model under "prefill" next to its samples
        return cls.from_dict(d.get("prefill", d))


def _features(new: float, cached: float) -> list[float]:
    return [1.0, float(new), attention_pairs(new, cached), float(cached)]


def fit_prefill(
    samples: Iterable[tuple[int, int, float]], model: str = "", source: str = "fit"
) -> PrefillCostModel:
    """Least-squares fit with non-negative coefficients over (new, cached, seconds).

    Relative least squares (each row divided by its time), so short and long
    prompts weigh alike; coefficients that come out negative are dropped and
    the rest refitted (a small active-set NNLS, enough for four features).
    Features that the samples never vary (e.g. no cached samples) stay zero.
    """
    rows = [(n, c, t) for n, c, t in samples if t > 0]
    if len(rows) < 2:
        raise ValueError("need at least two timed samples to fit a cost model")
    x = np.array([_features(n, c) for n, c, _ in rows], dtype=float)
    y = np.array([t for _, _, t in rows], dtype=float)
    w = 1.0 / y
    xw, yw = x * w[:, None], y * w
    active = [j for j in range(x.shape[1]) if np.any(x[:, j] != x[0, j]) or j == 0]
    coef = np.zeros(x.shape[1])
    while active:
        sol, *_ = np.linalg.lstsq(xw[:, active], yw, rcond=None)
        if np.all(sol >= 0):
            coef[:] = 0.0
            coef[active] = sol
            break
        active = [j for j, v in zip(active, sol, strict=True) if v >= 0]
    pred = x @ coef
    rel = np.abs(pred - y) / y
    c0, c_token, c_pair, c_cached = (float(v) for v in coef)
    return PrefillCostModel(
        c0=c0,
        c_token=c_token,
        c_pair=c_pair,
        c_cached=c_cached,
        model=model,
        source=source,
        meta={
            "samples": len(rows),
            "mean_rel_error": float(rel.mean()),
            "max_rel_error": float(rel.max()),
        },
    )


@dataclass
class TransferModel:
    """Seconds to move KV: ``latency_s + bytes / bandwidth_Bps``."""

    bandwidth_Bps: float = 100e9
    latency_s: float = 50e-6

    def seconds(self, nbytes: float) -> float:
        if nbytes <= 0:
            return 0.0
        return self.latency_s + nbytes / self.bandwidth_Bps


@dataclass
class DecodeCostModel:
    """One decode step: ``base_s + per_request_s * batch + per_token_s * total_context``.

    ``base_s``: reading the weights once (memory-bound); ``per_token_s``:
    reading one token's KV; ``per_request_s``: a request's share of compute.
    ``kv_capacity_tokens``: KV the node's HBM holds next to the weights.
    """

    base_s: float
    per_request_s: float
    per_token_s: float
    kv_capacity_tokens: int

    def step_seconds(self, batch: int, total_context: int) -> float:
        if batch <= 0:
            return 0.0
        return self.base_s + self.per_request_s * batch + self.per_token_s * total_context

    def unloaded_tbt(self, context: int) -> float:
        """A step with this request alone (the TBT SLO's unit)."""
        return self.step_seconds(1, context)


@dataclass(frozen=True)
class HardwareSpec:
    """One serving node (see the module doc for the sources)."""

    gpus: int = 8
    peak_flops: float = 989e12  # BF16 dense per GPU (H100 SXM)
    hbm_Bps: float = 3.35e12  # per GPU (H100 SXM)
    hbm_bytes: float = 80e9  # per GPU
    mfu: float = 0.5  # prefill model-FLOPs utilisation
    mbu: float = 0.7  # decode memory-bandwidth utilisation
    net_Bps: float = 100e9  # KV transfer between nodes (8 x 100 Gb/s RDMA)
    net_latency_s: float = 50e-6
    prefill_overhead_s: float = 0.005  # scheduling, kernel launches, first-token sampling
    kv_memory_fraction: float = 0.9  # of HBM left after weights, usable for KV


A100 = HardwareSpec(peak_flops=312e12, hbm_Bps=2.04e12)
H100 = HardwareSpec()
#: The paper's testbed class (Mooncake, arXiv 2407.00079, section 8): nodes of
#: 8 x A800-SXM4-80GB (A100 silicon: 312 TFLOP/s dense BF16, 2.039 TB/s HBM2e,
#: 80 GB; only NVLink is cut to 400 GB/s, which tensor parallelism inside the
#: node hides at this model size) with 4 x 200 Gb/s RDMA NICs = 100 GB/s.
A800 = HardwareSpec(peak_flops=312e12, hbm_Bps=2.039e12, net_Bps=4 * 200e9 / 8)
#: ``--hardware`` names (``kvpool sim``, ``kvpool plan``).
HARDWARE: dict[str, HardwareSpec] = {"h100": H100, "a800": A800}


def get_hardware(name: str) -> HardwareSpec:
    """The named node preset; ValueError on unknown names."""
    try:
        return HARDWARE[name]
    except KeyError:
        raise ValueError(
            f"unknown hardware preset {name!r}; choose from {', '.join(sorted(HARDWARE))}"
        ) from None


@dataclass
class ClusterCostModel:
    """Everything the simulator needs for one model on one node type."""

    config: ModelConfig
    hardware: HardwareSpec
    prefill: PrefillCostModel
    decode: DecodeCostModel
    transfer: TransferModel

    @property
    def block_bytes(self) -> int:
        return self.config.kv_bytes_per_token * self.config.block_tokens

    def kv_transfer_seconds(self, tokens: int) -> float:
        return self.transfer.seconds(tokens * self.config.kv_bytes_per_token)

    def describe(self) -> dict[str, Any]:
        return {
            "model": self.config.name,
            "hardware": asdict(self.hardware),
            "prefill": self.prefill.to_dict(),
            "decode": asdict(self.decode),
            "transfer": asdict(self.transfer),
        }


def analytic_prefill(cfg: ModelConfig, hw: HardwareSpec = H100) -> PrefillCostModel:
    """Prefill seconds from the preset's FLOPs at ``mfu`` of the node's peak."""
    flops = hw.gpus * hw.peak_flops * hw.mfu
    # loading a reused prefix: its KV from host DRAM into HBM over PCIe-class
    # links, overlapped layer by layer with compute; charge it at the network rate
    return PrefillCostModel(
        c0=hw.prefill_overhead_s,
        c_token=2 * cfg.matmul_params() / flops,
        c_pair=cfg.attention_flops_per_pair() / flops,
        c_cached=0.0,
        model=cfg.name,
        source=f"analytic: {hw.gpus} GPUs x {hw.peak_flops / 1e12:g} TFLOP/s x MFU {hw.mfu}",
    )


def analytic_decode(cfg: ModelConfig, hw: HardwareSpec = H100) -> DecodeCostModel:
    bw = hw.gpus * hw.hbm_Bps * hw.mbu
    flops = hw.gpus * hw.peak_flops * hw.mfu
    kv_room = hw.gpus * hw.hbm_bytes * hw.kv_memory_fraction - cfg.weight_bytes()
    if kv_room <= 0:
        raise ValueError(f"{cfg.name} weights do not fit {hw.gpus} GPUs")
    return DecodeCostModel(
        base_s=cfg.weight_bytes() / bw,
        per_request_s=2 * cfg.matmul_params() / flops,
        per_token_s=cfg.kv_bytes_per_token / bw,
        kv_capacity_tokens=int(kv_room // cfg.kv_bytes_per_token),
    )


def analytic_cluster(
    model: str | ModelConfig = "llama2-70b",
    hw: HardwareSpec = H100,
    block_tokens: int = 512,
) -> ClusterCostModel:
    """The simulator's cost model: ``model`` on ``hw.gpus``-GPU nodes."""
    cfg = get_preset(model) if isinstance(model, str) else model
    if cfg.block_tokens != block_tokens:
        cfg = cfg.with_block_tokens(block_tokens)
    return ClusterCostModel(
        config=cfg,
        hardware=hw,
        prefill=analytic_prefill(cfg, hw),
        decode=analytic_decode(cfg, hw),
        transfer=TransferModel(hw.net_Bps, hw.net_latency_s),
    )


def grid(max_tokens: int, points: int = 6, block: int = 1) -> list[int]:
    """About ``points`` lengths up to ``max_tokens``, multiples of ``block``."""
    out = sorted(
        {max(block, round(max_tokens * (i + 1) / points / block) * block) for i in range(points)}
    )
    return [v for v in out if v <= max_tokens]


def summarize_fit(model: PrefillCostModel, samples: Sequence[tuple[int, int, float]]) -> str:
    lines = [
        f"prefill model {model.model or '?'}: t = {model.c0 * 1e3:.3f} ms"
        f" + {model.c_token * 1e6:.3f} us/token"
        f" + {model.c_pair * 1e9:.4f} ns/pair + {model.c_cached * 1e6:.3f} us/cached token",
        f"{'new':>7} {'cached':>7} {'measured ms':>12} {'model ms':>9} {'err':>6}",
    ]
    for n, c, t in samples:
        p = model.predict(n, c)
        err = (p - t) / t if t else math.nan
        lines.append(f"{n:>7} {c:>7} {t * 1e3:>12.2f} {p * 1e3:>9.2f} {err:>+6.0%}")
    return "\n".join(lines)

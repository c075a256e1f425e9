"""``KVPoolConnector``: vLLM v1's KV connector API on top of a kvpool store.

Loaded out of tree::

    --kv-transfer-config '{"kv_connector": "KVPoolConnector",
        "kv_connector_module_path": "kvpool.bindings.vllm",
        "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"url": "kvpool://HOST:PORT"}}'

``kv_role``: ``kv_both`` loads hits and saves new blocks, ``kv_producer``
only saves (a prefill instance), ``kv_consumer`` only loads (a decode
instance). Extra config: ``url`` or ``embedded`` and the connection options
of ``kvpool.bindings.engine_store``; ``block_tokens`` (512); ``model_id``
(default: the model's name and a digest of its config); ``load_timeout_s``
(30) and ``save_timeout_s`` (60).

vLLM makes one instance with the SCHEDULER role (``SchedulerPlan``: matching
and planning) and one per worker with the WORKER role (``WorkerTransfers``:
the bytes); the plan travels to the workers as ``KVPoolMetadata`` each step.
Loads are synchronous from vLLM's point of view (they complete inside the
step that needs them) but layer-wise inside it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from kvpool.bindings.engine_store import StoreConfig, StoreHandle
from kvpool.bindings.vllm.counters import Counters, CounterSink
from kvpool.bindings.vllm.geometry import Geometry, geometry_from_vllm
from kvpool.bindings.vllm.plan import LoadOp, SaveOp, SchedulerPlan
from kvpool.bindings.vllm.worker import (
    DEFAULT_LOAD_TIMEOUT_S,
    DEFAULT_SAVE_TIMEOUT_S,
    WorkerTransfers,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request


@dataclass
class KVPoolMetadata(KVConnectorMetadata):
    """One step's plan, scheduler -> workers (plain data: it is pickled)."""

    loads: list[LoadOp] = field(default_factory=list)
    saves: list[SaveOp] = field(default_factory=list)


class KVPoolConnectorStats(KVConnectorStats):
    """``Counters`` in vLLM's stats envelope: summed across workers and steps."""

    data: dict[str, Any]

    def reset(self) -> None:
        self.data.clear()

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        total = Counters()
        total.add(self.data)
        total.add(other.data)
        self.data = total.to_dict()
        return self

    def reduce(self) -> dict[str, int | float]:
        counters = Counters()
        counters.add(self.data)
        out: dict[str, int | float] = dict(counters.to_dict())
        if counters.load_s > 0:
            out["load_GBps"] = counters.loaded_bytes / counters.load_s / 1e9
            out["load_overlap"] = max(0.0, 1.0 - counters.load_wait_s / counters.load_s)
        return out

    def is_empty(self) -> bool:
        counters = Counters()
        counters.add(self.data)
        return counters.is_empty()


class KVPoolConnector(KVConnectorBase_V1):
    """vLLM v1 KV connector backed by a kvpool store (embedded or cluster)."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        if kv_cache_config is None:
            raise ValueError(
                "KVPoolConnector needs the KV cache config vLLM passes to v1 connectors "
                "(vLLM 0.32 or compatible)"
            )
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        transfer = vllm_config.kv_transfer_config
        extra = dict(transfer.kv_connector_extra_config or {})
        store_config = StoreConfig.from_extra(extra, owner="KVPoolConnector")
        if store_config.embedded is not None:
            _check_single_process(vllm_config)
        self._store = StoreHandle(store_config)
        self._store.get()  # connect (or make the embedded pool) now, not on the first request
        self._geometry = geometry_from_vllm(vllm_config, kv_cache_config, extra)
        self._counters = CounterSink()
        self._plan: SchedulerPlan | None = None
        self._worker: WorkerTransfers | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._plan = SchedulerPlan(
                self._geometry,
                self._store,
                load=bool(transfer.is_kv_consumer),
                save=bool(transfer.is_kv_producer),
            )
        else:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            self._worker = WorkerTransfers(
                self._geometry,
                self._store,
                self._counters,
                tp_rank=get_tensor_model_parallel_rank(),
                load_timeout_s=float(extra.get("load_timeout_s", DEFAULT_LOAD_TIMEOUT_S)),
                save_timeout_s=float(extra.get("save_timeout_s", DEFAULT_SAVE_TIMEOUT_S)),
            )
        self._num_blocks = int(kv_cache_config.num_blocks)

    @property
    def geometry(self) -> Geometry:
        """Page sizes and the key namespace (what another process needs to find the blocks)."""
        return self._geometry

    @property
    def requires_kv_delivery(self) -> bool:
        # Saves complete inside the step (wait_for_save): nothing is pending
        # when a request is preempted, and a dropped save is only a future miss.
        return False

    # -- worker side --------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        self._worker.register(kv_caches, self._num_blocks)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        assert self._worker is not None
        self._worker.start_load(self._meta().loads)

    def wait_for_layer_load(self, layer_name: str) -> None:
        assert self._worker is not None
        self._worker.wait_layer(layer_name)

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        assert self._worker is not None
        self._worker.save_layer(layer_name, kv_layer, self._meta().saves)

    def wait_for_save(self) -> None:
        assert self._worker is not None
        if self.has_connector_metadata():
            self._worker.finish_saves(self._meta().saves)

    def get_block_ids_with_load_errors(self) -> set[int]:
        assert self._worker is not None
        return self._worker.take_failed()

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        counters = self._counters.take()
        return None if counters.is_empty() else KVPoolConnectorStats(data=counters.to_dict())

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats:
        return KVPoolConnectorStats(data=dict(data or {}))

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
        self._store.close()

    # -- scheduler side -----------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        assert self._plan is not None
        return self._plan.matched_tokens(request, num_computed_tokens), False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        assert self._plan is not None
        self._plan.allocated(request, num_external_tokens)
        if num_external_tokens > 0:
            self._counters.add(hit_tokens=num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self._plan is not None
        loads, saves = self._plan.build(scheduler_output)
        return KVPoolMetadata(loads=loads, saves=saves)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        assert self._plan is not None
        self._plan.finished(request.request_id)
        return False, None

    # -- helpers ------------------------------------------------------------------

    def _meta(self) -> KVPoolMetadata:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVPoolMetadata)
        return meta


def _check_single_process(vllm_config: Any) -> None:
    """An embedded pool lives in one process: vLLM's scheduler and worker must share it."""
    from vllm import envs

    backend = vllm_config.parallel_config.distributed_executor_backend
    if envs.VLLM_ENABLE_V1_MULTIPROCESSING or backend not in (None, "uni"):
        raise ValueError(
            "KVPoolConnector: an 'embedded' pool needs vLLM in one process "
            "(VLLM_ENABLE_V1_MULTIPROCESSING=0 and distributed_executor_backend='uni'); "
            "with several processes run a cluster (kvpool master/node) and give its 'url'"
        )

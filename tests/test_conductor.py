"""Conductor: minimum-TTFT routing, fetch-vs-recompute threshold, admission policies."""

from __future__ import annotations

import random

import pytest

from kvpool.serve.sched.admission import (
    AdmissionState,
    DecodeLoadPredictor,
    admit_decode,
    decode_capacity,
    normalize_rejection,
)
from kvpool.serve.sched.conductor import (
    SLO,
    Conductor,
    WorkerView,
    prefix_by_node,
    route_cache_only,
    route_least_loaded,
    route_random,
)
from kvpool.serve.sched.conductor_router import ConductorRouter
from kvpool.serve.sched.cost_model import DecodeCostModel, PrefillCostModel, TransferModel
from kvpool.serve.sched.router_api import (
    DECODE,
    PREFILL,
    Observation,
    Router,
    RouterContext,
    WorkerState,
)
from kvpool.serve.sched.routing import make_router

BT = 100


def make(threshold: float = 0.8, bandwidth: float = 1e12) -> Conductor:
    # 1 ms per token, no attention term: prefill(new) = new ms
    model = PrefillCostModel(c0=0.0, c_token=1e-3)
    return Conductor(
        model,
        block_tokens=BT,
        kv_bytes_per_token=1000,
        transfer=TransferModel(bandwidth, 0.0),
        decode=DecodeCostModel(0.01, 0.0, 1e-6, 10_000),
        slo=SLO(ttft_mult=2.0, tbt_mult=5.0),
        balance_threshold=threshold,
    )


def test_picks_minimum_ttft_worker() -> None:
    c = make(bandwidth=1e6)  # 9 blocks of 100 KB: 0.9 s, so a gains nothing by fetching
    workers = [
        WorkerView("a", queue_s=0.0, local_blocks=0, node="a"),  # 1.0 s compute
        WorkerView("b", queue_s=0.5, local_blocks=9, node="b"),  # 0.5 + 0.1
        WorkerView("c", queue_s=0.2, local_blocks=8, node="c"),  # 0.2 + 0.2 (own prefix 8/9)
    ]
    plans = c.plans(1000, workers)
    best = c.choose(1000, workers)
    assert best.ttft_s == min(p.ttft_s for p in plans)
    assert best.worker_id == "c"
    assert best.fetch_from is None and best.reused_blocks == 8
    assert best.ttft_s == pytest.approx(0.4)
    # with a fast network, a fetches b's 9 blocks and wins: 0.1 s of compute
    fast = make().choose(1000, workers)
    assert fast.worker_id == "a" and fast.fetch_from == "b" and fast.reused_blocks == 9


def test_fetch_vs_recompute_threshold() -> None:
    w_local = WorkerView("a", queue_s=0.0, local_blocks=4, node="a")
    w_best = WorkerView("b", queue_s=10.0, local_blocks=10, node="b")
    # own prefix 4 < 0.8 * 10: fetch the best prefix from b
    plan = make(0.8).plan(w_local, 1100, 10, "b")
    assert plan.fetch_from == "b" and plan.reused_blocks == 10 and plan.fetch_blocks == 6
    assert plan.transfer_s > 0 and plan.prefill_s == pytest.approx(0.1)
    # own prefix 4 >= 0.3 * 10: recompute the rest locally
    plan = make(0.3).plan(w_local, 1100, 10, "b")
    assert plan.fetch_from is None and plan.reused_blocks == 4
    assert plan.prefill_s == pytest.approx(0.7)
    # fetch not worth it when the transfer costs more than the compute it saves
    slow = make(0.8, bandwidth=1e5)  # 6 blocks x 100 KB at 100 KB/s = 6 s > 0.6 s saved
    assert slow.plan(w_local, 1100, 10, "b").fetch_from is None
    # the chosen route over both workers fetches to a, not b with its long queue
    best = make(0.8).choose(1100, [w_local, w_best])
    assert best.worker_id == "a" and best.fetch_from == "b"


def test_reusable_blocks_leave_one_token() -> None:
    c = make()
    assert c.reusable_blocks(1000, 10) == 9  # a fully cached prompt recomputes its last block
    assert c.reusable_blocks(1050, 10) == 10
    assert c.reusable_blocks(1050, 99) == 10


def test_ttft_slo_is_multiple_of_unloaded() -> None:
    c = make()
    assert c.ttft_slo(1000) == pytest.approx(2.0)
    plan = c.choose(1000, [WorkerView("a", 1.5, 0)])
    assert not c.meets_ttft(plan, 1000)  # 2.5 s > 2 s
    plan = c.choose(1000, [WorkerView("a", 0.5, 0)])
    assert c.meets_ttft(plan, 1000)
    assert c.tbt_slo(1000) == pytest.approx(5 * (0.01 + 1000e-6))


def test_baseline_routers() -> None:
    c = make()
    ws = [WorkerView("a", 0.3, 5), WorkerView("b", 0.1, 0), WorkerView("c", 0.2, 7)]
    rng = random.Random(0)
    assert route_least_loaded(c, 1000, ws, rng).worker_id == "b"
    assert route_cache_only(c, 1000, ws, rng).worker_id == "c"
    picks = {route_random(c, 1000, ws, rng).worker_id for _ in range(50)}
    assert picks == {"a", "b", "c"}
    assert all(route_random(c, 1000, ws, rng).fetch_from is None for _ in range(5))


@pytest.mark.parametrize(
    ("policy", "load_now", "predicted", "at_arrival", "rejects"),
    [
        ("none", 100, 100, True, False),
        ("none", 100, 100, False, False),
        ("now", 10, 100, True, True),  # at capacity now
        ("now", 5, 100, True, False),
        ("early", 10, 0, True, True),  # alias of now
        ("now", 100, 0, False, False),  # never after prefill
        ("predicted", 100, 5, True, False),  # full now, free by the time prefill ends
        ("predicted", 0, 10, True, True),  # free now, full by then
        ("predicted", 100, 100, False, False),
        ("after", 100, 100, True, False),  # never at arrival
        ("after", 10, 0, False, True),
        ("after", 5, 0, False, False),
    ],
)
def test_rejection_policies(
    policy: str, load_now: int, predicted: int, at_arrival: bool, rejects: bool
) -> None:
    state = AdmissionState(load_now=load_now, capacity=10, predicted_load=predicted)
    reason = admit_decode(policy, state, at_arrival=at_arrival)
    assert (reason is not None) == rejects


def test_unknown_rejection_policy() -> None:
    assert normalize_rejection("early") == "now"
    with pytest.raises(ValueError):
        normalize_rejection("sometimes")


def test_decode_load_predictor_projects_forward() -> None:
    p = DecodeLoadPredictor(decode_s=10.0)
    for rid, t in enumerate([0.0, 1.0, 2.0, 3.0]):
        p.start(rid, t)  # decoding since t, predicted to end at t + 10
    p.add(10, 12.5)  # in prefill, decode predicted to start at 12.5
    # now = 5, 4 decoding: by t = 11.5 two finish (ends 10, 11), none pending yet
    assert p.predict(5.0, 11.5, load_now=4) == 2
    # by 12.5 a third finishes and the pending one starts
    assert p.predict(5.0, 12.5, load_now=4) == 2
    assert p.predict(5.0, 5.0, load_now=4) == 4
    p.remove(0)
    assert len(p) == 4
    p.observe(20.0)
    assert p.decode_s == pytest.approx(15.0)


def test_decode_capacity() -> None:
    d = DecodeCostModel(
        base_s=0.01, per_request_s=0.0, per_token_s=1e-6, kv_capacity_tokens=100_000
    )
    # memory: 100 per node at 1000 tokens; TBT 0.05 s: (0.05 - 0.01) / 1e-3 = 40
    assert decode_capacity(d, 2, 1000, 0.05) == 80
    assert decode_capacity(d, 2, 1000, 1.0) == 200
    assert decode_capacity(d, 0, 1000, 1.0) == 0


def test_prefix_by_node() -> None:
    locs = [["n1", "n2"], ["n1", "n2"], ["n2"], ["n1", "n2"], []]
    assert prefix_by_node(locs) == {"n1": 2, "n2": 4}
    assert prefix_by_node([]) == {}


def test_router_protocol_with_fake_pool() -> None:
    class FakePool:
        def __init__(self) -> None:
            self.replicated: list[tuple[int, str | None]] = []

        def locate(self, keys: list[bytes]) -> list[list[str]]:
            return [["nb"] if i < 8 else [] for i in range(len(keys))]

        def replicate(self, keys: list[bytes], node: str | None = None) -> int:
            self.replicated.append((len(keys), node))
            return len(keys)

    pool = FakePool()
    router = ConductorRouter(make(0.8), pool=pool, rejection="predicted")
    router.node_of.update({"pa": "na", "pb": "nb"})
    ws = [
        WorkerState("pa", PREFILL),
        WorkerState("pb", PREFILL, queued_requests=3, queued_tokens=3000),
        WorkerState("d0", DECODE, running=2),
        WorkerState("d1", DECODE, running=0),
    ]
    assert isinstance(router, Router)
    keys = [bytes([i]) * 16 for i in range(10)]
    decision = router.route(1000, keys, ws)
    # pb holds 8 blocks but has 3 s queued; pa fetches them and recomputes 2
    assert decision.prefill == "pa" and decision.decode == "d1" and decision.reject is None
    assert pool.replicated == [(8, "na")]
    # no worker can meet the TTFT SLO (2 x 1 s) when both queues are long
    ws[0].queued_tokens = ws[0].queued_requests = 5000
    ws[1].queued_tokens = 5000
    assert router.route(1000, keys, ws).reject
    # decode pool full (max_batch) and nothing predicted to finish -> reject
    ws[0].queued_tokens = ws[0].queued_requests = 0
    ws[2].max_batch = ws[3].max_batch = 1
    ws[2].running = ws[3].running = 1
    assert router.route(1000, keys, ws).reject
    router.observe(Observation("prefill", "pa", 1000, cached_tokens=0, seconds=2.0))
    assert router.correction.value > 1.0


def test_factory_loads_cost_model_and_bandwidth(tmp_path) -> None:
    import json

    from kvpool.serve.sched.presets import get_preset

    model = PrefillCostModel(c0=0.001, c_token=2e-5, model="tiny")
    path = tmp_path / "cm.json"
    path.write_text(json.dumps({"prefill": model.to_dict(), "transfer": {"bandwidth_Bps": 5e9}}))
    ctx = RouterContext(
        get_preset("tiny"), "", options={"cost_model": str(path), "rejection": "now"}
    )
    router = make_router("conductor", ctx)
    assert router.conductor.prefill.c_token == 2e-5
    assert router.conductor.transfer.bandwidth_Bps == 5e9
    assert router.rejection == "now" and router.pool is None
    ctx.options["bandwidth_gbps"] = "2"
    ctx.options["nodes"] = "p0:nodeA, p1:nodeB"
    router = make_router("conductor", ctx)
    assert router.conductor.transfer.bandwidth_Bps == 2e9
    assert router.node_of == {"p0": "nodeA", "p1": "nodeB"}

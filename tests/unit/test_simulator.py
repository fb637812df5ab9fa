from __future__ import annotations

import itertools
import random

import numpy as np
import pytest

from control.admission.registry import make_admission
from control.routing import PoolModel, make_router
from control.routing.baselines import LeastRequests
from control.routing.cache_aware import DynamoKv
from control.routing.tokenpilot import TokenPilotParams
from control.step_time import KneeRoofline
from schemas.base import TaskClass
from sim.clients import RETRY_SUFFIX, ClientModel
from sim.cluster import Cluster, InstanceProfile
from sim.control_loop import QuotaLoop
from sim.engine import EngineConfig
from sim.ladder import rate_scales
from sim.metrics import summarize
from sim.profiles import PROFILES
from sim.registry import load_trace
from sim.run import scaled
from sim.simulator import Simulation
from sim.workload import TraceRequest

STEPS = KneeRoofline(
    a_s=0.01,
    b_s_per_token=1e-4,
    n0_tokens=32,
    c_s_per_seq=1e-4,
    d_s_per_context_token=1e-6,
    ttft_overhead_s=0.005,
)


def _profile(num_blocks: int = 400, budget: int = 256) -> InstanceProfile:
    engine = EngineConfig(
        num_blocks=num_blocks, block_size=16, max_num_batched_tokens=budget, max_num_seqs=16
    )
    return InstanceProfile("test", "m", "cpu", engine, STEPS)


def _workload(count: int, seed: int) -> list[TraceRequest]:
    rng = random.Random(seed)
    requests, now = [], 0.0
    for n in range(count):
        now += rng.expovariate(20.0)
        prompt = rng.randint(20, 600)
        group = rng.randint(0, 3)
        prefix = tuple(hash((group, i)) for i in range(min(prompt // 16, 8)))
        requests.append(TraceRequest(f"r{n}", now, prompt, rng.randint(1, 80), prefix))
    return requests


def _run(
    workload: list[TraceRequest],
    *,
    instances: int = 3,
    decode_runs: bool = True,
    policy: str = "least_requests",
    profile: InstanceProfile | None = None,
):
    simulation = Simulation(
        Cluster.single(profile or _profile(), instances),
        make_router(policy, seed=7),
        decode_runs=decode_runs,
    )
    return simulation.run(workload), simulation


def test_one_request_on_an_idle_instance_takes_its_prefill_then_its_decodes() -> None:
    request = TraceRequest("r", 1.0, input_tokens=100, output_tokens=3, prefix_blocks=())
    [record], _ = _run([request], instances=1)
    prefill = STEPS.step_s(100, 100 * 101 // 2, 0, 0)
    decode_1, decode_2 = STEPS.step_s(0, 0, 1, 100), STEPS.step_s(0, 0, 1, 101)
    assert record.queue_wait_s == 0.0
    assert record.ttft_s == pytest.approx(prefill + STEPS.ttft_overhead_s)
    assert record.tpot_s == pytest.approx((decode_1 + decode_2) / 2)
    assert record.e2e_s == pytest.approx(record.ttft_s + decode_1 + decode_2)


def test_decode_runs_change_nothing_but_speed() -> None:
    workload = _workload(300, seed=1)
    stepped, _ = _run(workload, decode_runs=False)
    batched, simulation = _run(workload, decode_runs=True)

    def by_id(records):
        return sorted(records, key=lambda r: r.request_id)

    assert by_id(stepped) == by_id(batched)
    assert simulation.engines[0].counters.steps > 0


def test_a_run_is_a_function_of_its_inputs() -> None:
    first, _ = _run(_workload(200, seed=5))
    second, _ = _run(_workload(200, seed=5))
    assert first == second


def test_requests_that_fit_nowhere_are_rejected_and_counted() -> None:
    workload = [TraceRequest("small", 0.0, 50, 5, ()), TraceRequest("huge", 0.1, 9000, 5, ())]
    records, simulation = _run(workload, instances=2, profile=_profile(num_blocks=100))
    outcomes = {r.request_id: r.outcome for r in records}
    assert outcomes == {"small": "completed", "huge": "rejected"}
    summary = summarize(records, simulation.engines)
    assert (summary["completed"], summary["rejected"]) == (1, 1)


def test_every_request_is_served_once_under_pressure_and_the_books_balance() -> None:
    workload = _workload(400, seed=9)
    records, simulation = _run(workload, profile=_profile(num_blocks=60, budget=128))
    assert sorted(r.request_id for r in records) == sorted(r.request_id for r in workload)
    assert all(r.outcome == "completed" for r in records)
    assert sum(e.counters.preemptions for e in simulation.engines) > 0
    for engine in simulation.engines:
        assert engine.idle
        assert engine.pool.used_blocks == 0
        assert engine.inflight_tokens == 0


def test_shared_prefixes_show_up_as_cache_hits() -> None:
    records, simulation = _run(_workload(300, seed=2), instances=1)
    summary = summarize(records, simulation.engines)
    assert 0.0 < summary["cache_hit_rate"] < 1.0
    assert (
        sum(r.cached_tokens for r in records)
        == simulation.engines[0].pool.counters.prefix_hits_tokens
    )


class _ReadingKvEvents:
    """Least requests, keeping each instance's KV events as they are published."""

    name = "reading"

    def __init__(self) -> None:
        self._route = make_router("least_requests", seed=7).route
        self.events: dict[int, list[tuple[int, bool]]] = {}

    def route(self, request, fleet, now):
        return self._route(request, fleet, now)

    def kv_events(self, instance, events):
        self.events.setdefault(instance, []).extend(events)


def test_a_router_that_reads_kv_events_can_follow_each_engine_s_cache_exactly() -> None:
    router = _ReadingKvEvents()
    simulation = Simulation(Cluster.single(_profile(num_blocks=60, budget=128), 3), router)
    workload = _workload(400, seed=9)
    simulation.run(workload)
    every_block = {block for request in workload for block in request.prefix_blocks}
    for index, engine in enumerate(simulation.engines):
        held: set[int] = set()
        for block, stored in router.events[index]:
            assert (block in held) != stored  # stored when absent, removed when held
            (held.add if stored else held.remove)(block)
        removed = sum(1 for _, stored in router.events[index] if not stored)
        assert removed == engine.pool.counters.evicted_blocks > 0
        assert {b for b in every_block if engine.pool.cached_prefix([b])} == held
        assert engine.pool.take_events() == []  # everything was published


@pytest.mark.parametrize(("lag_s", "delivered_early"), [(0.0, True), (1e6, False)])
def test_kv_events_reach_the_router_the_host_s_lag_after_their_step(
    lag_s: float, delivered_early: bool
) -> None:
    """Delivered before the first decision at or past the step's end plus the lag; what
    is still on its way when the run ends arrives then."""
    router = _ReadingKvEvents()
    decided: list[int] = []
    route = router.route
    router.route = lambda request, fleet, now: decided.append(1) or route(request, fleet, now)
    deliveries: list[int] = []
    keep = router.kv_events
    router.kv_events = lambda index, events: deliveries.append(len(decided)) or keep(index, events)
    Simulation(Cluster.single(_profile(), 2), router, token_lag_s=lag_s).run(_workload(100, 3))
    assert deliveries
    assert (min(deliveries) < len(decided)) == delivered_early


class _FollowingLeastRequests(LeastRequests):
    """Least requests, keeping the order in which the host told it of each request."""

    def __init__(self) -> None:
        super().__init__(np.random.default_rng(0))
        self.told: list[tuple[str, str]] = []

    def first_token(self, request_id: str) -> None:
        self.told.append(("first_token", request_id))
        super().first_token(request_id)

    def ended(self, request_id: str) -> None:
        self.told.append(("ended", request_id))
        super().ended(request_id)


def test_a_router_that_follows_its_requests_hears_of_each_first_token_then_its_end() -> None:
    router = _FollowingLeastRequests()
    workload = _workload(120, seed=4)
    records = Simulation(Cluster.single(_profile(), 3), router).run(workload)
    assert all(r.outcome == "completed" for r in records)
    for request in workload:
        told = [what for what, rid in router.told if rid == request.request_id]
        assert told == ["first_token", "ended"]
    assert router.inflight.counts(3).tolist() == [0, 0, 0]
    dynamo = make_router("dynamo_kv")
    Simulation(Cluster.single(_profile(), 3), dynamo).run(workload)
    assert isinstance(dynamo, DynamoKv)
    assert dynamo.active.prefill_tokens(3).tolist() == dynamo.active.blocks(3).tolist() == [0] * 3


def test_a_request_the_engine_refuses_is_ended_for_the_router_that_counted_it() -> None:
    router = _FollowingLeastRequests()
    too_long = TraceRequest("huge", 0.0, 400 * 16, 10, ())  # more than the 400-block cache
    records = Simulation(Cluster.single(_profile(), 2), router).run([too_long])
    assert [r.outcome for r in records] == ["rejected"]
    assert router.told == [("ended", "huge")]
    assert router.inflight.counts(2).tolist() == [0, 0]


class _Recording:
    """Sends everything to instance 0 and keeps the snapshots it was shown."""

    name = "recording"

    def __init__(self) -> None:
        self.seen: list = []

    def route(self, request, fleet, now):
        from control.routing import Decision

        self.seen.append(fleet)
        return Decision(self.name, 0, np.zeros(len(fleet)))


def test_routers_see_scraped_metrics_and_their_own_inflight_tokens() -> None:
    router = _Recording()
    times = (0.0, 0.01, 0.2)
    workload = [
        TraceRequest(f"r{n}", t, 300, 50, (), max_tokens=None if n else 80)
        for n, t in enumerate(times)
    ]
    Simulation(Cluster.single(_profile(), 2), router, scrape_interval_s=0.1).run(workload)
    first, second, third = router.seen
    assert second.running.tolist() == first.running.tolist() == [0, 0]  # scraped at t = 0
    # but its own accounting is exact, counting what a gateway knows: the client's cap
    # (80), or the gateway's default (256) where it set none, never the true length (50)
    assert second.inflight_tokens.tolist() == [380, 0]
    assert third.running.tolist() == [2, 0]  # a fresh scrape at t = 0.2
    assert third.inflight_tokens.tolist() == [380 + 300 + 256, 0]


class _ExpectingCache(_Recording):
    """Like ``_Recording``, and says it expects 100 of each prompt's tokens cached."""

    def route(self, request, fleet, now):
        from control.routing import Decision

        self.seen.append(fleet)
        return Decision(self.name, 0, np.zeros(len(fleet)), {"cached_tokens": np.full(2, 100)})


@pytest.mark.parametrize(("router", "expected"), [(_Recording(), 300), (_ExpectingCache(), 200)])
def test_the_host_counts_prefill_pending_until_the_first_token(router, expected) -> None:
    """As the gateway's shared accounting does: the prompt less what the router expected
    cached is pending on its instance from routing until its first token."""
    workload = [TraceRequest(f"r{n}", t, 300, 50, ()) for n, t in enumerate((0.0, 0.01, 0.5))]
    Simulation(Cluster.single(_profile(), 2), router, scrape_interval_s=0.1).run(workload)
    first, second, third = router.seen
    assert first.pending_prefill_tokens.tolist() == [0, 0]
    assert second.pending_prefill_tokens.tolist() == [expected, 0]  # still in its prefill
    assert third.pending_prefill_tokens.tolist() == [0, 0]  # both have their first token


def _step_ends_seen(decode_runs: bool, lag_s: float) -> list[np.ndarray]:
    router = _Recording()
    workload = [TraceRequest(f"r{n}", t, 300, 80, ()) for n, t in enumerate((0.0, 0.01, 0.5))]
    simulation = Simulation(
        Cluster.single(_profile(), 2), router, decode_runs=decode_runs, token_lag_s=lag_s
    )
    simulation.run(workload)
    return [fleet.last_step_end_s for fleet in router.seen]


@pytest.mark.parametrize("decode_runs", [True, False])
@pytest.mark.parametrize("lag_s", [0.0, 0.004])
def test_routers_see_the_last_step_end_that_streamed_tokens(decode_runs, lag_s) -> None:
    """As a gateway sees tokens stream back, ``lag_s`` after each step's end: the first
    prompt's opening chunk streams nothing, so at 10 ms no step end is known; at 0.5 s
    the prompt decodes, and the last step end seen is at most one decode step (11 ms
    here) and the lag old."""
    first, second, third = _step_ends_seen(decode_runs, lag_s)
    assert np.isneginf(first).all()
    assert np.isneginf(second).all()
    assert np.isneginf(third[1])  # never sent anything
    assert 0.5 - lag_s - 0.011 < third[0] - lag_s <= 0.5 - lag_s


def test_both_ways_of_stepping_show_the_same_step_ends() -> None:
    assert _step_ends_seen(True, 0.0)[2][0] == _step_ends_seen(False, 0.0)[2][0]


def test_tokenpilot_learns_a_host_later_than_it_assumes() -> None:
    """TokenPilot assumes its default 4 ms; the simulated host sees tokens 8 ms late.
    From the first tokens of its requests it raises the lag it assumes, and at half
    load, where a request's wait is mostly for the step in flight to end, its requests
    catch the steps they aim for more often than without learning. (At full load the
    queues ahead, not the phase, set the waits: there the medians were 84.5 and 84.2 ms.)"""
    chosen = PROFILES["llama3-70b-4xh100"]
    workload = load_trace("azure-conv", limit=800)
    workload = scaled(workload, rate_scales(chosen, workload, 4, [0.5])[0])
    outcomes = {}
    for learn in (False, True):
        params = TokenPilotParams(learn_token_lag=learn)
        router = make_router("tokenpilot", pool=chosen.pool_model(), params=params)
        records = Simulation(Cluster.single(chosen, 4), router, token_lag_s=0.008).run(workload)
        ttft = np.median([r.ttft_s for r in records if r.ttft_s is not None])
        outcomes[learn] = router.token_lag.lag_s, ttft
    assert outcomes[False][0] == 0.004
    assert 0.006 < outcomes[True][0] <= 0.0085
    assert outcomes[True][1] < outcomes[False][1]


def test_slomax_keeps_a_batch_burst_out_of_the_chats_way_and_still_finishes_it() -> None:
    """30 batch prompts at once, then a chat every half second: admitted as they come,
    the batch queues at the engines ahead of the chats; SLOMax starts batch work only
    where nothing waits, so the chats start at once and the batch work still completes."""
    batch = [
        TraceRequest(f"b{n}", 0.01 * n, 2_000, 50, (), TaskClass.BATCH, deadline_s=600.0)
        for n in range(30)
    ]
    chats = [TraceRequest(f"c{n}", 0.5 + 0.5 * n, 200, 20, ()) for n in range(20)]
    workload = sorted(batch + chats, key=lambda r: r.arrival_s)
    outcome = {}
    for name in ("fcfs", "slomax"):
        router = make_router(
            "tokenpilot", seed=7, pool=PoolModel(STEPS, max_num_batched_tokens=256)
        )
        cluster = Cluster.single(_profile(num_blocks=2_000, budget=256), 2)
        records = Simulation(cluster, router, admission=make_admission(name)).run(workload)
        chat_ttft = [r.ttft_s for r in records if r.task_class == "interactive"]
        done = [r for r in records if r.outcome == "completed"]
        outcome[name] = (
            np.percentile(chat_ttft, 95),
            len(done),
            max(r.arrival_s + r.e2e_s for r in done),
        )
    (fcfs_p95, fcfs_done, fcfs_end), (slomax_p95, slomax_done, slomax_end) = outcome.values()
    assert fcfs_done == slomax_done == 50
    assert fcfs_p95 > 1.0  # the chats waited behind the burst
    assert slomax_p95 < fcfs_p95 / 10
    assert slomax_end < fcfs_end * 1.05  # the batch work finished about as soon


def test_clients_that_wait_too_long_cancel_come_back_once_and_leave_no_work_behind() -> None:
    """Ten 4,000-token prompts at once on one instance take seconds to prefill one after
    another; clients that wait 2 s for a first token cancel, and all of them try once more."""
    workload = [TraceRequest(f"r{n}", 0.01 * n, 4_000, 30, ()) for n in range(10)]
    clients = ClientModel(interactive_patience_s=2.0, retry_share=1.0, retry_delay_s=0.5)
    simulation = Simulation(
        Cluster.single(_profile(num_blocks=4_000), 1), make_router("round_robin"), clients=clients
    )
    records = simulation.run(workload)
    cancelled = [r for r in records if r.outcome == "cancelled"]
    assert cancelled
    assert all(r.ttft_s is None for r in cancelled)
    firsts = {r.request_id for r in cancelled if not r.request_id.endswith(RETRY_SUFFIX)}
    retried = {
        r.request_id.removesuffix(RETRY_SUFFIX)
        for r in records
        if r.request_id.endswith(RETRY_SUFFIX)
    }
    assert retried == firsts  # every client that gave up came back, once
    assert len(records) == len(workload) + len(firsts)
    completed = [r for r in records if r.outcome == "completed"]
    assert all(r.ttft_s <= 2.0 for r in completed)  # nobody stayed past their patience
    # a client that gave up mid-prefill leaves the engine's work on its prompt lost
    assert any(0 < r.lost_work_tokens <= 4_000 for r in cancelled)
    engine = simulation.engines[0]
    assert (engine.running, list(engine.waiting), engine.inflight_tokens) == ([], [], 0)
    assert engine.pool.used_blocks == 0
    assert not simulation.fleet().inflight_tokens.any()
    assert not simulation.fleet().pending_prefill_tokens.any()


def test_a_batch_client_gives_up_at_its_deadline_and_does_not_retry_past_it() -> None:
    slow = TraceRequest("b", 0.0, 200, 5_000, (), TaskClass.BATCH, deadline_s=5.0)
    clients = ClientModel(retry_share=1.0)
    simulation = Simulation(
        Cluster.single(_profile(), 1), make_router("round_robin"), clients=clients
    )
    [record] = simulation.run([slow])
    assert (record.outcome, record.arrival_s) == ("cancelled", 5.0)
    assert 0 < record.output_tokens < 5_000  # what it generated, wasted
    assert record.lost_work_tokens == 200 + record.output_tokens - 1  # its KV, computed


def test_the_quota_loop_closes_through_the_tables_and_lowers_the_limit_while_chats_miss() -> None:
    """Chats every 50 ms beside a 16k-token document every 0.5 s on two small instances:
    the chats miss their objective, and SLOMax's controller, reading the goodput table the
    simulator's records make, lowers the limit on long documents until its floor."""
    chats = [TraceRequest(f"c{n}", 0.05 * n, 200, 20, ()) for n in range(1200)]
    documents = [
        TraceRequest(f"d{n}", 0.5 * n, 16_384, 5, (), TaskClass.LONG_DOCUMENT) for n in range(120)
    ]
    loop = QuotaLoop()
    simulation = Simulation(
        Cluster.single(_profile(num_blocks=4_000, budget=2_048), 2),
        make_router("tokenpilot", seed=7, pool=PoolModel(STEPS, max_num_batched_tokens=2_048)),
        admission=make_admission("slomax"),
        control=loop,
    )
    simulation.run(sorted(chats + documents, key=lambda r: r.arrival_s))
    limits = [step.long_documents for step in loop.steps]
    assert all(step.interactive_compliance < 0.95 for step in loop.steps[1:12])
    assert limits[0] is not None
    assert limits[-1] == 1  # 0.5 per instance: the floor
    assert all(b <= a for a, b in itertools.pairwise(limits))  # never back up while they miss
    published = simulation.pipeline.quotas[TaskClass.LONG_DOCUMENT]
    assert published.max_concurrency == limits[-1]

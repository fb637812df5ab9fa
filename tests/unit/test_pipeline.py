"""The pipeline that hosts an admission policy: its pools, release passes, peers, slots, books."""

from __future__ import annotations

import pickle
from collections import Counter

import numpy as np
import pytest

from control.admission.baselines import (
    Fcfs,
)
from control.admission.request import LONG_DOCUMENT_TOKENS, AdmissionRequest
from control.admission.slomax import SLOMax
from control.admission.view import (
    EXPIRED,
    MAX_HOLD,
    AdmissionDecision,
    AdmissionView,
    Verdict,
)
from control.pipeline import ROUTING_FAILED, Charge, ClassLoad, Pipeline, ReleaseFailed
from control.routing import (
    Decision,
    FleetSnapshot,
    Observation,
    PoolModel,
    RouteRequest,
    make_router,
)
from control.routing.baselines import RoundRobin
from control.step_time import KneeRoofline
from schemas.base import TaskClass
from schemas.control import ClassQuota
from tests.unit.test_admission import BATCH, CHAT, DOC, fleet, request


def test_a_charge_is_the_uncached_prompt_pending_and_prompt_and_budget_in_flight() -> None:
    """One definition for both hosts; an expected cache larger than the prompt (a match
    counted in whole index strides) leaves nothing pending, never a negative."""
    assert Charge.of(1_000, 100, 300.0) == Charge(700.0, 1_100)
    assert Charge.of(1_000, 100, 4_096.0) == Charge(0.0, 1_100)


def test_the_pipeline_holds_batch_while_the_fleet_queues_and_releases_it_after() -> None:
    pipeline: Pipeline[str] = Pipeline(SLOMax(), make_router("round_robin"))
    route = RouteRequest("b", 1_000, 100)
    busy = fleet(waiting=(1, 1))
    held = pipeline.arrive(request(BATCH, deadline=600.0, rid="b"), route, "b", busy, now=0.0)
    assert (held.admission.verdict, held.route) == (Verdict.HOLD, None)
    assert pipeline.release(lambda: busy, now=1.0) == []
    released = pipeline.release(lambda: fleet(waiting=(1, 0)), now=2.0)
    assert [(o.payload, o.instance) for o in released] == [("b", 1)]
    assert pipeline.inflight[BATCH] == 1
    pipeline.finished("b", 3.0, completed_tokens=100)
    assert pipeline.usage[BATCH].output_tokens == 100
    assert pipeline.inflight[BATCH] == 0


def test_the_pipeline_answers_a_hold_that_ran_out() -> None:
    pipeline: Pipeline[str] = Pipeline(SLOMax(), make_router("round_robin"))
    busy = fleet(waiting=(1, 1))
    pipeline.arrive(
        request(BATCH, deadline=5.0, rid="b"), RouteRequest("b", 1_000, 100), "b", busy, 0.0
    )
    [answered] = pipeline.release(lambda: busy, now=5.0)
    assert (answered.admission.verdict, answered.admission.reason) == (Verdict.REJECT, EXPIRED)
    assert len(pipeline.pools) == 0


def test_a_hold_without_an_objective_runs_out_as_the_longest_hold_not_as_a_deadline() -> None:
    pipeline: Pipeline[str] = Pipeline(SLOMax(), make_router("round_robin"))
    busy = fleet(waiting=(1, 1))
    pipeline.arrive(request(BATCH, rid="u"), RouteRequest("u", 1_000, 100), "u", busy, 0.0)
    assert pipeline.release(lambda: busy, now=599.0) == []
    [answered] = pipeline.release(lambda: busy, now=600.0)
    assert (answered.admission.verdict, answered.admission.reason) == (Verdict.REJECT, MAX_HOLD)


def test_a_long_prompt_waiting_for_prefill_room_does_not_hold_the_chats_behind_it() -> None:
    """A chat whose client sent a long document as interactive waits for an instance with
    prefill room; the chats behind it in their FIFO pool go first, and it keeps its place.
    In the long-document pool, where every request waits for that room, a pass stops at
    its head (behind it, here, a short prompt its client called a long document)."""
    pipeline: Pipeline[str] = Pipeline(SLOMax(), make_router("round_robin"))
    full = fleet(pending=(LONG_DOCUMENT_TOKENS, LONG_DOCUMENT_TOKENS))
    for rid, tokens, arrival in (("long", LONG_DOCUMENT_TOKENS, 0.0), ("short", 500, 0.1)):
        held = pipeline.arrive(
            request(tokens=tokens, arrival=arrival, rid=rid),
            RouteRequest(rid, tokens, 100),
            rid,
            full,
            now=arrival,
        )
        assert held.admission.verdict is Verdict.HOLD
    assert [o.payload for o in pipeline.release(lambda: full, now=0.2)] == ["short"]
    assert pipeline.pools.head(CHAT) is not None
    assert pipeline.pools.head(CHAT).payload.payload == "long"
    assert pipeline.pools.state(CHAT, 0.2).drained_per_s == 1 / 30  # the short chat alone
    room = fleet(pending=(0, LONG_DOCUMENT_TOKENS))
    assert [(o.payload, o.instance) for o in pipeline.release(lambda: room, now=0.3)] == [
        ("long", 0)
    ]
    documents: Pipeline[str] = Pipeline(SLOMax(), make_router("round_robin"))
    for rid, tokens in (("d1", LONG_DOCUMENT_TOKENS), ("d2", 500)):
        route = RouteRequest(rid, tokens, 100)
        documents.arrive(request(DOC, tokens, rid=rid), route, rid, full, now=0.0)
    assert documents.release(lambda: full, now=0.2) == []


def test_a_head_stepped_past_is_held_again_even_where_the_pass_fails() -> None:
    class Failing:
        name = "failing"

        def route(self, *_: object) -> Decision:
            raise RuntimeError("a bug in the router")

    pipeline: Pipeline[str] = Pipeline(SLOMax(), Failing())  # type: ignore[arg-type]
    full = fleet(pending=(LONG_DOCUMENT_TOKENS, LONG_DOCUMENT_TOKENS))
    for rid, tokens, arrival in (("long", LONG_DOCUMENT_TOKENS, 0.0), ("short", 500, 0.1)):
        route = RouteRequest(rid, tokens, 100)
        pipeline.arrive(request(tokens=tokens, arrival=arrival, rid=rid), route, rid, full, arrival)
    with pytest.raises(ReleaseFailed) as failed:
        pipeline.release(lambda: full, now=0.2)
    assert isinstance(failed.value.__cause__, RuntimeError)
    head = pipeline.pools.head(CHAT)
    assert head is not None
    assert head.payload.payload == "long"
    assert [o.payload for o in failed.value.outcomes] == ["short"]  # refused, not lost


class _FailsOnHeldRequests(Fcfs):
    """Holds every arrival, and fails on every held one: a bug in the policy's code."""

    def decide(
        self, request: AdmissionRequest, view: AdmissionView, *, held: bool = False
    ) -> AdmissionDecision:
        if held:
            raise ZeroDivisionError("a bug in the policy")
        return AdmissionDecision(Verdict.HOLD, "saturated", hold_until_s=np.inf)


def test_a_head_the_policy_fails_on_is_refused_not_held_first_again() -> None:
    """Only the router's errors were refused: a head the policy failed on stayed first in
    its pool, and every later pass failed on it and released nothing behind it."""
    pipeline: Pipeline[str] = Pipeline(_FailsOnHeldRequests(), make_router("round_robin"))
    for rid in ("c1", "c2"):
        pipeline.arrive(request(rid=rid), RouteRequest(rid, 1_000, 100), rid, fleet(), 0.0)
    for now, refused, held in ((0.1, "c1", 1), (0.2, "c2", 0)):
        with pytest.raises(ReleaseFailed) as failed:
            pipeline.release(fleet, now)
        assert isinstance(failed.value.__cause__, ZeroDivisionError)
        decided = [(o.payload, o.admission.reason) for o in failed.value.outcomes]
        assert decided == [(refused, ROUTING_FAILED)]
        assert len(pipeline.pools) == held


def test_a_release_pass_counts_its_own_dispatches_before_the_next_check() -> None:
    """Two long documents wait for prefill room, and one instance has it: the first one
    released takes it, and the second sees it taken, in the same pass, before the host
    has booked the first."""
    pipeline: Pipeline[str] = Pipeline(SLOMax(), make_router("round_robin"))
    full = fleet(pending=(LONG_DOCUMENT_TOKENS, LONG_DOCUMENT_TOKENS))
    for n in (1, 2):
        route = RouteRequest(f"d{n}", 20_000, 100)
        pipeline.arrive(request(DOC, 20_000, arrival=n, rid=f"d{n}"), route, f"d{n}", full, n)
    room = fleet(pending=(0, LONG_DOCUMENT_TOKENS))
    assert [(o.payload, o.instance) for o in pipeline.release(lambda: room, now=3.0)] == [("d1", 0)]
    assert pipeline.pools.head(DOC) is not None


SEATS = PoolModel(KneeRoofline(0.01, 0.0, 0, 0.0, 0.0), max_num_seqs=100)


def test_release_passes_keep_the_interactive_share_of_the_engines_sequences() -> None:
    """300 batch requests held on two idle instances of ``max_num_seqs`` 100: release passes
    let go 85 to each, the seats outside the 15 % reserve, though the scrape they read
    shows the instances idle throughout (a review saw about 150 each start); once one
    ends, one more starts."""
    pipeline: Pipeline[str] = Pipeline(SLOMax(pool=SEATS), make_router("round_robin"))
    busy, idle = fleet(waiting=(1, 1)), fleet()
    for n in range(300):
        batch = request(BATCH, tokens=100, deadline=3_600.0, rid=f"b{n}")
        pipeline.arrive(batch, RouteRequest(f"b{n}", 100, 100), f"b{n}", busy, now=0.0)
    released = pipeline.release(lambda: idle, now=1.0)
    assert Counter(o.instance for o in released) == {0: 85, 1: 85}
    assert pipeline.release(lambda: idle, now=1.01) == []  # the same stale scrape
    pipeline.finished(released[0].request.request_id, 1.02, completed_tokens=100)
    assert [o.instance for o in pipeline.release(lambda: idle, now=1.03)] == [0]
    assert len(pipeline.pools) == 129


def test_a_burst_of_arrivals_between_two_scrapes_keeps_the_interactive_share() -> None:
    """Batch arrivals on an idle scrape start until this host's own requests in flight
    take all but the reserved share of an instance's seats; the rest wait in their pool."""
    pipeline: Pipeline[str] = Pipeline(SLOMax(pool=SEATS), make_router("round_robin"))
    idle = fleet()
    outcomes = [
        pipeline.arrive(
            request(BATCH, tokens=100, deadline=3_600.0, rid=f"b{n}"),
            RouteRequest(f"b{n}", 100, 100),
            f"b{n}",
            idle,
            now=0.0,
        )
        for n in range(300)
    ]
    assert Counter(o.instance for o in outcomes if o.instance is not None) == {0: 85, 1: 85}
    assert len(pipeline.pools) == 130


def test_a_pipeline_counts_its_peers_in_flight_against_the_class_ceiling() -> None:
    pipeline: Pipeline[str] = Pipeline(SLOMax(), make_router("round_robin"))
    pipeline.quotas = {
        DOC: ClassQuota(task_class=DOC, tokens_per_s=1e6, burst_tokens=10**6, max_concurrency=2)
    }
    route = RouteRequest("d", 20_000, 100)
    pipeline.peers = {DOC: ClassLoad(inflight=2)}  # another gateway runs two documents
    held = pipeline.arrive(request(DOC, 20_000, rid="d"), route, "d", fleet(), now=0.0)
    assert (held.admission.verdict, held.admission.reason) == (Verdict.HOLD, "concurrency")
    pipeline.peers = {DOC: ClassLoad(inflight=1)}
    [released] = pipeline.release(fleet, now=1.0)
    assert released.payload == "d"
    assert released.instance is not None
    assert pipeline.load(1.0)[DOC] == ClassLoad(inflight=1, drained_per_s=1 / 30, arrived_per_s=0.1)


def test_a_held_request_waits_while_a_peer_holds_one_of_its_class_from_before() -> None:
    pipeline: Pipeline[str] = Pipeline(SLOMax(), make_router("round_robin"))
    busy = fleet(waiting=(1, 1))
    pipeline.arrive(
        request(BATCH, deadline=600.0, rid="b"), RouteRequest("b", 1_000, 100), "b", busy, 0.0
    )
    assert pipeline.load(0.0)[BATCH] == ClassLoad(held=1, head_key=600.0, arrived_per_s=0.1)
    pipeline.peers = {BATCH: ClassLoad(held=1, head_key=300.0)}  # a nearer deadline, elsewhere
    calm = fleet()
    assert pipeline.release(lambda: calm, now=1.0) == []
    pipeline.peers = {BATCH: ClassLoad(held=1, head_key=900.0)}
    assert [o.payload for o in pipeline.release(lambda: calm, now=2.0)] == ["b"]


def test_a_long_prompt_a_peer_steps_past_does_not_hold_this_host_s_pool() -> None:
    """Replica A holds a 20k-token batch request, and a short one due after it; replica
    B, a short one due between the two. Once A's pass finds its long prompt waiting for
    prefill room, and steps past it, what A shares as its head is its short one: B's
    goes first, then A's. Before, A went on sharing the long prompt's deadline, and B
    held its request to the end."""
    a: Pipeline[str] = Pipeline(SLOMax(), make_router("round_robin"))
    b: Pipeline[str] = Pipeline(SLOMax(), make_router("round_robin"))
    for host, rid, tokens, deadline in (
        (a, "a-long", 20_000, 100.0),
        (a, "a-short", 500, 300.0),
        (b, "b-short", 500, 200.0),
    ):
        route = RouteRequest(rid, tokens, 100)
        arrival = request(BATCH, tokens, deadline=deadline, rid=rid)
        held = host.arrive(arrival, route, rid, fleet(waiting=(1, 1)), now=0.0)
        assert held.admission.verdict is Verdict.HOLD

    def share(now: float) -> None:
        a.peers, b.peers = {BATCH: b.load(now)[BATCH]}, {BATCH: a.load(now)[BATCH]}

    full = fleet(pending=(LONG_DOCUMENT_TOKENS, LONG_DOCUMENT_TOKENS))
    share(0.0)
    assert b.release(lambda: full, now=1.0) == []  # behind A's long prompt, as A shared it
    assert a.release(lambda: full, now=1.0) == []  # past its long prompt, behind B's
    share(1.0)
    assert a.load(1.0)[BATCH].head_key == 300.0
    assert [o.payload for o in b.release(lambda: full, now=2.0)] == ["b-short"]
    share(2.0)
    assert [o.payload for o in a.release(lambda: full, now=3.0)] == ["a-short"]
    assert a.load(3.0)[BATCH].head_key is None  # only the long prompt is left


def test_arrivals_queue_behind_a_pool_another_host_holds() -> None:
    pipeline: Pipeline[str] = Pipeline(SLOMax(), make_router("round_robin"))
    pipeline.peers = {CHAT: ClassLoad(held=3, head_key=0.0)}
    outcome = pipeline.arrive(
        request(rid="c", arrival=1.0), RouteRequest("c", 100, 10), "c", fleet(), 1.0
    )
    assert (outcome.admission.verdict, outcome.admission.reason) == (Verdict.HOLD, "behind_pool")


def test_a_host_sharing_a_ceiling_starts_its_class_only_in_the_slots_it_holds() -> None:
    """Four long documents per instance, two instances: the ceiling has room for eight, but
    a host holding one slot of it starts one; its other classes have no ceiling to share."""
    pipeline: Pipeline[str] = Pipeline(SLOMax(), make_router("round_robin"), slots={DOC: 1})

    def arrive(rid: str, task_class: TaskClass) -> AdmissionDecision:
        tokens = LONG_DOCUMENT_TOKENS if task_class is DOC else 1_000
        route = RouteRequest(rid, tokens, 10)
        return pipeline.arrive(
            request(task_class, tokens, rid=rid), route, rid, fleet(), 0.0
        ).admission

    assert arrive("d1", DOC).verdict is Verdict.DISPATCH
    assert (arrive("d2", DOC).verdict, arrive("d3", DOC).reason) == (Verdict.HOLD, "slots")
    assert arrive("c1", CHAT).verdict is Verdict.DISPATCH
    pipeline.slots = {DOC: 2}
    assert [o.payload for o in pipeline.release(fleet, now=1.0)] == ["d2"]
    assert pipeline.pools.state(DOC, 1.0).drained_per_s == 0  # it waited for a grant
    pipeline.slots = None  # alone again: the ceiling is the host's own
    assert [o.payload for o in pipeline.release(fleet, now=2.0)] == ["d3"]


def test_peer_loads_add_up_and_the_earliest_head_leads() -> None:
    one = ClassLoad(inflight=1, decoding=1, held=2, drained_per_s=0.5, head_key=7.0)
    other = ClassLoad(inflight=3, held=1, drained_per_s=0.25, head_key=4.0)
    assert one + other == ClassLoad(4, 1, 3, 0.75, 4.0)
    assert (one + ClassLoad()).head_key == 7.0


class KeepsBooks:
    """Round robin, and a log of what the pipeline told it of each request."""

    name = "keeps_books"

    def __init__(self) -> None:
        self.inner = make_router("round_robin")
        self.told: list[tuple[str, str]] = []

    def route(self, request: RouteRequest, fleet: FleetSnapshot, now: float) -> Decision:
        self.told.append(("route", request.request_id))
        return self.inner.route(request, fleet, now)

    def first_token(self, request_id: str) -> None:
        self.told.append(("first_token", request_id))

    def ended(self, request_id: str) -> None:
        self.told.append(("ended", request_id))

    def observe(self, observation: Observation) -> None:
        self.told.append(("observe", observation.request_id))

    def withdraw(self, request_id: str) -> None:
        self.told.append(("withdraw", request_id))


def test_the_pipeline_keeps_the_router_s_books() -> None:
    router = KeepsBooks()
    pipeline: Pipeline[str] = Pipeline(Fcfs(), router)
    for rid in ("a", "b", "c"):
        pipeline.arrive(request(rid=rid), RouteRequest(rid, 100, 10), rid, fleet(), now=0.0)
    pipeline.first_token("a", 1.0)
    pipeline.finished("a", 2.0, completed_tokens=10, observation=Observation("a", 0, 1.0, 10))
    pipeline.finished("b", 2.0, cancelled=True)
    assert pipeline.reroutes
    again = pipeline.reroute(RouteRequest("c", 100, 10), fleet(), 3.0, np.array([False, True]))
    assert again.chosen == 1  # kept to the instances admission allowed
    assert router.told[3:] == [
        ("first_token", "a"),
        ("ended", "a"),
        ("observe", "a"),
        ("ended", "b"),
        ("withdraw", "b"),
        ("withdraw", "c"),
        ("route", "c"),
    ]
    assert sum(pipeline.inflight.values()) == 1  # c alone


class _BreaksOnSecondRoute(RoundRobin):
    """A router with a bug that shows on its second decision."""

    def __init__(self) -> None:
        super().__init__(np.random.default_rng(0))
        self.routed = 0

    def route(self, request: RouteRequest, fleet: FleetSnapshot, now: float) -> Decision:
        self.routed += 1
        if self.routed == 2:
            raise ZeroDivisionError("a bug")
        return super().route(request, fleet, now)


def test_a_release_pass_that_fails_part_way_gives_what_it_decided_and_the_one_it_failed_on() -> (
    None
):
    """The pass's error lost the requests it had taken out: the expired one and the
    document let go were never answered, and the one let go counted in flight for good.
    The one the router failed on is refused: held again, it would fail first every pass."""
    pipeline: Pipeline[str] = Pipeline(SLOMax(), _BreaksOnSecondRoute())
    pipeline.quotas = {
        DOC: ClassQuota(task_class=DOC, tokens_per_s=1e6, burst_tokens=10**6, max_concurrency=2)
    }
    pipeline.peers = {DOC: ClassLoad(inflight=2)}  # the ceiling is full: documents wait
    for n, at in ((3, -29.0), (1, 0.0), (2, 0.0)):  # d3 held until 1 s, the others 30 s
        route = RouteRequest(f"d{n}", 20_000, 100)
        held = pipeline.arrive(request(DOC, 20_000, at, rid=f"d{n}"), route, f"d{n}", fleet(), at)
        assert held.admission.verdict is Verdict.HOLD
    pipeline.peers = {}
    with pytest.raises(ReleaseFailed) as failed:
        pipeline.release(fleet, now=2.0)
    assert isinstance(failed.value.__cause__, ZeroDivisionError)
    decided = [(o.payload, o.admission.reason, o.instance) for o in failed.value.outcomes]
    assert decided == [("d3", "expired", None), ("d1", "admitted", 0), ("d2", ROUTING_FAILED, None)]
    assert pipeline.inflight[DOC] == 1
    assert len(pipeline.pools) == 0
    unpickled = pickle.loads(pickle.dumps(failed.value))  # from a worker process
    assert [o.payload for o in unpickled.outcomes] == ["d3", "d1", "d2"]

"""SLOMax's decisions, the class pools and the pipeline that hosts them (the baselines:
test_admission_baselines.py)."""

from __future__ import annotations

import pickle
from collections import Counter
from dataclasses import replace

import numpy as np
import pytest

from control.admission.baselines import (
    Fcfs,
)
from control.admission.pools import STALE_ENTRIES_KEPT, ClassPools, Waiting
from control.admission.request import LONG_DOCUMENT_TOKENS, AdmissionRequest, identify
from control.admission.slomax import SLOMax, SLOMaxParams
from control.admission.view import (
    AdmissionDecision,
    AdmissionView,
    PoolState,
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
from schemas.objectives import ClassObjective

CHAT, DOC, BATCH = TaskClass.INTERACTIVE, TaskClass.LONG_DOCUMENT, TaskClass.BATCH


KV_BLOCKS = 10_000
"""Each test instance's KV blocks: 160,000 tokens in blocks of 16."""


def fleet(
    waiting=(0, 0), kv_used=(0, 0), pending=(0, 0), ready=None, running=(0, 0)
) -> FleetSnapshot:
    size = len(waiting)
    return FleetSnapshot(
        tuple(f"i{n}" for n in range(size)),
        np.ones(size, dtype=bool) if ready is None else np.array(ready),
        np.array(waiting, dtype=np.int64),
        np.array(running, dtype=np.int64),
        np.zeros(size, dtype=np.int64),
        np.array(kv_used, dtype=np.int64),
        np.full(size, KV_BLOCKS, dtype=np.int64),
        np.array(pending, dtype=np.float64),
    )


def request(task_class=CHAT, tokens=1_000, arrival=0.0, deadline=None, rid="r") -> AdmissionRequest:
    return AdmissionRequest(rid, task_class, "t", tokens, 100, arrival, deadline)


def view(snapshot=None, now=0.0, predicted=None, **kwargs) -> AdmissionView:
    snapshot = snapshot or fleet()
    ttft = None if predicted is None else np.array(predicted, dtype=np.float64)
    return AdmissionView(now, snapshot, ttft, **kwargs)


def allowed(decision: AdmissionDecision) -> list[bool]:
    assert decision.allowed is not None
    return decision.allowed.tolist()


def test_the_class_comes_from_the_client_then_the_tenant_then_the_request() -> None:
    def of(requested=None, default=None, tokens=100, deadline=False):
        return identify(
            requested=requested, tenant_default=default, input_tokens=tokens, has_deadline=deadline
        )

    assert of(requested=BATCH, default=CHAT, tokens=LONG_DOCUMENT_TOKENS) is BATCH
    assert of(default=DOC) is DOC
    assert of(deadline=True, tokens=LONG_DOCUMENT_TOKENS) is BATCH
    assert of(tokens=LONG_DOCUMENT_TOKENS) is DOC
    assert of(tokens=LONG_DOCUMENT_TOKENS - 1) is CHAT


def test_a_chat_starts_at_once_where_the_fleet_has_room() -> None:
    decision = SLOMax().decide(request(), view(predicted=[0.3, 0.2]))
    assert decision.verdict is Verdict.DISPATCH
    assert allowed(decision) == [True, True]
    assert dict(decision.figures)["predicted_ttft_s"] == pytest.approx(0.2)


def test_batch_starts_only_where_nothing_waits() -> None:
    decision = SLOMax().decide(request(BATCH), view(fleet(waiting=(2, 0))))
    assert decision.verdict is Verdict.DISPATCH
    assert allowed(decision) == [False, True]
    held = SLOMax().decide(request(BATCH), view(fleet(waiting=(2, 1))))
    assert (held.verdict, held.reason) == (Verdict.HOLD, "reservation")
    chat = SLOMax().decide(request(CHAT), view(fleet(waiting=(2, 1))))
    assert chat.verdict is Verdict.DISPATCH
    document = SLOMax().decide(request(DOC, tokens=20_000), view(fleet(waiting=(2, 1))))
    assert allowed(document) == [True, True]  # long documents have objectives of their own


def test_lower_classes_wait_once_the_fleet_eats_into_the_interactive_reserve() -> None:
    busy = fleet(kv_used=(8_600, 8_600))  # 86 % in use, against the default 15 % reserve
    assert SLOMax().decide(request(DOC, tokens=20_000), view(busy)).reason == "reservation"
    calm = fleet(kv_used=(8_400, 8_400))
    assert SLOMax().decide(request(DOC, tokens=20_000), view(calm)).verdict is Verdict.DISPATCH
    # the controller's quota names the reserve once it publishes one
    quota = ClassQuota(
        task_class=CHAT,
        tokens_per_s=1e6,
        burst_tokens=10**6,
        max_concurrency=100,
        reserved_share=0.5,
    )
    reserved = view(calm, quotas={CHAT: quota})
    assert SLOMax().decide(request(DOC, tokens=20_000), reserved).reason == "reservation"


def test_an_interactive_quota_without_a_reserve_keeps_the_default_one() -> None:
    """A quota that set only a bucket or a ceiling for interactive requests read as a
    reserve of 0: long documents took the KV held back for chats."""
    busy = fleet(kv_used=(8_600, 8_600))  # 86 % in use, against the default 15 % reserve
    for quota in (
        ClassQuota(task_class=CHAT, tokens_per_s=1e6, burst_tokens=10**6),
        ClassQuota(task_class=CHAT, max_concurrency=100),
    ):
        decision = SLOMax().decide(request(DOC, tokens=20_000), view(busy, quotas={CHAT: quota}))
        assert decision.reason == "reservation"


def test_lower_classes_leave_the_interactive_share_of_the_engines_sequences() -> None:
    """On an instance whose running and waiting sequences take more than all but the
    reserved share (15 % by default, else the quota's) of its ``max_num_seqs``, only chats
    start."""
    slomax = SLOMax(pool=PoolModel(KneeRoofline(0.01, 0.0, 0, 0.0, 0.0), max_num_seqs=100))
    doc = request(DOC, tokens=20_000)
    crowded = fleet(running=(90, 80), waiting=(0, 0))
    assert allowed(slomax.decide(doc, view(crowded))) == [False, True]
    assert allowed(slomax.decide(request(BATCH), view(crowded))) == [False, True]
    assert slomax.decide(request(CHAT), view(crowded)).verdict is Verdict.DISPATCH
    full = fleet(running=(80, 80), waiting=(10, 10))
    assert slomax.decide(doc, view(full)).reason == "reservation"
    assert SLOMax().decide(doc, view(full)).verdict is Verdict.DISPATCH  # no engine limit known
    quota = ClassQuota(task_class=CHAT, reserved_share=0.3)
    assert slomax.decide(doc, view(crowded, quotas={CHAT: quota})).reason == "reservation"


def test_a_charge_is_the_uncached_prompt_pending_and_prompt_and_budget_in_flight() -> None:
    """One definition for both hosts; an expected cache larger than the prompt (a match
    counted in whole index strides) leaves nothing pending, never a negative."""
    assert Charge.of(1_000, 100, 300.0) == Charge(700.0, 1_100)
    assert Charge.of(1_000, 100, 4_096.0) == Charge(0.0, 1_100)


def test_a_long_prompt_never_stacks_on_another_long_prefill() -> None:
    snapshot = fleet(pending=(LONG_DOCUMENT_TOKENS, 500))
    decision = SLOMax().decide(request(CHAT, tokens=LONG_DOCUMENT_TOKENS), view(snapshot))
    assert allowed(decision) == [False, True]
    full = fleet(pending=(LONG_DOCUMENT_TOKENS, LONG_DOCUMENT_TOKENS + 1))
    held = SLOMax().decide(request(CHAT, tokens=LONG_DOCUMENT_TOKENS), view(full))
    assert (held.verdict, held.reason) == (Verdict.HOLD, "prefill_cap")
    short = SLOMax().decide(request(CHAT, tokens=LONG_DOCUMENT_TOKENS - 1), view(full))
    assert short.verdict is Verdict.DISPATCH
    unbounded = SLOMax(SLOMaxParams(interference_bound=False))
    assert (
        unbounded.decide(request(tokens=LONG_DOCUMENT_TOKENS), view(full)).verdict
        is Verdict.DISPATCH
    )


def test_long_documents_in_flight_are_limited_per_ready_instance_until_a_quota_says() -> None:
    per_instance = SLOMaxParams().long_documents_per_instance
    at_limit = view(inflight={DOC: int(per_instance * 2)})
    assert SLOMax().decide(request(DOC, tokens=20_000), at_limit).reason == "concurrency"
    below = view(inflight={DOC: int(per_instance * 2) - 1})
    assert SLOMax().decide(request(DOC, tokens=20_000), below).verdict is Verdict.DISPATCH
    one_down = view(fleet(ready=[True, False]), inflight={DOC: int(per_instance)})
    assert SLOMax().decide(request(DOC, tokens=20_000), one_down).reason == "concurrency"
    quota = ClassQuota(task_class=DOC, max_concurrency=100)
    assert (
        SLOMax()
        .decide(request(DOC, tokens=20_000), view(quotas={DOC: quota}, inflight={DOC: 50}))
        .verdict
        is Verdict.DISPATCH
    )


def test_a_request_that_cannot_meet_its_objective_is_refused_early() -> None:
    decision = SLOMax().decide(request(CHAT), view(predicted=[2.5, 2.1]))  # objective 2 s
    assert (decision.verdict, decision.reason) == (Verdict.REJECT, "predicted_ttft")
    assert decision.retry_after_s == SLOMaxParams().retry_after_s
    # time already spent waiting counts against it
    late = SLOMax().decide(request(CHAT, arrival=0.0), view(now=1.5, predicted=[0.6, 0.6]))
    assert late.reason == "predicted_ttft"
    batch = request(BATCH, deadline=10.0)
    assert SLOMax().decide(batch, view(now=9.0, predicted=[1.5, 1.2])).reason == "deadline"
    assert SLOMax().decide(batch, view(now=9.0, predicted=[1.5, 0.9])).verdict is Verdict.DISPATCH
    blind = SLOMax(SLOMaxParams(early_rejection=False))
    assert blind.decide(request(CHAT), view(predicted=[2.5, 2.1])).verdict is Verdict.DISPATCH
    # a tenant's own, tighter objective: 0.5 s to the first token
    strict = replace(request(CHAT), objective=ClassObjective(ttft_s=0.5))
    assert SLOMax().decide(request(CHAT), view(predicted=[0.8, 0.9])).verdict is Verdict.DISPATCH
    assert SLOMax().decide(strict, view(predicted=[0.8, 0.9])).reason == "predicted_ttft"


def test_a_held_request_is_answered_without_retry_after_and_holds_end_in_time() -> None:
    held = SLOMax().decide(request(CHAT), view(now=1.9, predicted=[0.3, 0.3]), held=True)
    assert (held.verdict, held.retry_after_s) == (Verdict.REJECT, None)
    waiting = SLOMax().decide(
        request(BATCH, deadline=100.0), view(fleet(waiting=(1, 1)), predicted=[4.0, 5.0])
    )
    assert waiting.verdict is Verdict.HOLD
    assert waiting.hold_until_s == pytest.approx(96.0)  # the last start that can still make it
    undated = SLOMax().decide(request(BATCH, arrival=5.0), view(fleet(waiting=(1, 1)), now=5.0))
    assert (undated.verdict, undated.hold_until_s) == (Verdict.HOLD, 605.0)  # its client's timeout


def test_arrivals_queue_behind_their_pool_and_the_pool_is_bounded() -> None:
    pools = {CHAT: PoolState(depth=3, drained_per_s=10.0)}
    behind = SLOMax().decide(request(CHAT), view(predicted=[0.2, 0.2], pools=pools))
    assert (behind.verdict, behind.reason) == (Verdict.HOLD, "behind_pool")
    assert dict(behind.figures)["pool_wait_s"] == pytest.approx(0.3)
    # the same request, first in the pool, starts
    first = SLOMax().decide(request(CHAT), view(predicted=[0.2, 0.2], pools=pools), held=True)
    assert first.verdict is Verdict.DISPATCH
    slow = {CHAT: PoolState(depth=3, drained_per_s=1.0)}  # 3 s to wait: past the objective
    assert (
        SLOMax().decide(request(CHAT), view(predicted=[0.2, 0.2], pools=slow)).reason
        == "predicted_ttft"
    )
    full = {BATCH: PoolState(depth=2, drained_per_s=0.0)}
    small = SLOMax(SLOMaxParams(pool_depth=2))
    assert (
        small.decide(request(BATCH), view(fleet(waiting=(1, 1)), pools=full)).reason == "pool_full"
    )
    no_pools = SLOMax(SLOMaxParams(class_pools=False))
    refused = no_pools.decide(request(BATCH), view(fleet(waiting=(1, 1))))
    assert (refused.verdict, refused.reason) == (Verdict.REJECT, "reservation")


def test_a_class_at_its_concurrency_quota_waits() -> None:
    quota = ClassQuota(task_class=BATCH, tokens_per_s=1e6, burst_tokens=10**6, max_concurrency=2)
    at = view(quotas={BATCH: quota}, inflight={BATCH: 2})
    assert SLOMax().decide(request(BATCH), at).reason == "concurrency"
    below = view(quotas={BATCH: quota}, inflight={BATCH: 1})
    assert SLOMax().decide(request(BATCH), below).verdict is Verdict.DISPATCH


def test_pools_order_each_class_as_it_needs_and_let_expired_holds_go() -> None:
    pools: ClassPools[str] = ClassPools()
    pools.hold(Waiting(request(CHAT, arrival=2.0, rid="late"), "late", 9.0))
    pools.hold(Waiting(request(CHAT, arrival=1.0, rid="early"), "early", 5.0))
    pools.hold(Waiting(request(BATCH, arrival=0.0, deadline=500.0, rid="b1"), "b1", 400.0))
    pools.hold(Waiting(request(BATCH, arrival=3.0, deadline=100.0, rid="b2"), "b2", 50.0))
    assert pools.head(CHAT).payload == "early"
    assert pools.head(BATCH).payload == "b2"  # the nearer deadline first
    assert [w.payload for w in pools.expired(6.0)] == ["early"]
    assert pools.head(CHAT).payload == "late"
    assert pools.release(BATCH, now_s=7.0).payload == "b2"
    assert pools.state(BATCH, 7.0).depth == 1
    assert pools.state(BATCH, 7.0).drained_per_s > 0
    assert len(pools) == 2
    assert [w.payload for w in pools.expired(50.0)] == ["late"]  # b2 left: no second answer
    with pytest.raises(LookupError):
        pools.release(DOC, now_s=7.0)


def test_batch_without_a_deadline_waits_behind_batch_with_one() -> None:
    """By arrival among themselves, but after every dated request, even one whose
    deadline is far behind the undated one's arrival."""
    pools: ClassPools[str] = ClassPools()
    pools.hold(Waiting(request(BATCH, arrival=0.0, rid="u1"), "u1", float("inf")))
    pools.hold(Waiting(request(BATCH, arrival=10.0, deadline=86_400.0, rid="d"), "d", 1e5))
    pools.hold(Waiting(request(BATCH, arrival=5.0, rid="u2"), "u2", float("inf")))
    assert [pools.release(BATCH, now_s=20.0).payload for _ in range(3)] == ["d", "u1", "u2"]


def test_released_requests_do_not_pile_up_in_the_pools_heaps() -> None:
    """Held with a day's deadline and released at once, again and again: the entries
    they leave behind are dropped, not kept until their deadlines come."""
    pools: ClassPools[int] = ClassPools()
    for n in range(20_000):
        pools.hold(
            Waiting(request(BATCH, arrival=n, deadline=n + 86_400.0, rid=f"r{n}"), n, n + 86_400.0)
        )
        pools.release(BATCH, now_s=n)
    assert len(pools) == 0
    assert len(pools._ends) <= STALE_ENTRIES_KEPT
    pools.hold(Waiting(request(BATCH, arrival=1.0, deadline=2.0, rid="last"), -1, 2.0))
    assert [w.payload for w in pools.expired(3.0)] == [-1]


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
    assert (answered.admission.verdict, answered.admission.reason) == (Verdict.REJECT, "expired")
    assert len(pipeline.pools) == 0


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


def test_prompts_routed_and_not_yet_prefilled_count_against_the_interactive_reserve() -> None:
    """The scrape shows 70 % of KV in use, but the prompts routed since, not yet prefilled
    (the hosts' pending prefill: 40,000 tokens an instance, 2,500 blocks of 16), will take
    25 % more: a long document waits, where the scrape alone would let it start."""
    scraped = fleet(kv_used=(7_000, 7_000))
    doc = request(DOC, tokens=20_000)
    assert SLOMax().decide(doc, view(scraped)).verdict is Verdict.DISPATCH
    promised = replace(scraped, pending_prefill_tokens=np.array([40_000.0, 40_000.0]))
    decision = SLOMax().decide(doc, view(promised))
    assert (decision.verdict, decision.reason) == (Verdict.HOLD, "reservation")
    assert dict(decision.figures)["kv_use"] == pytest.approx(0.95)


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

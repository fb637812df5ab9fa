"""SLOMax's decisions and the class pools (the baselines: test_admission_baselines.py; the
pipeline that hosts them: test_pipeline.py)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from control.admission.pools import STALE_ENTRIES_KEPT, ClassPools, Waiting
from control.admission.request import LONG_DOCUMENT_TOKENS, AdmissionRequest, identify
from control.admission.slomax import SLOMax, SLOMaxParams
from control.admission.view import (
    EXPIRED,
    MAX_HOLD,
    AdmissionDecision,
    AdmissionView,
    PoolState,
    Verdict,
)
from control.routing import FleetSnapshot, PoolModel
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


def test_a_request_no_wait_would_bring_within_its_objective_is_judged_on_load_alone() -> None:
    """Its own prefill misses the objective on an idle instance (2.5 s of a 2 s chat):
    rejecting it as 'retry later' would turn its every retry away; it starts where the
    fleet has room, and waits where it has none, as a request with no first-token
    objective does."""
    too_long = request(CHAT, tokens=60_000, arrival=3.0)
    idle = SLOMax().decide(too_long, view(now=3.0, predicted=[2.6, 2.7], idle_ttft_s=2.5))
    assert (idle.verdict, idle.reason) == (Verdict.DISPATCH, "admitted")
    queued = {CHAT: PoolState(depth=3, drained_per_s=1.0)}
    busy = view(now=3.0, predicted=[9.0, 9.5], idle_ttft_s=2.5, pools=queued)
    behind = SLOMax().decide(too_long, busy)
    assert (behind.verdict, behind.reason) == (Verdict.HOLD, "behind_pool")
    assert (behind.hold_until_s, behind.expires_as) == (603.0, MAX_HOLD)
    # no instance ready: an infinite prediction, which says nothing of the request
    down = view(fleet(ready=[False, False]), now=3.0, predicted=[np.inf] * 2, idle_ttft_s=np.inf)
    waits = SLOMax().decide(too_long, down)
    assert (waits.verdict, waits.hold_until_s, waits.expires_as) == (Verdict.HOLD, 5.0, EXPIRED)
    # one that an idle instance would serve in time is still refused on load
    fits = SLOMax().decide(request(CHAT), view(predicted=[2.6, 2.7], idle_ttft_s=0.4))
    assert fits.reason == "predicted_ttft"
    # a deadline still holds: work past it is lost whatever the objective
    batch = request(BATCH, deadline=10.0)
    late = SLOMax().decide(batch, view(now=9.0, predicted=[1.5, 1.2], idle_ttft_s=1.2))
    assert late.reason == "deadline"


def test_a_held_request_is_answered_without_retry_after_and_holds_end_in_time() -> None:
    held = SLOMax().decide(request(CHAT), view(now=1.9, predicted=[0.3, 0.3]), held=True)
    assert (held.verdict, held.retry_after_s) == (Verdict.REJECT, None)
    waiting = SLOMax().decide(
        request(BATCH, deadline=100.0), view(fleet(waiting=(1, 1)), predicted=[4.0, 5.0])
    )
    assert waiting.verdict is Verdict.HOLD
    assert waiting.hold_until_s == pytest.approx(96.0)  # the last start that can still make it
    assert waiting.expires_as == EXPIRED
    undated = SLOMax().decide(request(BATCH, arrival=5.0), view(fleet(waiting=(1, 1)), now=5.0))
    assert (undated.verdict, undated.hold_until_s) == (Verdict.HOLD, 605.0)  # its client's timeout
    assert undated.expires_as == MAX_HOLD  # it had no objective to miss


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
    # engines that page KV in blocks of 64 tokens: the same prompts take a quarter as many
    paged = replace(promised, kv_block_size=np.array([64, 64]))
    assert view(paged).kv_use() == pytest.approx(0.70 + 0.25 / 4)
    assert SLOMax().decide(doc, view(paged)).reason == "prefill_cap"  # past the reserve

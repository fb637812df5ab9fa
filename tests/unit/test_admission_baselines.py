"""The baseline admission policies (as their projects run them: ``docs/admission.md``
says what each sees), the registry that names them, and SLOMax's ablations."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from control.admission.baselines import (
    DynamoRouterQueue,
    Fcfs,
    FlowControlParams,
    LitellmParams,
    LitellmPriority,
    LlmdFlowControl,
    MooncakeEarlyReject,
    MooncakeParams,
    VllmPriority,
    saturation,
)
from control.admission.registry import (
    ABLATIONS,
    ADMISSIONS,
    CONTROLLED,
    SLOMAX_MECHANISMS,
    make_admission,
)
from control.admission.slomax import SLOMax, SLOMaxParams
from control.admission.view import (
    MAX_HOLD,
    USAGE_WINDOW_S,
    PoolState,
    Usage,
    Verdict,
)
from control.pipeline import Pipeline
from control.routing import (
    PoolModel,
    RouteRequest,
    make_router,
)
from control.step_time import KneeRoofline
from tests.unit.test_admission import BATCH, CHAT, DOC, fleet, request, view


def test_admission_policies_by_name() -> None:
    assert isinstance(make_admission("fcfs"), Fcfs)
    assert isinstance(make_admission("slomax"), SLOMax)
    assert make_admission("vllm_priority").engine_scheduling == "priority"
    assert isinstance(make_admission("vllm_priority"), VllmPriority)
    with pytest.raises(ValueError, match="prices queues on the pool's step model"):
        make_admission("mooncake_early_reject")
    with pytest.raises(KeyError, match="known: dynamo_router_queue, fcfs, litellm_priority"):
        make_admission("nope")
    assert make_admission("slomax_without_class_pools").name == "slomax_without_class_pools"
    with pytest.raises(KeyError, match="unknown admission policy 'slomax_without_class_pools'"):
        make_admission("slomax_without_class_pools", ablations=False)  # as a gateway asks


def test_dynamo_s_queue_holds_while_every_worker_is_prefill_busy() -> None:
    queue = DynamoRouterQueue()
    busy = 16 * 8192 + 1  # past its threshold of 16 x max_num_batched_tokens
    assert queue.decide(request(), view(fleet(pending=(busy, busy)))).verdict is Verdict.HOLD
    one_free = view(fleet(pending=(busy, 16 * 8192)))
    assert queue.decide(request(), one_free).verdict is Verdict.DISPATCH
    backlog = view(fleet(), pools={CHAT: PoolState(depth=1)})
    held = queue.decide(request(), backlog)
    assert (held.verdict, held.hold_until_s) == (Verdict.HOLD, float("inf"))  # no timeout
    assert queue.decide(request(), backlog, held=True).verdict is Verdict.DISPATCH


def test_llm_d_s_flow_control_holds_everything_while_the_pool_is_saturated() -> None:
    control = LlmdFlowControl()
    # saturation: mean over endpoints of max(waiting / 5, KV use / 0.8)
    calm = fleet(waiting=(2, 0), kv_used=(4_000, 6_000))  # max(0.4, 0.5) and max(0, 0.75)
    assert saturation(view(calm), FlowControlParams()) == pytest.approx((0.5 + 0.75) / 2)
    assert control.decide(request(BATCH), view(calm)).verdict is Verdict.DISPATCH
    full = fleet(waiting=(5, 6), kv_used=(1_000, 1_000))
    held = control.decide(request(CHAT), view(full, now=3.0))
    assert (held.verdict, held.hold_until_s) == (Verdict.HOLD, 63.0)  # 60 s, then 503
    assert held.expires_as == MAX_HOLD  # its TTL, which says nothing of an objective
    behind = view(calm, pools={BATCH: PoolState(depth=1)})
    assert control.decide(request(BATCH), behind).verdict is Verdict.HOLD  # FCFS in its band
    assert control.decide(request(BATCH), behind, held=True).verdict is Verdict.DISPATCH
    crowded = view(full, pools={CHAT: PoolState(depth=5000)})
    assert control.decide(request(CHAT), crowded).verdict is Verdict.REJECT


def test_llm_d_s_flow_control_lets_held_requests_go_one_per_millisecond() -> None:
    pipeline: Pipeline[str] = Pipeline(LlmdFlowControl(), make_router("round_robin"))
    saturated, calm = fleet(waiting=(9, 9)), fleet()
    for n in range(5):
        route = RouteRequest(f"r{n}", 100, 10)
        pipeline.arrive(request(rid=f"r{n}", arrival=0.0), route, f"r{n}", saturated, now=0.0)
    assert len(pipeline.pools) == 5
    assert len(pipeline.release(lambda: calm, now=0.002)) == 2
    assert len(pipeline.release(lambda: calm, now=0.0025)) == 0
    assert len(pipeline.release(lambda: calm, now=0.0031)) == 1  # the half tick carried over
    assert len(pipeline.release(lambda: calm, now=0.010)) == 2


def test_llm_d_s_flow_control_saves_no_ticks_while_nothing_waits() -> None:
    """Its dispatch loop lets one request go per 1 ms tick, and a tick with nothing queued
    lets nothing go: after 10 s with the pools empty, requests held now leave at one a
    millisecond from now (the ticks of those 10 s were saved: all five left at once)."""
    pipeline: Pipeline[str] = Pipeline(LlmdFlowControl(), make_router("round_robin"))
    saturated, calm = fleet(waiting=(9, 9)), fleet()
    first = RouteRequest("r0", 100, 10)
    pipeline.arrive(request(rid="r0"), first, "r0", saturated, now=0.0)
    assert len(pipeline.release(lambda: calm, now=0.0015)) == 1
    for n in range(1, 6):
        route = RouteRequest(f"r{n}", 100, 10)
        pipeline.arrive(request(rid=f"r{n}", arrival=10.0), route, f"r{n}", saturated, now=10.0)
    assert len(pipeline.release(lambda: calm, now=10.002)) == 2


def test_litellm_holds_every_priority_to_its_share_once_the_model_is_half_used() -> None:
    # two ready deployments of 100 rpm and 1,000 tpm: the model group's limits are 200 and 2,000
    params = LitellmParams(rpm_per_instance=100, tpm_per_instance=1_000)
    limiter = LitellmPriority(params)
    below = view(usage={BATCH: Usage(requests=90)})  # saturation 0.45: batch may borrow
    assert limiter.decide(request(BATCH), below).verdict is Verdict.DISPATCH
    half = view(usage={BATCH: Usage(requests=90), CHAT: Usage(output_tokens=1_000)})
    refused = limiter.decide(request(BATCH), half)  # 0.5 saturated: batch's share is 25 %
    assert (refused.verdict, refused.reason, refused.retry_after_s) == (
        Verdict.REJECT,
        "priority_limit",
        None,
    )
    assert limiter.decide(request(CHAT), half).verdict is Verdict.DISPATCH
    full = view(usage={CHAT: Usage(output_tokens=2_000)})  # the model's own limit binds everyone
    assert limiter.decide(request(CHAT), full).reason == "model_limit"


def test_the_pipeline_counts_usage_in_fixed_windows() -> None:
    pipeline: Pipeline[str] = Pipeline(Fcfs(), make_router("round_robin"))
    for n, now in enumerate((0.0, 10.0)):
        pipeline.arrive(request(rid=f"r{n}"), RouteRequest(f"r{n}", 10, 10), "", fleet(), now)
    pipeline.finished("r0", 20.0, completed_tokens=7)
    assert pipeline.usage[CHAT] == Usage(requests=2, output_tokens=7)
    late = USAGE_WINDOW_S + 1.0  # the window that opened at 0 s has closed: a new one opens
    pipeline.arrive(request(rid="r2"), RouteRequest("r2", 10, 10), "", fleet(), late)
    assert pipeline.usage[CHAT] == Usage(requests=1)


def test_mooncake_runs_only_behind_a_router_that_predicts_ttft() -> None:
    """Behind round robin it had no prediction, and refused every request (no_instance),
    an idle fleet's too."""
    steps = KneeRoofline(0.01, 0.0, 0, 0.0, 0.0)
    conductor = MooncakeEarlyReject(PoolModel(steps))
    with pytest.raises(ValueError, match="'mooncake_early_reject' needs a router that predicts"):
        Pipeline(conductor, make_router("round_robin"))
    Pipeline(conductor, make_router("tokenpilot", pool=PoolModel(steps)))
    Pipeline(SLOMax(), make_router("round_robin"))  # SLOMax rejects nothing early without


def test_mooncake_refuses_what_would_meet_a_decode_batch_too_slow_for_its_tbt_limit() -> None:
    # each step: 0.01 s plus 0.01 s per sequence decoding
    steps = KneeRoofline(
        a_s=0.01, b_s_per_token=0.0, n0_tokens=0, c_s_per_seq=0.01, d_s_per_context_token=0.0
    )
    conductor = MooncakeEarlyReject(PoolModel(steps), MooncakeParams(decode_time_s=10.0))
    # two instances; seven requests in flight, three decoding since 0, 5 and 12 s
    since = {"a": 0.0, "b": 5.0, "c": 12.0}
    state = {"inflight": {CHAT: 7}, "first_tokens": since}
    # starting to decode at 20 s: 4 still prefilling, 1 decoding (since 12 s), itself:
    # 6 over two instances, 3 each: 0.04 s a token
    ok = view(now=15.0, predicted=(5.0, 6.0), **state)
    assert conductor.predicted_tbt_s(ok, 20.0) == pytest.approx(0.04)
    assert conductor.decide(request(DOC), ok).verdict is Verdict.DISPATCH
    late = view(now=15.0, predicted=(35.0, 40.0), **state)  # past the document's 30 s
    assert conductor.decide(request(DOC), late).reason == "predicted_ttft"
    crowded = view(now=15.0, predicted=(5.0, 6.0), inflight={CHAT: 22}, first_tokens=since)
    # 19 prefilling + 1 + itself = 21, 11 each: 0.12 s a token, over the 0.1 s limit
    assert conductor.decide(request(BATCH), crowded).reason == "predicted_tbt"


def test_mooncake_counts_the_context_in_each_engine_s_own_blocks() -> None:
    """Two sequences of 16,000 tokens each: one engine holds its sequence's in 1,000
    blocks of 16, the other in 250 blocks of 64. The decode step is priced by context."""
    steps = KneeRoofline(
        a_s=0.0, b_s_per_token=0.0, n0_tokens=0, c_s_per_seq=0.0, d_s_per_context_token=1e-6
    )
    conductor = MooncakeEarlyReject(PoolModel(steps))
    sixteens = fleet(running=(1, 1), kv_used=(1_000, 1_000))
    mixed = replace(fleet(running=(1, 1), kv_used=(1_000, 250)), kv_block_size=np.array([16, 64]))
    expected = conductor.predicted_tbt_s(view(sixteens, predicted=(1.0, 1.0)), 0.0)
    assert conductor.predicted_tbt_s(view(mixed, predicted=(1.0, 1.0)), 0.0) == expected


def test_each_ablation_is_slomax_with_one_part_off() -> None:
    """The benchmark's ablation: a name per mechanism, built with only that one switched
    off, still driven by the controller; and one without the controller."""
    for mechanism in SLOMAX_MECHANISMS:
        name = f"slomax_without_{mechanism}"
        policy = make_admission(name)
        assert isinstance(policy, SLOMax)
        assert policy.name == name
        off = {m for m in SLOMAX_MECHANISMS if not getattr(policy.params, m)}
        assert off == {mechanism}
        assert name in CONTROLLED
    static = make_admission("slomax_without_controller")
    assert isinstance(static, SLOMax)
    assert static.params == SLOMaxParams()
    assert "slomax_without_controller" not in CONTROLLED
    assert not set(ABLATIONS) & set(ADMISSIONS)  # not offered to gateways

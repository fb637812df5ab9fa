"""FleetMind's DC choice and the baselines' on the edge's view of the fleet: the hard
filters hold for every policy, then FleetMind prices what is left."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from control.fleet.baselines import EnvoyPriorityFailover
from control.fleet.fleetmind import FleetMind, FleetMindParams
from control.fleet.locality import PrefixLocality
from control.fleet.registry import DC_POLICIES, make_dc_policy
from control.fleet.view import DataCenterState, DcRequest, FleetState
from control.routing.tokenpilot import INDEX_STRIDE

B, C, D = "dc-b", "dc-c", "dc-d"
RTT = {
    **{pair: 0.09 for pair in (("eu", "us"), ("us", "eu"))},
    **{pair: 0.15 for pair in (("asia", "eu"), ("eu", "asia"))},
    **{pair: 0.20 for pair in (("asia", "us"), ("us", "asia"))},
}


def dc(name: str, region: str, **state: object) -> DataCenterState:
    defaults = {
        "ready_instances": 4,
        "instances": 4,
        "ready_versions": frozenset({"v2"}),
        "versions": frozenset({"v1", "v2"}),
    }
    return DataCenterState(name, region, **{**defaults, **state})  # type: ignore[arg-type]


def fleet(*dcs: DataCenterState) -> FleetState:
    return FleetState(dcs, RTT)


def asked(source: str = "eu", **fields: object) -> DcRequest:
    return DcRequest("r", source, **fields)  # type: ignore[arg-type]


def test_the_hard_filters_say_why_each_dc_is_out() -> None:
    old = frozenset({"v1"})
    view = fleet(
        dc(B, "eu"),
        dc(C, "us"),
        dc(D, "eu", ready_versions=old),  # v2 deployed, not ready yet
        dc("dc-e", "us"),
        dc("dc-f", "eu", ready_versions=old, versions=old),
    )
    request = asked(
        tenant_dcs=frozenset({B, C, D, "dc-f"}), residency=frozenset({"eu"}), version="v2"
    )
    decision = FleetMind().choose(request, view)
    assert decision.order == (B,)
    assert dict(decision.excluded) == {
        C: "residency",
        D: "not_ready",
        "dc-e": "permission",
        "dc-f": "not_deployed",
    }


def test_where_no_dc_is_ready_the_deployed_ones_stay_for_their_admission_to_hold() -> None:
    restarting = fleet(dc(B, "eu", ready_instances=0), dc(C, "us", ready_instances=0))
    assert FleetMind().choose(asked(), restarting).order == (B, C)


def test_among_equals_the_dc_that_took_the_request_keeps_it() -> None:
    twins = fleet(dc(B, "eu"), dc(D, "eu"))
    assert FleetMind().choose(asked(source_dc=D), twins).order == (D, B)
    assert make_dc_policy("local_only").choose(asked(source_dc=D), twins).order == (D,)


def test_the_local_dc_wins_while_it_has_room_and_a_short_queue() -> None:
    view = fleet(dc(B, "eu", predicted_wait_s=0.05), dc(C, "us"))
    decision = FleetMind().choose(asked(), view)
    assert decision.order == (B, C)  # C is the fallback
    assert decision.costs[C]["rtt_s"] == 0.09


def test_a_queue_longer_than_the_trip_sends_the_request_away() -> None:
    view = fleet(dc(B, "eu", predicted_wait_s=2.0), dc(C, "us", predicted_wait_s=0.1))
    assert FleetMind().choose(asked(input_tokens=8_000), view).order == (C, B)


def test_a_full_dc_comes_after_every_dc_with_room_and_keeps_a_reserve_for_its_region() -> None:
    hot = dc(B, "eu", utilisation=0.95)
    assert FleetMind().choose(asked(), fleet(hot, dc(C, "us", predicted_wait_s=5.0))).order == (
        C,
        B,
    )
    # at 85 % C still has room for its own region's clients, not for others
    warm = dc(C, "us", utilisation=0.85)
    other = dc(D, "asia", predicted_wait_s=1.0)
    assert FleetMind().choose(asked("us"), fleet(warm, other)).chosen == C
    assert FleetMind().choose(asked("eu"), fleet(warm, other)).chosen == D


def test_the_controller_s_weight_scales_the_capacity_counted_on() -> None:
    busy = {"predicted_wait_s": 0.06, "utilisation": 0.6}
    assert FleetMind().choose(asked(), fleet(dc(B, "eu", **busy), dc(C, "us"))).chosen == B
    decision = FleetMind().choose(asked(), fleet(dc(B, "eu", weight=0.5, **busy), dc(C, "us")))
    assert decision.chosen == C  # 0.12 s behind B's backlog on half its capacity: 90 ms is less
    assert decision.costs[B]["wait_s"] == pytest.approx(0.12)
    full = fleet(dc(B, "eu", weight=0.6, utilisation=0.6), dc(C, "us"))
    assert FleetMind().choose(asked(), full).order == (C, B)  # 0.6 of 0.6 counted on: full
    drained = fleet(dc(B, "eu", weight=0.0), dc(C, "us", utilisation=2.0))
    assert FleetMind().choose(asked(), drained).order == (C, B)  # weight 0: full, last
    nothing_counted_on = fleet(
        dc(C, "us", weight=0.0), dc(D, "asia", weight=0.0), dc(B, "eu", weight=0.0)
    )
    assert FleetMind().choose(asked(), nothing_counted_on).order == (B, C, D)  # nearest first


def test_a_warm_prefix_biases_the_choice_where_warmth_is_priced() -> None:
    priced = FleetMind(FleetMindParams(prefill_s_per_token=2e-5))
    warm = fleet(dc(B, "eu"), dc(C, "us", warm_tokens=8192))
    assert priced.choose(asked(), warm).chosen == C  # 8k tokens of prefill beat 90 ms
    assert FleetMind().choose(asked(), warm).chosen == B  # by default, warmth is not priced
    lukewarm = fleet(dc(B, "eu"), dc(C, "us", warm_tokens=1024))
    assert priced.choose(asked(), lukewarm).chosen == B


def test_local_only_runs_at_home_or_nowhere() -> None:
    local_only = make_dc_policy("local_only")
    view = fleet(dc(B, "eu", utilisation=3.0), dc(C, "us"))
    assert local_only.choose(asked(), view).order == (B,)  # however busy
    assert local_only.choose(asked("asia"), view).order == (B,)  # no GPUs there: the nearest
    assert local_only.choose(asked(version="v3"), view).order == ()
    with pytest.raises(KeyError, match="known: envoy_priority_failover, fleetmind, gcp"):
        make_dc_policy("nope")


def test_envoy_spills_what_a_level_s_health_cannot_carry_to_the_next() -> None:
    envoy = EnvoyPriorityFailover()
    half = dc(B, "eu", ready_instances=2, instances=4)  # health min(100, 140 * 2 // 4) = 70
    whole = dc(C, "us", instances=4)
    assert envoy.priority_loads([half, whole]) == [70, 30]
    assert envoy.choose(asked(draw=0.69), fleet(half, whole)).order == (B, C)
    assert envoy.choose(asked(draw=0.70), fleet(half, whole)).order == (C, B)
    five_of_seven = dc(B, "eu", ready_instances=5, instances=7)  # 1.4 x 71 % = all of it
    assert envoy.priority_loads([five_of_seven, whole]) == [100, 0]
    sick = [dc(n, "eu", ready_instances=1, instances=5) for n in (B, C)]  # 28 each, in panic
    assert envoy.priority_loads(sick) == [50, 50]
    assert envoy.choose(asked(), fleet(dc(B, "eu", utilisation=5.0), whole)).chosen == B


def test_gcp_waterfall_fills_the_nearest_region_to_its_capacity_then_spills() -> None:
    gcp = make_dc_policy("gcp_waterfall")
    near, far = dc(B, "eu", instances=4), dc(C, "us", instances=4)
    assert gcp.choose(asked(), fleet(near, far)).order == (B, C)
    assert gcp.choose(asked(), fleet(dc(B, "eu", instances=4, utilisation=0.8), far)).chosen == C
    unhealthy = dc(B, "eu", ready_instances=2, instances=4)  # 50 % healthy, under 70 %
    assert gcp.choose(asked(), fleet(unhealthy, far)).chosen == C
    both_full = fleet(
        dc(B, "eu", instances=4, utilisation=1.5), dc(C, "us", instances=4, utilisation=0.9)
    )
    assert gcp.choose(asked(), both_full).chosen == C  # undocumented upstream: least utilised


def test_skyserve_takes_the_least_loaded_replicas_however_far() -> None:
    skyserve = make_dc_policy("skyserve_least_load")
    view = fleet(dc(B, "eu", inflight_requests=12.0), dc(C, "asia", inflight_requests=8.0))
    assert skyserve.choose(asked(), view).order == (C, B)  # 2 a replica against 3
    tie = fleet(dc(B, "eu"), dc(C, "us"))
    assert {skyserve.choose(asked(draw=d), tie).chosen for d in (0.0, 0.6)} == {B, C}


def test_llm_d_multicluster_scores_free_kv_and_the_shortest_queue() -> None:
    llmd = make_dc_policy("llmd_multicluster")
    view = fleet(dc(B, "eu", kv_use=0.9, queue=0.0), dc(C, "us", kv_use=0.2, queue=4.0))
    decision = llmd.choose(asked(), view)
    assert decision.costs[B]["score"] == pytest.approx(1.1)  # 0.1 + 1
    assert decision.costs[C]["score"] == pytest.approx(0.8)  # 0.8 + 0
    assert decision.order == (B, C)


REGIONS = ("eu", "us", "asia")
NAMES = tuple(f"dc-{n}" for n in range(5))


@st.composite
def fleets_and_requests(draw: st.DrawFn) -> tuple[FleetState, DcRequest]:
    dcs = tuple(
        DataCenterState(
            name,
            draw(st.sampled_from(REGIONS)),
            ready_instances=draw(st.integers(0, 3)),
            ready_versions=frozenset(draw(st.sets(st.sampled_from(("v1", "v2"))))),
            versions=frozenset(draw(st.sets(st.sampled_from(("v1", "v2"))))),
            utilisation=draw(st.floats(0, 3)),
            predicted_wait_s=draw(st.floats(0, 10)),
            weight=draw(st.none() | st.floats(0, 1)),
            warm_tokens=draw(st.integers(0, 100_000)),
            instances=draw(st.integers(0, 6)),
            inflight_requests=draw(st.floats(0, 50)),
            kv_use=draw(st.floats(0, 1)),
            queue=draw(st.floats(0, 20)),
        )
        for name in draw(st.lists(st.sampled_from(NAMES), min_size=1, max_size=5, unique=True))
    )
    request = DcRequest(
        "r",
        draw(st.sampled_from(REGIONS)),
        draw(st.none() | st.sampled_from(NAMES)),
        draw(st.integers(0, 100_000)),
        draw(st.none() | st.frozensets(st.sampled_from(NAMES))),
        draw(st.frozensets(st.sampled_from(REGIONS))),
        draw(st.none() | st.sampled_from(("v1", "v2"))),
        draw(st.floats(0, 1, exclude_max=True)),
    )
    return FleetState(dcs, RTT), request


@settings(max_examples=300, deadline=None)
@given(fleets_and_requests())
def test_no_policy_ever_sends_a_request_where_it_may_not_run(
    case: tuple[FleetState, DcRequest],
) -> None:
    view, request = case
    by_name = {d.name: d for d in view.dcs}
    somewhere_ready = any(
        d.ready_instances > 0
        and d.instances > 0
        and (request.tenant_dcs is None or d.name in request.tenant_dcs)
        and (not request.residency or d.region in request.residency)
        and (request.version is None or request.version in d.ready_versions & d.versions)
        for d in view.dcs
    )
    for policy in DC_POLICIES.values():
        decision = policy().choose(request, view)
        for name in decision.order:
            chosen = by_name[name]
            assert request.tenant_dcs is None or name in request.tenant_dcs
            assert not request.residency or chosen.region in request.residency
            assert chosen.instances > 0
            assert request.version is None or request.version in chosen.versions
            if somewhere_ready:  # none that is not, then
                assert chosen.ready_instances > 0
                assert request.version is None or request.version in chosen.ready_versions
        assert len(set(decision.order)) == len(decision.order)
        assert not set(decision.order) & set(decision.excluded)
    levels = [d for d in view.dcs if d.name not in FleetMind().choose(request, view).excluded]
    assert sum(EnvoyPriorityFailover().priority_loads(levels)) == (100 if levels else 0)
    fleetmind = FleetMind().choose(request, view)  # every allowed DC is a fallback
    assert set(fleetmind.order) | set(fleetmind.excluded) == set(by_name)


def test_load_is_priced_from_the_edges_own_counts_where_capacity_is_known() -> None:
    from control.fleet.load import DcLoad

    known = DcLoad(queued=50, completed_per_s=5.0, sent_per_s=9.0, inflight=30, capacity_rps=10.0)
    assert known.utilisation == pytest.approx(0.9)
    assert known.backlog_s == pytest.approx(3.0)  # 30 in flight at 10 a second


def test_without_capacity_load_is_the_edges_requests_per_instance_or_the_tables_queue() -> None:
    """Without the operator's figure the backlog is the edge's requests in flight per ready
    instance, at an assumed rate, as they grow with every send; or the tables' queue where
    that is more (other edges' requests, which this edge's count misses)."""
    from control.fleet.load import ASSUMED_RPS_PER_INSTANCE, DcLoad

    assert DcLoad(kv_use=0.4).utilisation == 0.4
    assert DcLoad(queued=3, kv_use=0.4).utilisation == 1.0
    assert DcLoad(queued=20, completed_per_s=4.0).backlog_s == pytest.approx(5.0)
    assert DcLoad(queued=3).backlog_s == pytest.approx(3 / ASSUMED_RPS_PER_INSTANCE)
    # a queue of 8 on 4 instances, its drain unseen (the live edge's case): 2 s
    assert DcLoad(queued=8, ready_instances=4).backlog_s == pytest.approx(
        2 / ASSUMED_RPS_PER_INSTANCE
    )
    sent = DcLoad(inflight=100, ready_instances=4)
    assert sent.backlog_s == pytest.approx(25 / ASSUMED_RPS_PER_INSTANCE)
    drained = DcLoad(inflight=100, queued=40, completed_per_s=4.0, ready_instances=4)
    assert drained.backlog_s == sent.backlog_s  # the queue's 10 s are less
    queued = DcLoad(inflight=8, queued=40, completed_per_s=2.0, ready_instances=4)
    assert queued.backlog_s == pytest.approx(40 / max(2.0, 4 * ASSUMED_RPS_PER_INSTANCE))


def test_without_capacity_a_burst_spreads_as_it_is_sent() -> None:
    """Two idle DCs, neither table showing a queue: the one the edge has sent more to
    costs more at once (pricing the queue alone, both read 0 until a table showed one)."""
    from control.fleet.load import DcLoad, dc_state

    def state(name: str, inflight: int) -> DataCenterState:
        load = DcLoad(inflight=inflight, ready_instances=4)
        frozen = frozenset({"1"})
        return dc_state(
            name,
            "eu",
            instances=4,
            versions=frozen,
            ready_versions=frozen,
            ready_instances=4,
            load=load,
        )

    view = FleetState((state(B, 12), state(C, 4)))
    assert FleetMind().choose(asked(), view).chosen == C


def test_a_dc_whose_admission_holds_the_class_back_is_full_for_it() -> None:
    view = fleet(dc(B, "eu", class_room=0.0), dc(C, "us", class_room=0.5))
    assert FleetMind().choose(asked(), view).order == (C, B)
    assert FleetMind().choose(asked(), fleet(dc(B, "eu", class_room=0.1), dc(C, "us"))).chosen == B


def test_a_prompt_is_warm_to_its_deepest_sampled_block_in_the_dc_it_last_went_to() -> None:
    """Every ``INDEX_STRIDE``-th block stands for its prefix; the oldest blocks go first past
    the capacity."""
    locality = PrefixLocality(capacity=3)
    prompt = tuple(range(3 * INDEX_STRIDE))  # three sampled blocks
    locality.sent(prompt[: 2 * INDEX_STRIDE], "b")
    locality.sent(prompt, "c")  # its first two sampled blocks too
    assert locality.warm_tokens(prompt) == {"c": 3 * INDEX_STRIDE * 16}
    locality.sent(prompt[:INDEX_STRIDE], "b")
    assert locality.warm_tokens(prompt) == {"b": INDEX_STRIDE * 16, "c": 3 * INDEX_STRIDE * 16}
    locality.sent(tuple(range(100, 100 + 2 * INDEX_STRIDE)), "d")  # two more: two forgotten
    assert locality.warm_tokens(prompt) == {"b": INDEX_STRIDE * 16}
    assert locality.warm_tokens(prompt[: INDEX_STRIDE - 1]) == {}  # no sampled block

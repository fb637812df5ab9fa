from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from control.routing import (
    ROUTERS,
    FleetSnapshot,
    Learner,
    Observation,
    PoolModel,
    ReadsKvEvents,
    RouteRequest,
    Withdrawing,
    implements,
    make_router,
)
from control.routing.baselines import PowerOfTwo
from control.routing.cache_aware import AibrixPrefixCache, DynamoKv, SglangCacheAware
from control.routing.llmd import LlmdDefault, queue_score
from control.routing.predicted_latency import LlmdPredictedLatency
from control.routing.prefix_index import ApproximatePrefixIndex, Recency
from control.step_time import KneeRoofline


def fleet(waiting, running=None, kv_used=None, kv_total=100, ready=None) -> FleetSnapshot:
    n = len(waiting)
    return FleetSnapshot(
        tuple(f"i{k}" for k in range(n)),
        np.array(ready if ready is not None else [True] * n),
        np.array(waiting, dtype=np.int64),
        np.array(running if running is not None else [0] * n, dtype=np.int64),
        np.zeros(n, dtype=np.int64),
        np.array(kv_used if kv_used is not None else [0] * n, dtype=np.int64),
        np.full(n, kv_total, dtype=np.int64),
    )


def test_the_prefix_index_matches_greedily_from_the_first_block() -> None:
    index = ApproximatePrefixIndex()
    index.add(0, [1, 2, 3])
    index.add(1, [1, 2])
    assert index.match([1, 2, 3, 4], instances=3).tolist() == [3, 2, 0]
    assert index.match([9, 1, 2], instances=3).tolist() == [0, 0, 0]


def test_the_prefix_index_forgets_least_recently_used_blocks_per_instance() -> None:
    index = ApproximatePrefixIndex()
    index.add(0, [1, 2], capacity=2)
    index.add(0, [3])  # evicts 1, the least recently used
    assert index.match([1, 2], instances=1).tolist() == [0]
    assert index.match([2, 3], instances=1).tolist() == [2]
    index.remove_instance(0)
    assert index.match([2, 3], instances=1).tolist() == [0]


INSTANCES = (0, 1, 2, 3, 9, 64, 70)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(INSTANCES), st.lists(st.integers(0, 6), max_size=6)),
        max_size=30,
    ),
    st.lists(st.integers(0, 6), max_size=8),
)
def test_the_prefix_index_matches_like_a_plain_greedy_count(
    adds: list[tuple[int, list[int]]], prompt: list[int]
) -> None:
    """Against the rule written plainly: while any instance holds block k, each holder
    gains one. Small LRUs make evictions (and so changing holder sets) common; instance
    numbers past 64 take the holders' bitmask past one machine word."""
    index = ApproximatePrefixIndex()
    held: dict[int, list[int]] = {}
    for instance, blocks in adds:
        index.add(instance, blocks, capacity=3)
        lru = held.setdefault(instance, [])
        for block in blocks:
            if block in lru:
                lru.remove(block)
            lru.append(block)
            del lru[:-3]
    expected = [0] * (max(INSTANCES) + 1)
    for block in prompt:
        holders = [i for i, lru in held.items() if block in lru]
        if not holders:
            break
        for i in holders:
            expected[i] += 1
    assert index.match(prompt, instances=len(expected)).tolist() == expected


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.one_of(
            st.tuples(st.just("touch"), st.lists(st.integers(0, 9), max_size=8)),
            st.tuples(st.just("evict"), st.integers(0, 6)),
            st.tuples(st.just("discard"), st.integers(0, 9)),
        ),
        max_size=40,
    )
)
def test_an_instance_lru_evicts_in_order_of_last_use(
    operations: list[tuple[str, object]],
) -> None:
    """Against a plain list in order of use."""
    lru, expected = Recency(), []
    for kind, argument in operations:
        if kind == "touch":
            assert isinstance(argument, list)
            new = [b for n, b in enumerate(argument) if b not in expected + argument[:n]]
            assert sorted(lru.touch(argument)) == sorted(new)
            for block in argument:
                if block in expected:
                    expected.remove(block)
                expected.append(block)
        elif kind == "evict":
            assert isinstance(argument, int)
            dropped = expected[: max(len(expected) - argument, 0)]
            assert list(lru.evict_beyond(argument)) == dropped
            del expected[: len(dropped)]
        else:
            assert lru.discard(argument) == (argument in expected)
            if argument in expected:
                expected.remove(argument)
        assert sorted(lru.blocks()) == sorted(expected)


def test_the_queue_score_scales_between_the_candidates_shortest_and_longest_queue() -> None:
    eligible = np.array([True, True, True, False])
    scores = queue_score(np.array([2, 5, 2, 80]), eligible)
    assert scores[:3].tolist() == [1.0, 0.0, 1.0]
    assert queue_score(np.array([3, 3]), np.array([True, True])).tolist() == [1.0, 1.0]


def test_llmd_default_weighs_prefix_3_queue_2_and_free_kv_2() -> None:
    router = LlmdDefault(np.random.default_rng(0))
    router.index.add(2, [7, 8])
    request = RouteRequest("r", 64, 10, prefix_blocks=(7, 8, 9, 10))
    decision = router.route(request, fleet([0, 4, 2], kv_used=[50, 0, 10]), now=0.0)
    # i0: 3*0 + 2*1 + 2*0.5 = 3.0;  i1: 3*0 + 2*0 + 2*1.0 = 2.0;  i2: 3*0.5 + 2*0.5 + 2*0.9 = 4.3
    np.testing.assert_allclose(-decision.scores, [3.0, 2.0, 4.3])
    assert decision.chosen == 2
    assert router.index.match((7, 8, 9, 10), 3).tolist() == [0, 0, 4]  # it learned the choice


def test_llmd_default_breaks_ties_at_random() -> None:
    chosen = {
        LlmdDefault(np.random.default_rng(seed))
        .route(RouteRequest("r", 10, 1), fleet([0, 0]), 0.0)
        .chosen
        for seed in range(20)
    }
    assert chosen == {0, 1}


def test_power_of_two_takes_the_less_loaded_of_two_random_instances() -> None:
    for seed in range(30):
        decision = PowerOfTwo(np.random.default_rng(seed)).route(
            RouteRequest("r", 10, 1), fleet([9, 0, 9], running=[0, 1, 0]), 0.0
        )
        drawn = np.flatnonzero(~np.isnan(decision.scores)).tolist()
        assert len(drawn) == 2
        assert decision.chosen in drawn
        if 1 in drawn:
            assert decision.chosen == 1


@pytest.mark.parametrize("name", sorted(ROUTERS))
def test_every_router_refuses_when_nothing_is_ready(name: str) -> None:
    pool = PoolModel(KneeRoofline(0.015, 3e-5, 150, 7e-6, 2.5e-8))
    decision = make_router(name, pool=pool).route(
        RouteRequest("r", 10, 1), fleet([0, 0], ready=[False, False]), 0.0
    )
    assert decision.chosen is None
    assert decision.candidates(fleet([0, 0])) == ()


@pytest.mark.parametrize("name", sorted(ROUTERS))
def test_implements_answers_as_isinstance_does(name: str) -> None:
    pool = PoolModel(KneeRoofline(0.015, 3e-5, 150, 7e-6, 2.5e-8))
    router = make_router(name, pool=pool)
    for protocol in (Learner, Withdrawing, ReadsKvEvents):
        assert implements(router, protocol) == isinstance(router, protocol)


def _snapshot(requests, inflight=None) -> FleetSnapshot:
    n = len(requests)
    return FleetSnapshot(
        tuple(f"i{k}" for k in range(n)),
        np.ones(n, dtype=bool),
        np.zeros(n, dtype=np.int64),
        np.array(requests, dtype=np.int64),
        np.array(inflight if inflight is not None else [0] * n, dtype=np.int64),
        np.zeros(n, dtype=np.int64),
        np.full(n, 1000, dtype=np.int64),
    )


PROMPT = RouteRequest("r", input_tokens=64, output_budget=8, prefix_blocks=(1, 2, 3, 4))


def test_dynamo_weighs_blocks_to_prefill_against_blocks_in_flight() -> None:
    router = DynamoKv(np.random.default_rng(0))
    router.index.add(0, [1, 2, 3])
    # i0: (64 - 48) / 16 + 160 / 16 = 11;  i1: 64 / 16 + 32 / 16 = 6
    decision = router.route(PROMPT, _snapshot([0, 0], inflight=[160, 32]), 0.0)
    np.testing.assert_allclose(decision.scores, [11.0, 6.0])
    assert decision.chosen == 1
    # with i0 nearly idle the cached prefix wins: 1 + 1 = 2 against 4 + 2 = 6
    router = DynamoKv(np.random.default_rng(0))
    router.index.add(0, [1, 2, 3])
    assert router.route(PROMPT, _snapshot([0, 0], inflight=[16, 32]), 0.0).chosen == 0


def test_dynamo_follows_kv_events_once_they_come_instead_of_its_own_decisions() -> None:
    router = DynamoKv(np.random.default_rng(0))
    request = RouteRequest("r", input_tokens=64, output_budget=8, prefix_blocks=(1, 2, 3, 4))
    chosen = router.route(request, _snapshot([0, 0]), 0.0).chosen
    assert router.index.match((1, 2, 3, 4), 2)[chosen] == 4  # approximate: what it sent
    router.kv_events(1, [(5, True), (6, True), (9, True), (9, False)])
    router.route(RouteRequest("s", 64, 8, (7, 8)), _snapshot([0, 0]), 0.0)
    assert router.index.match((7, 8), 2).tolist() == [0, 0]  # decisions no longer indexed
    assert router.index.match((5, 6, 9), 2).tolist() == [0, 2]  # events, in their order


@pytest.mark.parametrize(
    ("loads", "cached", "expected"),
    [
        ([100, 10], [1, 2, 3, 4], 1),  # imbalanced (90 > 64, 100 > 1.5 x 10): lowest load
        ([5, 3], [1, 2, 3], 0),  # balanced, 75 % matched > 30 %: the match
        ([5, 3], [1], 1),  # balanced, 25 % matched: lowest load
    ],
)
def test_sglang_gates_on_imbalance_then_on_a_30_percent_match(
    loads: list[int], cached: list[int], expected: int
) -> None:
    router = SglangCacheAware(np.random.default_rng(0))
    router.index.add(0, cached)
    assert router.route(PROMPT, _snapshot(loads), 0.0).chosen == expected


def test_aibrix_balances_past_a_spread_of_16_and_skips_busy_matches() -> None:
    router = AibrixPrefixCache(np.random.default_rng(0))
    router.index.add(0, [1, 2, 3, 4])
    assert router.route(PROMPT, _snapshot([20, 2, 3]), 0.0).chosen == 1  # spread 18 > 16
    router = AibrixPrefixCache(np.random.default_rng(0))
    router.index.add(2, [1, 2, 3])
    assert router.route(PROMPT, _snapshot([5, 4, 6]), 0.0).chosen == 2  # best match, calm
    # the only match runs 14 > mean 5 + 2 x std 3 = 11: least-request among the rest
    router = AibrixPrefixCache(np.random.default_rng(0))
    router.index.add(9, [1, 2, 3, 4])
    decision = router.route(PROMPT, _snapshot([4] * 9 + [14]), 0.0)
    assert decision.chosen in range(9)


def test_the_predicted_latency_model_learns_ttft_online_and_routes_by_it() -> None:
    rng = np.random.default_rng(1)
    router = LlmdPredictedLatency(np.random.default_rng(0), refit_every=50)

    def true_ttft(waiting: int, running: int, input_tokens: int) -> float:
        return 0.05 + 0.2 * waiting + 0.01 * running + 1e-5 * input_tokens

    for n in range(300):
        waiting = rng.integers(0, 6, size=4)
        running = rng.integers(0, 20, size=4)
        snapshot = fleet(waiting.tolist(), running=running.tolist())
        request = RouteRequest(f"r{n}", int(rng.integers(100, 4000)), 10)
        decision = router.route(request, snapshot, 0.0)
        chosen = decision.chosen
        ttft = true_ttft(waiting[chosen], running[chosen], request.input_tokens)
        router.observe(Observation(request.request_id, chosen, ttft, 10))
    probe = fleet([0, 5, 2, 3], running=[10, 0, 1, 2])
    decision = router.route(RouteRequest("probe", 1000, 10), probe, 0.0)
    expected = [true_ttft(w, r, 1000) for w, r in ((0, 10), (5, 0), (2, 1), (3, 2))]
    np.testing.assert_allclose(decision.parts["predicted_ttft_s"], expected, rtol=0.02)
    assert decision.chosen == 0


def test_matching_credits_every_block_an_instance_holds_while_anyone_holds_it() -> None:
    index = ApproximatePrefixIndex()
    index.add(0, [1, 3])
    index.add(1, [1, 2, 3])
    assert index.match([1, 2, 3, 4], instances=2).tolist() == [2, 3]


def test_a_strided_index_keeps_every_nth_block_and_counts_in_blocks() -> None:
    index = ApproximatePrefixIndex(stride=2)
    index.add(0, [1, 2, 3, 4, 5])
    assert index.match([1, 2, 3, 4, 5], instances=1).tolist() == [4]
    assert index.match([1, 2, 9, 9], instances=1).tolist() == [2]


def test_evictions_reported_by_the_engine_correct_the_index() -> None:
    index = ApproximatePrefixIndex(stride=2)
    index.add(0, [1, 2, 3, 4, 5, 6])  # keeps 2, 4 and 6
    index.add(1, [1, 2, 3, 4])
    index.evicted(0, [3])  # never sampled: nothing to correct
    assert index.match([1, 2, 3, 4, 5, 6], instances=2).tolist() == [6, 4]
    index.evicted(0, [4, 5, 6])
    assert index.match([1, 2, 3, 4, 5, 6], instances=2).tolist() == [2, 4]
    index.evicted(7, [2])  # an instance the index never saw

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from control.routing import (
    ROUTERS,
    FleetSnapshot,
    Learner,
    PoolModel,
    ReadsKvEvents,
    RouteRequest,
    Withdrawing,
    implements,
    make_router,
    policy_params,
)
from control.routing.baselines import (
    CountsOwnRequests,
    LeastRequests,
    PowerOfTwo,
    PowerOfTwoParams,
)
from control.routing.cache_aware import (
    AibrixParams,
    AibrixPrefixCache,
    DynamoKv,
    SglangCacheAware,
)
from control.routing.llmd import LlmdDefault, queue_score
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


def test_an_instance_s_entry_takes_the_latest_capacity_given() -> None:
    """A gateway routes to an instance before its first scrape says how much KV it has."""
    index = ApproximatePrefixIndex()
    index.add(0, [1, 2, 3, 4])  # not known yet: the default, far larger
    index.add(0, [5], capacity=2)  # scraped since: keeps the two most recent
    assert index.match([4, 5], instances=1).tolist() == [2]
    assert index.match([3], instances=1).tolist() == [0]
    index.add(0, [6])  # capacity not given again: the latest stands
    assert index.match([5, 6], instances=1).tolist() == [2]
    assert index.match([4], instances=1).tolist() == [0]


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


def sent(router: CountsOwnRequests, counts: list[int]) -> None:
    """As if the router had sent ``counts[i]`` requests to instance i, none ended yet."""
    for row, count in enumerate(counts):
        for n in range(count):
            router.inflight.dispatched(f"earlier-{row}-{n}", row)


def test_power_of_two_takes_the_one_with_fewer_of_its_own_requests_of_two_drawn() -> None:
    drawn_alike = 0
    for seed in range(30):
        router = PowerOfTwo(np.random.default_rng(seed))
        sent(router, [9, 1, 9])
        decision = router.route(RouteRequest("r", 10, 1), fleet([0, 0, 0]), 0.0)
        drawn = np.flatnonzero(~np.isnan(decision.scores)).tolist()
        drawn_alike += len(drawn) == 1  # drawn with replacement, as Envoy draws
        assert decision.chosen in drawn
        if 1 in drawn:
            assert decision.chosen == 1
        assert router.inflight.counts(3)[decision.chosen] == (2 if decision.chosen == 1 else 10)
    assert 0 < drawn_alike < 30


def test_own_counts_go_up_at_dispatch_and_down_at_the_end_only() -> None:
    router = LeastRequests(np.random.default_rng(0))
    sent(router, [0, 2])
    first = router.route(RouteRequest("a", 10, 1), fleet([5, 0]), 0.0)  # scraped queues unread
    assert first.chosen == 0
    assert router.route(RouteRequest("b", 10, 1), fleet([0, 0]), 0.0).chosen == 0  # 1 vs 2
    router.first_token("a")
    router.ended("b")
    router.ended("never-sent")
    assert router.inflight.counts(2).tolist() == [1, 2]


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


def test_dynamo_weighs_its_active_prefill_and_blocks_against_the_cached_prefix() -> None:
    router = DynamoKv(np.random.default_rng(0))
    router.index.add(0, [1, 2, 3])  # 48 of the prompt's 64 tokens cached on i0
    router.active.add("a", 0, prefill_tokens=160, blocks=10)
    router.active.add("b", 1, prefill_tokens=32, blocks=2)
    # i0: (160 + 16) / 16 + 10 = 21;  i1: (32 + 64) / 16 + 2 = 8
    decision = router.route(PROMPT, _snapshot([0, 0], inflight=[0, 10_000]), 0.0)
    np.testing.assert_allclose(decision.scores, [21.0, 8.0])
    assert decision.chosen == 1  # the host's token counts are not Dynamo's inputs
    np.testing.assert_allclose(router.active.prefill_tokens(2), [160, 96])
    np.testing.assert_allclose(router.active.blocks(2), [10, 6])
    router.first_token("a")  # i0: 1 + 10 = 11 against i1's 6 + 6 = 12
    assert router.route(RouteRequest("c", 64, 8, (1, 2, 3, 4)), _snapshot([0, 0]), 0.0).chosen == 0
    router.ended("b")
    np.testing.assert_allclose(router.active.blocks(2), [11, 4])


def test_dynamo_breaks_ties_to_the_smallest_indexed_tree() -> None:
    for seed in range(5):
        router = DynamoKv(np.random.default_rng(seed))
        router.index.add(0, [7, 8, 9])  # an unrelated prefix: a bigger tree on i0
        assert router.route(RouteRequest("r", 64, 8, (100,)), _snapshot([0, 0]), 0.0).chosen == 1


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
        ([3, 3], [], 0),  # no match, equal loads: the first worker, whatever the seed
    ],
)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_sglang_gates_on_imbalance_then_on_a_30_percent_match(
    loads: list[int], cached: list[int], expected: int, seed: int
) -> None:
    router = SglangCacheAware(np.random.default_rng(seed))
    router.index.add(0, cached)
    sent(router, loads)
    assert router.route(PROMPT, _snapshot([0, 0]), 0.0).chosen == expected


@pytest.mark.parametrize(
    ("running", "matches", "expected"),
    [
        ([11, 2, 3], {2: 3}, {1}),  # spread 9 > 8: only the least busy is a candidate
        ([11, 2, 3], {1: 1}, {1}),  # ... and its match counts
        ([10, 2, 3], {0: 4}, {1}),  # spread 8: all are, but 10 > mean 5 + 1 std 3.56
        ([0, 0, 0, 2], {3: 4}, {0, 1, 2}),  # 2 > 0.5 + 0.87 (1 std; 2 std would take it)
        ([1, 0, 5], {0: 2, 1: 2}, {1}),  # equal matches: the fewer running requests
        ([1, 0, 5], {0: 3, 1: 2}, {0}),  # the better match first
    ],
)
def test_aibrix_gates_on_a_spread_of_8_and_on_mean_plus_one_std(
    running: list[int], matches: dict[int, int], expected: set[int]
) -> None:
    for seed in range(4):
        router = AibrixPrefixCache(np.random.default_rng(seed))
        for row, blocks in matches.items():
            router.index.add(row, [1, 2, 3, 4][:blocks])
        sent(router, running)
        assert router.route(PROMPT, _snapshot([0] * len(running)), 0.0).chosen in expected


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


def test_each_policy_is_built_with_its_own_parameters_or_its_shipped_defaults() -> None:
    assert make_router("power_of_two", params=PowerOfTwoParams(choice_count=3)).params == (
        PowerOfTwoParams(choice_count=3)
    )
    assert make_router("aibrix_prefix_cache").params == AibrixParams(8, 1.0)
    with pytest.raises(TypeError, match="takes PowerOfTwoParams"):
        make_router("power_of_two", params=AibrixParams())
    assert policy_params("dynamo_kv", {"overlap_weight": 2}).overlap_weight == 2.0


def test_power_of_two_gives_a_tie_to_the_first_drawn() -> None:
    for seed in range(20):
        router = PowerOfTwo(np.random.default_rng(seed))
        drawn = np.random.default_rng(seed).choice(np.arange(4), size=2, replace=True)
        decision = router.route(RouteRequest("r", 10, 1), fleet([0, 0, 0, 0]), 0.0)
        assert decision.chosen == drawn[0]


def test_a_request_routed_again_counts_once() -> None:
    router = LeastRequests(np.random.default_rng(0))
    router.inflight.dispatched("r", 0)
    router.inflight.dispatched("r", 1)
    assert router.inflight.counts(2).tolist() == [0, 1]

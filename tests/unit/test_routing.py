from __future__ import annotations

import numpy as np
import pytest

from control.routing import ROUTERS, FleetSnapshot, RouteRequest, make_router
from control.routing.baselines import PowerOfTwo
from control.routing.llmd import LlmdDefault, queue_score
from control.routing.prefix_index import ApproximatePrefixIndex


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
    decision = make_router(name).route(
        RouteRequest("r", 10, 1), fleet([0, 0], ready=[False, False]), 0.0
    )
    assert decision.chosen is None
    assert decision.candidates(fleet([0, 0])) == ()

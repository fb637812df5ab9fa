"""FleetMind's long cycle: the replicas each DC should run, from its load over minutes."""

from __future__ import annotations

from control.controllers.placement import DcReplicas, PlacementController, PlacementParams

P = PlacementParams()


def dc(sent_rps: float, ready: int = 4, deployed: int = 4, ceiling: int = 6) -> DcReplicas:
    return DcReplicas(ready, deployed, floor=4, ceiling=ceiling, sent_rps=sent_rps)


def test_a_hot_dc_gets_the_replicas_that_bring_it_to_its_target_up_to_its_gpus() -> None:
    controller = PlacementController()
    # 4 replicas at 5 requests a second each: 18 a second is 0.9 of them; 0.7 needs 6
    assert controller.targets({"c": dc(18.0)}, 5.0, {}, 100.0) == {"c": (6, "load 0.90")}
    assert controller.targets({"c": dc(40.0)}, 5.0, {}, 100.0)["c"][0] == 6  # its GPUs
    assert controller.targets({"c": dc(18.0, ceiling=4)}, 5.0, {}, 100.0) == {}


def test_a_cold_dc_gives_back_one_replica_at_a_time_down_to_its_base() -> None:
    controller = PlacementController()
    assert controller.targets({"c": dc(2.0, 6, 6)}, 5.0, {}, 100.0) == {"c": (5, "load 0.07")}
    assert controller.targets({"c": dc(2.0)}, 5.0, {}, 100.0) == {}  # at its base already
    assert controller.targets({"c": dc(14.0, 6, 6)}, 5.0, {}, 100.0) == {}  # in the band


def test_nothing_moves_while_replicas_warm_up_or_before_the_last_move_settles() -> None:
    controller = PlacementController()
    assert controller.targets({"c": dc(18.0, ready=4, deployed=6)}, 5.0, {}, 100.0) == {}
    settling = {"c": 100.0 - P.settle_s / 2}
    assert controller.targets({"c": dc(18.0)}, 5.0, settling, 100.0) == {}
    recommendation = controller.recommendation({"c": (6, "load 0.90")}, "m", "v1", "edge", 3, 9)
    [action] = recommendation.actions
    assert (action.dc, action.target_replicas, action.model_version) == ("c", 6, "v1")

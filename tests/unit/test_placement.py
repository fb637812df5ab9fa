"""FleetMind's long cycle: the replicas each DC should run, from its load over minutes."""

from __future__ import annotations

from control.controllers.placement import (
    DcReplicas,
    PlacementController,
    PlacementParams,
    concluded_rps,
    instances_to_run,
)
from schemas.base import TaskClass
from schemas.control import PlacementAction, PlacementRecommendation
from schemas.fleet import InstanceConfig
from schemas.tables import GoodputTable
from tests.unit.test_quota_controller import row

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


def instance(name: str, dc: str = "c", model: str = "m", standby: bool = False) -> InstanceConfig:
    return InstanceConfig(
        id=name, dc=dc, url=f"http://127.0.0.1:1/{name}", model=model, standby=standby
    )


def placed(target: int, dc: str = "c", model: str = "m") -> PlacementRecommendation:
    action = PlacementAction(model=model, model_version="1", dc=dc, target_replicas=target)
    return PlacementController().snapshot(dc, [action], 1, 0.0)


def test_a_placement_runs_the_base_and_the_first_standby_gpus_it_asks_for() -> None:
    dc = [
        instance("c-0"),
        instance("c-1", standby=True),
        instance("c-2", standby=True),
        instance("o-0", model="other", standby=True),
    ]
    assert instances_to_run(dc, None) == {"c-0"}  # standby GPUs idle until placed
    assert instances_to_run(dc, placed(2)) == {"c-0", "c-1"}
    assert instances_to_run(dc, placed(9)) == {"c-0", "c-1", "c-2"}  # no more than it has
    assert instances_to_run(dc, placed(0)) == {"c-0"}  # never below its base
    assert instances_to_run(dc, placed(2, dc="d")) == {"c-0"}  # another DC's placement
    assert instances_to_run(dc, placed(1, model="other")) == {"c-0", "o-0"}


def test_demand_is_what_a_window_ended_per_second_failures_included() -> None:
    classes = (row(TaskClass.INTERACTIVE, 90, 80, failures=6), row(TaskClass.BATCH, 4, 4))
    table = GoodputTable(
        dc="c", version=1, window_start=0.0, window_end=20.0, classes=classes, tenants=()
    )
    assert concluded_rps(table) == 5.0  # (90 + 6 + 4) requests over 20 s

"""FleetMind's weights controller: the share of each DC's capacity the edge should count
on, from the DCs' goodput tables."""

from __future__ import annotations

from control.controllers.fleetmind import WeightController, WeightParams
from schemas.base import TaskClass
from schemas.control import RoutingWeights
from schemas.tables import GoodputTable
from tests.unit.test_quota_controller import row

P = WeightParams()


def table(dc: str, completed: int, met: int) -> GoodputTable:
    return GoodputTable(
        dc=dc,
        version=1,
        window_start=0.0,
        window_end=60.0,
        classes=(row(TaskClass.INTERACTIVE, completed, met),),
        tenants=(),
    )


def weights(published: RoutingWeights | None) -> dict[str, float]:
    assert published is not None
    return {w.dc: w.weight for w in published.weights}


def test_the_first_pass_counts_on_every_dc_whole() -> None:
    first = WeightController().reconcile(
        "m", "edge", {"b": table("b", 100, 95), "c": table("c", 100, 99)}, None, {}, 60.0
    )
    assert first is not None
    assert weights(first) == {"b": 1.0, "c": 1.0}
    assert first.version == 1
    assert first.scope == "edge"


def test_a_dc_that_misses_loses_weight_one_step_and_only_it() -> None:
    current = WeightController().reconcile("m", "edge", {"b": table("b", 100, 99)}, None, {}, 0)
    tables = {"b": table("b", 100, 70), "c": table("c", 100, 99)}
    lowered = WeightController().reconcile("m", "edge", tables, current, {}, 60.0)
    assert weights(lowered) == {"b": P.lower_by, "c": 1.0}
    assert lowered is not None
    assert current is not None
    assert lowered.version == current.version + 1


def test_inside_the_band_on_few_outcomes_or_before_settling_nothing_is_published() -> None:
    controller = WeightController()
    current = controller.reconcile("m", "edge", {"b": table("b", 100, 99)}, None, {}, 0.0)
    lowered = controller.reconcile("m", "edge", {"b": table("b", 100, 80)}, current, {}, 5.0)
    assert weights(lowered) == {"b": P.lower_by}
    in_band = table("b", 100, round(100 * (P.target - P.band / 2)))
    assert controller.reconcile("m", "edge", {"b": in_band}, lowered, {}, 60.0) is None
    few = table("b", P.min_outcomes - 1, 0)
    assert controller.reconcile("m", "edge", {"b": few}, lowered, {}, 60.0) is None
    missing = {"b": table("b", 100, 50)}
    assert controller.reconcile("m", "edge", missing, lowered, {"b": 55.0}, 60.0) is None


def test_a_dc_back_on_target_climbs_to_whole_and_a_missing_one_stops_at_the_floor() -> None:
    controller = WeightController()
    current = controller.reconcile("m", "edge", {"b": table("b", 100, 99)}, None, {}, 0.0)
    for outcome in (table("b", 100, 10), table("b", 100, 99)):
        seen = []
        for step in range(20):
            changed = controller.reconcile("m", "edge", {"b": outcome}, current, {}, step)
            current = changed or current
            seen.append(weights(current)["b"])
        assert seen[0] != seen[1]  # one step a pass
        assert seen[-1] == (P.floor if outcome.classes[0].compliance < P.target else 1.0)

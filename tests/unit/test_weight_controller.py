"""FleetMind's weights controller: the share of each DC's capacity the edge should count
on, from the DCs' goodput tables."""

from __future__ import annotations

from control.controllers.fleetmind import WeightController, WeightParams, weights_of
from schemas.base import TaskClass
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


def test_dcs_that_meet_their_objectives_are_counted_on_whole_and_nothing_is_published() -> None:
    tables = {"b": table("b", 100, 95), "c": table("c", 100, 99)}
    assert WeightController().reconcile(tables, {}, {}, 60.0) is None


def test_a_dc_that_misses_loses_weight_one_step_and_only_it() -> None:
    tables = {"b": table("b", 100, 70), "c": table("c", 100, 99)}
    assert WeightController().reconcile(tables, {}, {}, 60.0) == {"b": P.lower_by, "c": 1.0}


def test_inside_the_band_on_few_outcomes_or_before_settling_nothing_changes() -> None:
    controller = WeightController()
    held = {"b": 0.5}
    in_band = table("b", 100, round(100 * (P.target - P.band / 2)))
    assert controller.reconcile({"b": in_band}, held, {}, 60.0) is None
    assert controller.reconcile({"b": table("b", P.min_outcomes - 1, 0)}, held, {}, 60.0) is None
    missing = {"b": table("b", 100, 50)}
    assert controller.reconcile(missing, held, {"b": 60.0 - P.settle_s / 2}, 60.0) is None
    assert controller.reconcile(missing, held, {"b": 60.0 - P.settle_s}, 60.0) == {
        "b": 0.5 * P.lower_by
    }


def test_a_missing_dc_stops_at_the_floor_and_climbs_back_to_whole_one_step_a_pass() -> None:
    controller = WeightController()
    weights: dict[str, float] = {}
    for outcome, end in ((table("b", 100, 10), P.floor), (table("b", 100, 99), 1.0)):
        seen = []
        for step in range(20):
            weights = controller.reconcile({"b": outcome}, weights, {}, step) or weights
            seen.append(weights["b"])
        assert seen[0] != seen[1]
        assert seen[-1] == end


def test_the_published_snapshot_holds_each_dc_s_weight_for_every_model() -> None:
    snapshot = WeightController().snapshot({"b": 0.5, "c": 1.0}, ["m1", "m2"], "dc-a", 3, 9.0)
    assert (snapshot.scope, snapshot.version, snapshot.issued_at) == ("dc-a", 3, 9.0)
    assert weights_of(snapshot, "m2") == {"b": 0.5, "c": 1.0}
    assert len(snapshot.weights) == 4

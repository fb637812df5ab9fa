"""FleetMind's weights controller: the share of each DC's capacity the edge should count
on, from the DCs' goodput tables."""

from __future__ import annotations

from control.controllers.fleetmind import (
    WeightController,
    WeightKey,
    WeightParams,
    keyed_weights,
    weight_for,
    weights_of,
)
from schemas.base import TaskClass
from schemas.tables import GoodputRow, GoodputTable, region_row_key
from tests.unit.test_quota_controller import row

P = WeightParams()
CHATS, DOCUMENTS = TaskClass.INTERACTIVE, TaskClass.LONG_DOCUMENT
B, C = ("b", None), ("c", None)


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
    assert WeightController().reconcile(tables, {}, {}, 60.0) == {B: P.lower_by, C: 1.0}


def test_inside_the_band_on_few_outcomes_or_before_settling_nothing_changes() -> None:
    controller = WeightController()
    held: dict[WeightKey, float] = {B: 0.5}
    in_band = table("b", 100, round(100 * (P.target - P.band / 2)))
    assert controller.reconcile({"b": in_band}, held, {}, 60.0) is None
    few = {"b": table("b", P.min_outcomes - 1, 0)}
    assert controller.reconcile(few, held, {B: 60.0 - P.regain_after_s / 2}, 60.0) is None
    missing = {"b": table("b", 100, 50)}
    assert controller.reconcile(missing, held, {B: 60.0 - P.settle_s / 2}, 60.0) is None
    assert controller.reconcile(missing, held, {B: 60.0 - P.settle_s}, 60.0) == {
        B: 0.5 * P.lower_by
    }


def test_a_missing_dc_stops_at_the_floor_and_climbs_back_to_whole_one_step_a_pass() -> None:
    controller = WeightController()
    weights: dict[WeightKey, float] = {}
    for outcome, end in ((table("b", 100, 10), P.floor), (table("b", 100, 99), 1.0)):
        seen = []
        for step in range(20):
            weights = controller.reconcile({"b": outcome}, weights, {}, step) or weights
            seen.append(weights[B])
        assert seen[0] != seen[1]
        assert seen[-1] == end


def test_a_weight_too_few_requests_judge_climbs_back_once_a_window_has_passed() -> None:
    """A low weight keeps traffic away, so a DC may never again see enough requests end to
    be judged: with too few to judge, a window after its last change, it regains a step
    at a time; a DC counted on whole stays so."""
    controller = WeightController()
    few = {"b": table("b", P.min_outcomes - 1, 0), "c": table("c", 0, 0)}
    weights: dict[WeightKey, float] = {B: P.floor, C: 1.0}
    changed: dict[WeightKey, float] = {B: 0.0}
    assert controller.reconcile(few, weights, changed, P.regain_after_s - 1) is None
    seen = []
    now = 0.0
    while weights[B] < 1.0 and len(seen) < 20:
        now += P.regain_after_s
        raised = controller.reconcile(few, weights, changed, now)
        assert raised is not None
        assert raised[C] == 1.0
        assert controller.reconcile(few, raised, {B: now}, now + 1) is None  # not again at once
        weights, changed = raised, {B: now}
        seen.append(weights[B])
    assert seen == [round(P.floor + P.raise_by * n, 4) for n in range(1, 8)] + [1.0]


def test_a_weight_whose_dc_no_fresh_table_judges_climbs_back_as_one_too_few_judge() -> None:
    """A DC whose tables went stale at a low weight drops out of the tables the host
    passes on; its weight regains a step a window after its last change, rather than be
    renewed where it stood for as long as another DC's tables are fresh."""
    controller = WeightController()
    weights: dict[WeightKey, float] = {B: P.floor, C: 1.0}
    only_c = {"c": table("c", 100, 99)}
    assert controller.reconcile(only_c, weights, {B: 0.0}, P.regain_after_s - 1) is None
    raised = controller.reconcile(only_c, weights, {B: 0.0}, P.regain_after_s)
    assert raised == {B: round(P.floor + P.raise_by, 4), C: 1.0}


def test_the_published_snapshot_holds_each_weight_for_every_model() -> None:
    weights: dict[WeightKey, float] = {("b", CHATS): 0.5, ("b", DOCUMENTS): 1.0, C: 0.8}
    snapshot = WeightController().snapshot(weights, ["m1", "m2"], "dc-a", 3, 9.0)
    assert (snapshot.scope, snapshot.version, snapshot.issued_at) == ("dc-a", 3, 9.0)
    assert weights_of(snapshot, "m2", CHATS) == {"b": 0.5, "c": 0.8}  # c: every class's
    assert weights_of(snapshot, "m2", DOCUMENTS) == {"b": 1.0, "c": 0.8}
    assert weights_of(snapshot, "m2", TaskClass.BATCH) == {"c": 0.8}  # b's batch: whole
    assert keyed_weights(snapshot) == weights
    assert len(snapshot.weights) == 6


def test_each_class_is_judged_on_its_own_outcomes_when_asked_to() -> None:
    mixed = table("b", 100, 60)  # chats late...
    mixed = mixed.model_copy(update={"classes": (*mixed.classes, row(DOCUMENTS, 40, 40))})
    per_class = WeightController(WeightParams(per_class=True)).reconcile({"b": mixed}, {}, {}, 60)
    assert per_class == {("b", CHATS): P.lower_by, ("b", DOCUMENTS): 1.0}  # ...documents not
    assert weight_for(per_class, "b", DOCUMENTS) == 1.0
    assert weight_for(per_class, "b", TaskClass.BATCH) is None
    pooled = WeightController().reconcile({"b": mixed}, {}, {}, 60.0)
    assert pooled == {B: P.lower_by}  # 100 of 140 in time: under the band
    assert weight_for(pooled, "b", TaskClass.BATCH) == P.lower_by


def test_an_edge_judges_each_dc_on_its_own_region_s_requests_while_enough_ended() -> None:
    """In b, the chats from eu-west miss while those from us-east meet: 90 % in all."""
    far = region_row("eu-west", CHATS, 50, 30)
    near = region_row("us-east", CHATS, 150, 150)
    few = region_row("ap-south", CHATS, P.min_outcomes - 1, 0)
    b = table("b", 200, 180).model_copy(update={"regions": (far, near, few)})
    controller = WeightController(WeightParams(per_region=True))
    assert controller.reconcile({"b": b}, {}, {}, 60.0, "eu-west") == {B: P.lower_by}
    assert controller.reconcile({"b": b}, {}, {}, 60.0, "us-east") is None
    assert controller.reconcile({"b": b}, {}, {}, 60.0, "ap-south") is None  # b as a whole
    assert controller.reconcile({"b": b}, {}, {}, 60.0) is None
    assert WeightController().reconcile({"b": b}, {}, {}, 60.0, "eu-west") is None  # off


def test_per_class_an_edge_judges_each_class_on_its_region_s_requests_of_it() -> None:
    chats = region_row("eu-west", CHATS, 50, 30)
    documents = region_row("eu-west", DOCUMENTS, 40, 40)
    b = table("b", 100, 95)
    b = b.model_copy(
        update={"classes": (*b.classes, row(DOCUMENTS, 5, 0)), "regions": (chats, documents)}
    )
    per_class = WeightController(WeightParams(per_class=True, per_region=True))
    assert per_class.reconcile({"b": b}, {}, {}, 60.0, "eu-west") == {
        ("b", CHATS): P.lower_by,
        ("b", DOCUMENTS): 1.0,
    }
    assert per_class.reconcile({"b": b}, {}, {}, 60.0) is None  # 95 % of chats; 5 documents


def region_row(region: str, task_class: TaskClass, completed: int, met: int) -> GoodputRow:
    return row(task_class, completed, met).model_copy(
        update={"key": region_row_key(region, task_class)}
    )

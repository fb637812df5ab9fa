"""SLOMax's controller: the quotas a goodput table calls for."""

from __future__ import annotations

import itertools
import math

import pytest

from control.controllers.slomax import (
    QuotaController,
    QuotaControllerParams,
    attainment,
    ceiling,
    long_documents,
)
from schemas.base import TaskClass
from schemas.control import AdmissionQuotas, ClassQuota
from schemas.tables import CapacityRow, CapacityTable, GoodputRow, GoodputTable

DEFAULTS = QuotaControllerParams()
DEFAULTS_TARGET_MET = round(DEFAULTS.interactive_target * 100)
"""Chats in time, of 100, at the target: inside the band."""
FAR, NEAR, RAISE = DEFAULTS.far_lower_step, DEFAULTS.lower_step, DEFAULTS.raise_step


def row(task_class: TaskClass, completed: int, met: int, failures: int = 0) -> GoodputRow:
    return GoodputRow(
        key=task_class.value,
        completed=completed,
        output_tokens=completed * 100,
        goodput_tokens=met * 100,
        compliance=met / completed if completed else 0.0,
        ttft_p50_s=0.1,
        ttft_p95_s=0.2,
        ttft_p99_s=0.3,
        tpot_p50_s=0.02,
        tpot_p95_s=0.03,
        tpot_p99_s=0.04,
        failures=failures,
        cancellations=0,
        timeouts=0,
        retries=0,
        repeated_executions=0,
        wasted_tokens=0,
        late_events=0,
    )


def table(
    chats: tuple[int, int], documents: tuple[int, int] = (10, 10), now: float = 60.0
) -> GoodputTable:
    rows = {
        TaskClass.INTERACTIVE: row(TaskClass.INTERACTIVE, *chats),
        TaskClass.LONG_DOCUMENT: row(TaskClass.LONG_DOCUMENT, *documents),
        TaskClass.BATCH: row(TaskClass.BATCH, 0, 0),
    }
    return GoodputTable(
        dc="dc",
        version=1,
        window_start=now - 60,
        window_end=now,
        classes=tuple(rows.values()),
        tenants=(),
    )


def test_attainment_counts_failures_as_misses() -> None:
    assert attainment(row(TaskClass.INTERACTIVE, 90, 81, failures=10)) == (pytest.approx(0.81), 100)
    assert attainment(row(TaskClass.BATCH, 0, 0)) == (1.0, 0)


def capacity(ready: int, now: float = 60.0, running: int = 0) -> CapacityTable:
    row = CapacityRow(
        model="m",
        model_version="v1",
        ready_endpoints=ready,
        kv_blocks_total=100 * ready,
        kv_blocks_free=50 * ready,
        queued=0,
        running=running,
        inflight_tokens=0,
        prefill_tokens_per_s=0.0,
        decode_tokens_per_s=0.0,
        headroom=0.5,
        telemetry_age_s=0.0,
    )
    return CapacityTable(dc="dc", version=1, window_start=now - 60, window_end=now, rows=(row,))


SIXTEEN = capacity(16)
START = QuotaControllerParams().initial_per_instance


def test_the_first_pass_publishes_where_slomax_starts_sized_by_the_ready_instances() -> None:
    quotas = QuotaController().reconcile(table((100, 96)), SIXTEEN, None, now=60.0)
    assert quotas is not None
    assert (quotas.version, quotas.scope, quotas.issued_at) == (1, "dc", 60.0)
    assert long_documents(quotas) == START * 16
    assert QuotaController().reconcile(table((100, 96)), capacity(0), None, now=60.0) is None


def test_a_table_without_some_class_rows_is_judged_by_the_rows_it_has() -> None:
    """The schema lets a table leave classes out (the worker writes every class): a
    controller must not fail on one, as it once did on the live path. Without long
    documents in the window, late chats are not theirs to answer for: batch work is."""
    missing = table((100, 50))
    only_chats = missing.model_copy(update={"classes": missing.classes[:1]})
    controller = QuotaController()
    first = controller.reconcile(table((100, 96)), SIXTEEN, None, now=60.0)
    assert first is not None
    lowered = controller.reconcile(only_chats, capacity(16, running=100), first, now=120.0)
    assert lowered is not None
    assert long_documents(lowered) == long_documents(first)
    assert batch(lowered) == 100 // FAR  # from what ran
    no_chats = missing.model_copy(update={"classes": missing.classes[1:]})
    assert controller.reconcile(no_chats, SIXTEEN, first, now=120.0) is None


def batch(quotas: AdmissionQuotas | None) -> int | None:
    assert quotas is not None
    return ceiling(quotas, TaskClass.BATCH)


def published(documents: int, batch: int | None = None) -> AdmissionQuotas:
    """Quotas published at 0 s with these ceilings."""
    ceilings = [ClassQuota(task_class=TaskClass.LONG_DOCUMENT, max_concurrency=documents)]
    if batch is not None:
        ceilings.append(ClassQuota(task_class=TaskClass.BATCH, max_concurrency=batch))
    return AdmissionQuotas(scope="dc", version=1, issued_at=0.0, ttl_s=60.0, quotas=tuple(ceilings))


def test_batch_work_is_held_back_only_where_no_long_documents_are_to_blame() -> None:
    controller, late = QuotaController(), table((100, 50))
    without_documents = late.model_copy(update={"classes": (late.classes[0], late.classes[2])})
    quotas, limits = controller.reconcile(table((100, 96)), SIXTEEN, None, now=0.0), []
    for n, window in enumerate([late] * 4 + [without_documents] * 3, start=1):
        running = capacity(16, running=300)
        quotas = controller.reconcile(window, running, quotas, now=15.0 * n) or quotas
        limits.append((long_documents(quotas), batch(quotas)))
    floor = round(QuotaControllerParams().min_per_instance * 16)
    assert limits == [
        (32, None),
        (16, None),
        (floor, None),
        (floor, None),  # at their floor, documents still in the window: batch is spared
        (floor, 300 // 2),  # the first batch ceiling: from what the fleet runs
        (floor, 75),
        (floor, 37),
    ]
    assert controller.reconcile(without_documents, SIXTEEN, quotas, now=110.0) is None  # soon
    assert batch(controller.reconcile(without_documents, SIXTEEN, quotas, now=120.0)) == 18
    lowered = controller.reconcile(without_documents, SIXTEEN, published(floor), now=60.0)
    assert batch(lowered) == 32 * 16 // 2  # nothing runs: from the most it could be


def test_with_room_to_spare_the_batch_ceiling_rises_then_lifts_before_documents_rise() -> None:
    controller, room = QuotaController(), table((100, 100), (10, 10, 3))
    quotas, limits = published(64, batch=100), []
    assert controller.reconcile(room, SIXTEEN, quotas, now=30.0) is None  # rising waits longer
    for n in range(1, 5):
        quotas = controller.reconcile(room, SIXTEEN, quotas, now=60.0 * n) or quotas
        limits.append((long_documents(quotas), batch(quotas)))
    # doubled each pass, lifted past 32 per instance, and only then more documents
    assert limits == [(64, 200), (64, 400), (64, None), (math.ceil(64 * RAISE), None)]


def test_with_no_chats_to_judge_by_a_batch_ceiling_rises_and_lifts() -> None:
    """A ceiling on batch protects chats: with too few of them in the window (a night of
    batch alone), it has nothing to protect and must not stay."""
    controller, few_chats = QuotaController(), table((10, 2))
    raised = controller.reconcile(few_chats, SIXTEEN, published(8, batch=300), now=60.0)
    assert batch(raised) is None  # 600, past 32 per instance
    assert long_documents(raised) == 8  # documents rise only on chats with room to spare


def test_ceilings_follow_the_ready_instances() -> None:
    controller, late = QuotaController(), table((100, 50))
    # 64 documents and a batch ceiling of 400 published for 16 instances; now 2 are ready
    shrunk = controller.reconcile(table((100, 96)), capacity(2), published(64, 400), now=60.0)
    assert (long_documents(shrunk), batch(shrunk)) == (16, 64)  # 8 and 32 per instance
    # a limit of one (the floor on 2 instances), then 16 ready: their floor, chats late
    grown = controller.reconcile(late, SIXTEEN, published(1), now=60.0)
    assert long_documents(grown) == 8


def test_long_documents_that_were_all_refused_do_not_spare_batch() -> None:
    """Refused documents slowed no chat: late chats are then batch's to answer for."""
    controller = QuotaController()
    refused = table((100, 50), (0, 0, 12))
    lowered = controller.reconcile(refused, capacity(16, running=300), published(64), now=60.0)
    assert (long_documents(lowered), batch(lowered)) == (64, 150)


def test_chats_missing_their_objective_lower_the_long_document_limit_one_step() -> None:
    controller = QuotaController()
    first = controller.reconcile(table((100, 96)), SIXTEEN, None, now=60.0)
    assert controller.reconcile(table((100, 80)), SIXTEEN, first, now=70.0) is None  # too soon
    lowered = controller.reconcile(table((100, 80)), SIXTEEN, first, now=75.0)
    assert lowered is not None
    assert lowered.version == 2
    assert long_documents(lowered) == math.floor(START * 16 / FAR)


def test_the_fall_is_steeper_the_further_chats_are_from_their_target() -> None:
    """Just under the target a ceiling eases down; far under it, it halves."""
    controller = QuotaController()
    assert DEFAULTS.far_below == 0.90 < DEFAULTS.interactive_target

    def documents_after(met: int) -> int | None:
        """The long-document limit after a window of 100 chats, ``met`` in time (None: the
        controller leaves the 64 it published)."""
        quotas = controller.reconcile(table((100, met)), SIXTEEN, published(64), now=60.0)
        return None if quotas is None else long_documents(quotas)

    assert documents_after(DEFAULTS_TARGET_MET) is None  # at the target: in the band
    assert documents_after(92) == documents_after(90) == math.floor(64 / NEAR)  # 51
    assert documents_after(89) == 64 // FAR  # 32
    batch_only = table((100, 92), (0, 0))
    eased = controller.reconcile(batch_only, SIXTEEN, published(8, batch=100), now=60.0)
    assert batch(eased) == math.floor(100 / NEAR)


def test_a_target_under_the_far_line_is_still_a_target() -> None:
    """An operator who aims chats at 85 % does not halve ceilings while 88 % meet it."""
    controller = QuotaController(QuotaControllerParams(interactive_target=0.85))
    assert controller.chats(row(TaskClass.INTERACTIVE, 100, 88)) == "room"
    assert controller.chats(row(TaskClass.INTERACTIVE, 100, 84)) == "far_below"


def test_chats_with_room_to_spare_let_more_long_documents_in_when_the_limit_turned_some_away() -> (
    None
):
    controller = QuotaController()
    first = controller.reconcile(table((100, 96)), SIXTEEN, None, now=60.0)
    turned_away = table((100, 100), (10, 10, 3))
    assert controller.reconcile(turned_away, SIXTEEN, first, now=100.0) is None  # too soon
    raised = controller.reconcile(turned_away, SIXTEEN, first, now=120.0)
    assert long_documents(raised) == math.ceil(START * 16 * RAISE)
    # documents late but none turned away: the limit is not what holds them back
    assert controller.reconcile(table((100, 100), (10, 5)), SIXTEEN, first, now=120.0) is None


def test_inside_the_band_or_on_too_little_evidence_nothing_is_published() -> None:
    controller = QuotaController()
    first = controller.reconcile(table((100, 96)), SIXTEEN, None, now=60.0)
    assert controller.reconcile(table((100, 96), (10, 1, 5)), SIXTEEN, first, now=65.0) is None
    assert controller.reconcile(table((20, 10)), SIXTEEN, first, now=65.0) is None  # too few


def test_on_a_small_fleet_each_step_still_moves_the_limit_by_a_request_at_least() -> None:
    """Halving, no step rounds back; at 1.25 x one would, unrounded."""
    controller, two = QuotaController(QuotaControllerParams(far_lower_step=1.25)), capacity(2)
    quotas = controller.reconcile(table((100, 96)), two, None, now=0.0)
    limits = [long_documents(quotas)]
    for n in range(1, 12):
        quotas = controller.reconcile(table((100, 50)), two, quotas, now=15.0 * n) or quotas
        limits.append(long_documents(quotas))
    assert limits[0] == START * 2
    assert limits[-1] == 1  # 0.5 per instance, at least one
    assert all(b < a or a == b == 1 for a, b in itertools.pairwise(limits))
    assert limits[:6] == [8, 6, 4, 3, 2, 1]  # 1.25 x down, rounded down, never stuck


def test_the_limit_stays_within_its_bounds() -> None:
    params = QuotaControllerParams()
    controller = QuotaController(params)
    quotas = controller.reconcile(table((100, 96)), SIXTEEN, None, now=0.0)
    for n in range(1, 30):
        quotas = controller.reconcile(table((100, 50)), SIXTEEN, quotas, now=60.0 * n) or quotas
    assert long_documents(quotas) == params.min_per_instance * 16
    for n in range(30, 90):
        worse = table((100, 100), (10, 1, 5))
        quotas = controller.reconcile(worse, SIXTEEN, quotas, now=60.0 * n) or quotas
    assert long_documents(quotas) == params.max_per_instance * 16


def test_published_ceilings_are_per_instance_and_follow_the_fleet_as_it_grows() -> None:
    """Set for 2 ready instances, the controller's limits mean the same per instance on
    16 (it reads them back scaled, and moves on from there), and on a pool with half a
    DC's instances (a DC running two models) half of them."""
    controller = QuotaController()
    first = controller.reconcile(table((100, 96)), capacity(2), None, now=60.0)
    assert first is not None
    assert long_documents(first) == START * 2
    assert controller.reconcile(table((100, 96)), SIXTEEN, first, now=200.0) is None
    quota = next(q for q in first.quotas if q.task_class is TaskClass.LONG_DOCUMENT)
    assert (quota.concurrency(16), quota.concurrency(1)) == (START * 16, START)
    lowered = controller.reconcile(table((100, 50)), SIXTEEN, first, now=200.0)
    assert lowered is not None
    assert long_documents(lowered) == math.floor(START * 16 / FAR)  # from 64, not from 8
    two_models = capacity(16).rows[0].model_copy(update={"ready_endpoints": 8})
    both = capacity(16).model_copy(
        update={"rows": (two_models, two_models.model_copy(update={"model": "other"}))}
    )
    shared = controller.reconcile(table((100, 96)), both, None, now=60.0)
    assert shared is not None
    per_pool = next(q for q in shared.quotas if q.task_class is TaskClass.LONG_DOCUMENT)
    assert per_pool.concurrency(8) == START * 8  # each model's pool: half the DC's
    half = per_pool.model_copy(update={"max_concurrency": 8})  # 0.5 per instance on 16
    assert [half.concurrency(n) for n in (0, 1, 3, 5, 7)] == [0, 1, 2, 3, 4]  # rounded up

"""SLOMax's controller: the quotas a goodput table calls for."""

from __future__ import annotations

import itertools
import math

import pytest

from control.controllers.slomax import (
    QuotaController,
    QuotaControllerParams,
    attainment,
    long_documents,
)
from schemas.base import TaskClass
from schemas.tables import CapacityRow, CapacityTable, GoodputRow, GoodputTable

LOWER, RAISE = QuotaControllerParams().lower_step, QuotaControllerParams().raise_step


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


def capacity(ready: int, now: float = 60.0) -> CapacityTable:
    row = CapacityRow(
        model="m",
        model_version="v1",
        ready_endpoints=ready,
        kv_blocks_total=100 * ready,
        kv_blocks_free=50 * ready,
        queued=0,
        running=0,
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
    controller must not fail on one, as it once did on the live path."""
    missing = table((100, 50))
    only_chats = missing.model_copy(update={"classes": missing.classes[:1]})
    controller = QuotaController()
    first = controller.reconcile(only_chats, SIXTEEN, None, now=60.0)
    assert first is not None
    lowered = controller.reconcile(only_chats, SIXTEEN, first, now=120.0)
    assert lowered is not None
    assert long_documents(lowered) < long_documents(first)  # chats late: fewer documents
    no_chats = missing.model_copy(update={"classes": missing.classes[1:]})
    assert controller.reconcile(no_chats, SIXTEEN, first, now=120.0) is None


def test_chats_missing_their_objective_lower_the_long_document_limit_one_step() -> None:
    controller = QuotaController()
    first = controller.reconcile(table((100, 96)), SIXTEEN, None, now=60.0)
    assert controller.reconcile(table((100, 90)), SIXTEEN, first, now=70.0) is None  # too soon
    lowered = controller.reconcile(table((100, 90)), SIXTEEN, first, now=75.0)
    assert lowered is not None
    assert lowered.version == 2
    assert long_documents(lowered) == math.floor(START * 16 / LOWER)


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
    """At the default step (halving) no step rounds back; at 1.25 x one would, unrounded."""
    controller, two = QuotaController(QuotaControllerParams(lower_step=1.25)), capacity(2)
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

"""SLOMax's controller: the quotas a goodput table calls for."""

from __future__ import annotations

import pytest

from control.controllers.slomax import (
    QuotaController,
    QuotaControllerParams,
    attainment,
    long_share,
)
from schemas.base import TaskClass
from schemas.tables import GoodputRow, GoodputTable

STEP = QuotaControllerParams().step


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


def test_the_first_pass_publishes_where_slomax_starts() -> None:
    quotas = QuotaController().reconcile(table((100, 96)), None, now=60.0)
    assert quotas is not None
    assert (quotas.version, quotas.scope, quotas.issued_at) == (1, "dc", 60.0)
    assert long_share(quotas) == QuotaControllerParams().initial_long_share


def test_chats_missing_their_objective_shrink_the_long_partition_one_step() -> None:
    controller = QuotaController()
    first = controller.reconcile(table((100, 96)), None, now=60.0)
    shrunk = controller.reconcile(table((100, 90)), first, now=65.0)
    assert shrunk is not None
    assert shrunk.version == 2
    assert long_share(shrunk) == pytest.approx(long_share(first) - STEP)


def test_chats_with_room_to_spare_give_long_documents_a_step_when_they_do_worse() -> None:
    controller = QuotaController()
    first = controller.reconcile(table((100, 96)), None, now=60.0)
    grown = controller.reconcile(table((100, 100), documents=(10, 5)), first, now=65.0)
    assert long_share(grown) == pytest.approx(long_share(first) + STEP)
    # documents doing as well as chats: nothing to give them
    assert controller.reconcile(table((100, 100), documents=(10, 10)), first, now=65.0) is None


def test_inside_the_band_or_on_too_little_evidence_nothing_is_published() -> None:
    controller = QuotaController()
    first = controller.reconcile(table((100, 96)), None, now=60.0)
    assert controller.reconcile(table((100, 96), documents=(10, 1)), first, now=65.0) is None
    assert controller.reconcile(table((20, 10)), first, now=65.0) is None  # 20 < min_outcomes


def test_the_partition_stays_within_its_bounds() -> None:
    params = QuotaControllerParams()
    controller = QuotaController(params)
    quotas = controller.reconcile(table((100, 96)), None, now=0.0)
    for n in range(20):
        quotas = controller.reconcile(table((100, 50)), quotas, now=float(n)) or quotas
    assert long_share(quotas) == params.min_long_share
    for n in range(20):
        quotas = controller.reconcile(table((100, 100), (10, 1)), quotas, now=float(n)) or quotas
    assert long_share(quotas) == params.max_long_share

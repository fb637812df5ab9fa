"""The SLOMax controller run on a simulated fleet, through the same table logic the live
stream processors run (``streams.tables``): every ``period_s`` of simulated time, the
records that ended become outcomes, the outcomes update the DC's goodput table, and the
controller's quotas, when they change, reach the pipeline."""

from __future__ import annotations

from dataclasses import dataclass, field

from control.controllers.slomax import QuotaController, attainment, ceiling, long_documents
from schemas.base import TaskClass
from schemas.control import AdmissionQuotas, ClassQuota
from schemas.objectives import DEFAULT_OBJECTIVES
from schemas.tables import CapacityTable, GoodputTable
from sim.engine import Engine
from sim.records import RequestRecord
from sim.telemetry import instance_telemetry
from streams.tables.builder import DcTables
from streams.tables.outcomes import Outcome, OutcomeKind
from streams.tables.windows import WindowSpec

_KINDS = {
    "completed": OutcomeKind.COMPLETED,
    "cancelled": OutcomeKind.CANCELLED,
    "rejected": OutcomeKind.FAILED,
}


@dataclass(frozen=True)
class Step:
    """One pass of the loop, for the plot of its outputs over time."""

    at_s: float
    long_documents: int | None
    """The limit on long documents in flight after this pass (None: none published)."""
    batch: int | None
    """The ceiling on batch requests in flight after this pass (None: none)."""
    interactive_compliance: float
    long_document_compliance: float


@dataclass
class RecordTables:
    """One DC's tables fed from a simulation's records and its engines' telemetry, as the
    stream processors would build them from the events."""

    dc: str
    window: WindowSpec = field(default_factory=lambda: WindowSpec(60.0, 5.0, 10.0))
    _tables: DcTables = field(default_factory=DcTables)
    _counted: int = 0

    def update(
        self, records: list[RequestRecord], instances: list[tuple[str, Engine]], now: float
    ) -> tuple[GoodputTable, CapacityTable]:
        """Count the records that ended since the last update and each instance's state
        now (its telemetry, as the collector reports it); the tables as of now."""
        for instance_id, engine in instances:
            telemetry = instance_telemetry(engine, instance_id, self.dc, "model", "v1")
            self._tables.add_telemetry(telemetry, now, self.window)
        for record in records[self._counted :]:
            outcome = _outcome(record, self.dc)
            objective = DEFAULT_OBJECTIVES[TaskClass(record.task_class)]
            self._tables.add_outcome(outcome, objective, self.window)
        self._counted = len(records)
        tables = self._tables.tables(self.dc, self.window, now)
        goodput = next(t for t in tables if isinstance(t, GoodputTable))
        capacity = next(t for t in tables if isinstance(t, CapacityTable))
        return goodput, capacity


@dataclass
class QuotaLoop:
    controller: QuotaController = field(default_factory=QuotaController)
    period_s: float = 5.0
    dc: str = "dc"
    quotas: AdmissionQuotas | None = None
    steps: list[Step] = field(default_factory=list)
    _tables: RecordTables = field(init=False)

    def __post_init__(self) -> None:
        self._tables = RecordTables(self.dc)

    def tick(
        self, records: list[RequestRecord], instances: list[tuple[str, Engine]], now: float
    ) -> dict[TaskClass, ClassQuota] | None:
        """Bring the DC's tables up to now and reconcile; the quotas by class when they
        changed, else None."""
        goodput, capacity = self._tables.update(records, instances, now)
        changed = self.controller.reconcile(goodput, capacity, self.quotas, now)
        if changed is not None:
            self.quotas = changed
        rows = {row.key: attainment(row)[0] for row in goodput.classes}
        limit = long_documents(self.quotas) if self.quotas else None
        batch = ceiling(self.quotas, TaskClass.BATCH) if self.quotas else None
        self.steps.append(
            Step(
                now,
                limit,
                batch,
                rows[TaskClass.INTERACTIVE.value],
                rows[TaskClass.LONG_DOCUMENT.value],
            )
        )
        if changed is None:
            return None
        return {q.task_class: q for q in changed.quotas if q.tenant is None}


def _outcome(record: RequestRecord, dc: str) -> Outcome:
    ended = record.arrival_s + (record.e2e_s or 0.0)
    return Outcome(
        record.request_id,
        f"{record.request_id}:{record.outcome}",
        ended,
        dc,
        "model",
        record.task_class,
        record.tenant,
        _KINDS[record.outcome],
        record.input_tokens,
        record.cached_tokens,
        record.output_tokens,
        record.ttft_s or 0.0,
        record.tpot_s or 0.0,
        record.e2e_s or 0.0,
        record.deadline_s,
        source_region=record.source_region,
    )

"""SLOMax's controller: from the goodput table to class quotas, as a level-based reconcile
loop (controller-runtime's shape).

Each pass reads the latest goodput table (one DC, a sliding window) and the quotas last
published, and computes the quotas the whole table calls for, not a reaction to one event.
What it moves is the long-prompt partition (``ClassQuota.reserved_share`` of
long_document: the share of instances that take long prompts, which interactive requests
keep off): while interactive requests miss their objective, the partition shrinks and
chats get more instances; while they meet it with room to spare and long documents do
worse, it grows. It moves one bounded step per pass, not at all inside the hysteresis band
or on a window with too few outcomes to judge, and it publishes only a change.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from pydantic import Field

from control.admission.slomax import SLOMaxParams
from schemas.base import TaskClass
from schemas.control import AdmissionQuotas, ClassQuota
from schemas.tables import GoodputRow, GoodputTable


@dataclass(frozen=True)
class QuotaControllerParams:
    interactive_target: Annotated[float, Field(gt=0, le=1)] = 0.95
    """The share of interactive requests that must meet their objective."""
    band: Annotated[float, Field(ge=0, le=1)] = 0.02
    """Above the target by less than this, the partition stays where it is."""
    step: Annotated[float, Field(gt=0, le=1)] = 1 / 16
    """How far the partition moves in one pass: one instance of a pool of 16."""
    initial_long_share: Annotated[float, Field(ge=0, le=1)] = SLOMaxParams().long_partition_share
    """Where the partition starts: where SLOMax stands before any quotas."""
    min_long_share: Annotated[float, Field(ge=0, le=1)] = 0.125
    max_long_share: Annotated[float, Field(ge=0, le=1)] = 0.75
    interactive_kv_share: Annotated[float, Field(ge=0, le=1)] = 0.15
    """KV held back for interactive requests (``reserved_share`` of interactive)."""
    min_outcomes: Annotated[int, Field(ge=1)] = 30
    """Interactive outcomes a window needs before the controller acts on it."""
    ttl_s: Annotated[float, Field(gt=0)] = 60.0
    """How long a gateway keeps published quotas without hearing a newer version."""


def attainment(row: GoodputRow) -> tuple[float, int]:
    """The share of a class's ended requests that met their objective, and how many ended
    (completed, failed, cancelled or timed out: all that a client waited for)."""
    ended = row.completed + row.failures + row.cancellations + row.timeouts
    met = round(row.compliance * row.completed)
    return (met / ended if ended else 1.0), ended


@dataclass(frozen=True)
class QuotaController:
    params: QuotaControllerParams = QuotaControllerParams()

    def reconcile(
        self, goodput: GoodputTable, current: AdmissionQuotas | None, now: float
    ) -> AdmissionQuotas | None:
        """The quotas the table calls for; None when they are the ones published."""
        share = self.params.initial_long_share if current is None else long_share(current)
        desired = self.desired_long_share(goodput, share)
        if current is not None and desired == share:
            return None
        return AdmissionQuotas(
            scope=goodput.dc,
            version=1 if current is None else current.version + 1,
            issued_at=now,
            ttl_s=self.params.ttl_s,
            quotas=(
                ClassQuota(
                    task_class=TaskClass.INTERACTIVE,
                    reserved_share=self.params.interactive_kv_share,
                ),
                ClassQuota(task_class=TaskClass.LONG_DOCUMENT, reserved_share=desired),
            ),
        )

    def desired_long_share(self, goodput: GoodputTable, share: float) -> float:
        p = self.params
        rows = {row.key: row for row in goodput.classes}
        chats, ended = attainment(rows[TaskClass.INTERACTIVE.value])
        documents, _ = attainment(rows[TaskClass.LONG_DOCUMENT.value])
        if ended < p.min_outcomes:
            return share
        if chats < p.interactive_target:
            share -= p.step
        elif chats > p.interactive_target + p.band and documents < chats:
            share += p.step
        return round(min(max(share, p.min_long_share), p.max_long_share), 6)


def long_share(quotas: AdmissionQuotas) -> float:
    """The long-prompt partition the quotas name (0 when they name none)."""
    return next(
        (
            q.reserved_share
            for q in quotas.quotas
            if q.task_class is TaskClass.LONG_DOCUMENT and q.tenant is None
        ),
        0.0,
    )

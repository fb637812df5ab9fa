"""SLOMax's controller: from the DC's tables to class quotas, as a level-based reconcile
loop (controller-runtime's shape).

Each pass reads the latest goodput and capacity tables (one DC, a sliding window) and the
quotas last published, and computes the quotas the whole state calls for, not a reaction
to one event. What it moves is how many long documents may be in flight at once, per
ready instance: their prefills are what slows the chats beside them. While interactive
requests miss their objective, the limit falls; while they meet it with room to spare
and the limit turns long documents away (refused, or held until too late), it rises. It
moves one bounded step per pass, not at all inside the hysteresis band or on a window with
too few outcomes to judge, and it publishes only a change.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Annotated

from pydantic import Field

from control.admission.slomax import SLOMaxParams
from schemas.base import TaskClass
from schemas.control import AdmissionQuotas, ClassQuota
from schemas.tables import CapacityTable, GoodputRow, GoodputTable


@dataclass(frozen=True)
class QuotaControllerParams:
    interactive_target: Annotated[float, Field(gt=0, le=1)] = 0.95
    """The share of interactive requests that must meet their objective."""
    band: Annotated[float, Field(ge=0, le=1)] = 0.02
    """Above the target by less than this, the limit stays where it is."""
    lower_step: Annotated[float, Field(gt=1)] = 2.0
    """How far the limit falls in one pass (divided by this) while chats miss: halved,
    so that from 4 long documents per instance it reaches one in 30 s. Falling by 1.25
    took 135 s to go from 64 to 7 on 16 instances, longer than the whole 2.0 x level of
    ``tokenfleet bench admission`` lasts (about 100 s of arrivals), and chats met their
    objective 77.5 % of the time in its first minute. Halving, on the mixed workload at 16
    instances (SLOMax's rows only; 2026-12-05): seed 0 pooled goodput 17,728 against
    17,873 tokens/s, chats in time 96.8 % against 96.0 %; seed 1 21,398 against 21,659,
    chats 95.2 % against 94.0 % (85.8 to 88.8 % at 2.0 x)."""
    raise_step: Annotated[float, Field(gt=1)] = 1.25
    """How far it rises (times this) when it turned long documents away and chats have
    room; it rises at most once a window (``raise_after_s``), so a window that still lags a
    rising load cannot pull it far above what the load allows. Rising by 1.1 instead gave
    17,775 against 17,822 tokens/s of pooled goodput on the 30-minute mixed workload."""
    initial_per_instance: Annotated[float, Field(gt=0)] = SLOMaxParams().long_documents_per_instance
    """Where the limit starts: where SLOMax stands before any quotas."""
    min_per_instance: Annotated[float, Field(gt=0)] = 0.5
    max_per_instance: Annotated[float, Field(gt=0)] = 8.0
    lower_after_s: Annotated[float, Field(ge=0)] = 15.0
    """Time since the last change before the limit may fall again: a quarter of the
    tables' 60 s window, so a fall shows in the window before the next one."""
    raise_after_s: Annotated[float, Field(ge=0)] = 60.0
    """Time since the last change before the limit may rise: a whole window, so the rise
    is judged on outcomes that all came after the last change."""
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
        self,
        goodput: GoodputTable,
        capacity: CapacityTable,
        current: AdmissionQuotas | None,
        now: float,
    ) -> AdmissionQuotas | None:
        """The quotas the tables call for; None when they are the ones published, or when
        the capacity table shows no ready instance to size them by."""
        instances = sum(row.ready_endpoints for row in capacity.rows)
        if instances == 0:
            return None
        published = None if current is None else long_documents(current)
        per_instance = (
            self.params.initial_per_instance if published is None else published / instances
        )
        desired = self._whole(
            self.desired_per_instance(goodput, per_instance), per_instance, published, instances
        )
        if current is not None and (
            desired == published or not self._settled(current, desired, now)
        ):
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
                ClassQuota(task_class=TaskClass.LONG_DOCUMENT, max_concurrency=desired),
            ),
        )

    def _whole(
        self, wanted: float, per_instance: float, published: int | None, instances: int
    ) -> int:
        """The limit for the fleet: ``wanted`` per instance as a whole number of requests,
        at least one request away from ``published`` when it moves (a step smaller than one
        request would otherwise round back to where it was), and within the bounds."""
        p = self.params
        total = wanted * instances
        if published is None:
            desired = round(total)
        elif wanted < per_instance:
            desired = min(published - 1, math.floor(total + 1e-9))
        elif wanted > per_instance:
            desired = max(published + 1, math.ceil(total - 1e-9))
        else:
            desired = published
        lowest = max(1, math.ceil(p.min_per_instance * instances - 1e-9))
        highest = max(lowest, math.floor(p.max_per_instance * instances + 1e-9))
        return min(max(desired, lowest), highest)

    def _settled(self, current: AdmissionQuotas, desired: int, now: float) -> bool:
        """Whether the last change is old enough for this one (hysteresis in time)."""
        published = long_documents(current)
        rising = published is not None and desired > published
        wait = self.params.raise_after_s if rising else self.params.lower_after_s
        return now - current.issued_at >= wait

    def desired_per_instance(self, goodput: GoodputTable, per_instance: float) -> float:
        p = self.params
        rows = {row.key: row for row in goodput.classes}
        interactive = rows.get(TaskClass.INTERACTIVE.value)
        documents = rows.get(TaskClass.LONG_DOCUMENT.value)
        if interactive is None:  # a table without the class's row: nothing to judge by
            return per_instance
        chats, ended = attainment(interactive)
        turned_away = documents is not None and documents.failures > 0
        if ended < p.min_outcomes:
            return per_instance
        if chats < p.interactive_target:
            per_instance /= p.lower_step
        elif chats > p.interactive_target + p.band and turned_away:
            per_instance *= p.raise_step
        return min(max(per_instance, p.min_per_instance), p.max_per_instance)


def long_documents(quotas: AdmissionQuotas) -> int | None:
    """The long documents in flight the quotas allow (None: they set no limit)."""
    return next(
        (
            q.max_concurrency
            for q in quotas.quotas
            if q.task_class is TaskClass.LONG_DOCUMENT and q.tenant is None
        ),
        None,
    )

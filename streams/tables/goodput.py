"""Goodput per (DC, class), per (DC, tenant), per (DC, source region, class) and per
(DC, model): one mergeable aggregate per group."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from schemas.base import TaskClass
from schemas.objectives import ClassObjective
from schemas.tables import GoodputRow, region_row_key
from streams.tables.outcomes import Outcome, OutcomeKind
from streams.tables.sketch import QuantileSketch


@dataclass
class GoodputCounts:
    completed: int = 0
    output_tokens: int = 0
    goodput_tokens: int = 0
    met: int = 0
    failures: int = 0
    cancellations: int = 0
    timeouts: int = 0
    retries: int = 0
    repeated_executions: int = 0
    wasted_tokens: int = 0
    late_events: int = 0
    ttft: QuantileSketch = field(default_factory=QuantileSketch)
    tpot: QuantileSketch = field(default_factory=QuantileSketch)

    def add(self, outcome: Outcome, objective: ClassObjective) -> None:
        """Count one outcome. Tokens of failed, cancelled, timed-out and repeated
        executions are wasted; a completion counts as goodput when it met its objective."""
        self.retries += outcome.retries
        if outcome.repeated:
            self.repeated_executions += 1
            self.wasted_tokens += outcome.output_tokens
            return
        if outcome.kind is not OutcomeKind.COMPLETED:
            self.wasted_tokens += outcome.output_tokens
            self.failures += outcome.kind is OutcomeKind.FAILED
            self.cancellations += outcome.kind is OutcomeKind.CANCELLED
            self.timeouts += outcome.kind is OutcomeKind.TIMED_OUT
            return
        self.completed += 1
        self.output_tokens += outcome.output_tokens
        whole = None if outcome.streamed else outcome.output_tokens
        if outcome.streamed:  # a whole answer has no TTFT or TPOT to put beside these
            self.ttft.add(outcome.ttft_s)
            self.tpot.add(outcome.tpot_s)
        met = objective.met(
            outcome.ttft_s,
            outcome.tpot_s,
            outcome.e2e_s,
            outcome.deadline_s,
            whole_output_tokens=whole,
        )
        if met:
            self.met += 1
            self.goodput_tokens += outcome.output_tokens

    def merge(self, other: GoodputCounts) -> None:
        for name in _COUNTERS:
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.ttft.merge(other.ttft)
        self.tpot.merge(other.tpot)

    def row(self, key: str, span_s: float) -> GoodputRow:
        """The group's row; rates over ``span_s``, the window's span."""
        per_s = 1 / span_s if span_s > 0 else 0.0
        return GoodputRow(
            key=key,
            completed=self.completed,
            output_tokens=self.output_tokens,
            goodput_tokens=self.goodput_tokens,
            output_tokens_per_s=self.output_tokens * per_s,
            goodput_tokens_per_s=self.goodput_tokens * per_s,
            compliance=self.met / self.completed if self.completed else 0.0,
            ttft_p50_s=self.ttft.quantile(0.5),
            ttft_p95_s=self.ttft.quantile(0.95),
            ttft_p99_s=self.ttft.quantile(0.99),
            tpot_p50_s=self.tpot.quantile(0.5),
            tpot_p95_s=self.tpot.quantile(0.95),
            tpot_p99_s=self.tpot.quantile(0.99),
            failures=self.failures,
            cancellations=self.cancellations,
            timeouts=self.timeouts,
            retries=self.retries,
            repeated_executions=self.repeated_executions,
            wasted_tokens=self.wasted_tokens,
            late_events=self.late_events,
        )

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {name: getattr(self, name) for name in _COUNTERS}
        return data | {"ttft": self.ttft.to_dict(), "tpot": self.tpot.to_dict()}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GoodputCounts:
        counts = cls(**{name: data[name] for name in _COUNTERS})
        counts.ttft = QuantileSketch.from_dict(data["ttft"])
        counts.tpot = QuantileSketch.from_dict(data["tpot"])
        return counts


_COUNTERS = tuple(f.name for f in fields(GoodputCounts) if f.type == "int")


def group_keys(outcome: Outcome) -> tuple[str, ...]:
    """The groups an outcome counts in: its class, its tenant, and its source region's
    class and its model where those are known."""
    keys: tuple[str, ...] = f"class:{outcome.task_class}", f"tenant:{outcome.tenant}"
    if outcome.source_region:
        region = region_row_key(outcome.source_region, TaskClass(outcome.task_class))
        keys = (*keys, f"region:{region}")
    if outcome.model:
        keys = (*keys, f"model:{outcome.model}")
    return keys


Rows = tuple[GoodputRow, ...]
KINDS = ("tenant:", "region:", "model:")
"""The groups besides the classes, in the order ``rows`` gives them."""


def rows(groups: dict[str, GoodputCounts], span_s: float) -> tuple[Rows, Rows, Rows, Rows]:
    """Class rows (every class, even without traffic), then tenant, source-region and
    model rows, each sorted by key."""
    classes = tuple(
        groups.get(f"class:{c.value}", GoodputCounts()).row(c.value, span_s) for c in TaskClass
    )
    tenants, regions, models = (_rows_of(groups, kind, span_s) for kind in KINDS)
    return classes, tenants, regions, models


def _rows_of(groups: dict[str, GoodputCounts], kind: str, span_s: float) -> Rows:
    return tuple(
        counts.row(key.removeprefix(kind), span_s)
        for key, counts in sorted(groups.items())
        if key.startswith(kind)
    )

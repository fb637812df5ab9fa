"""FleetMind's short cycle: from each DC's goodput table to routing weights, as a
level-based reconcile loop (the shape of SLOMax's controller).

A weight is the share of a DC's stated capacity the edge should count on (1: all of it;
FleetMind divides the DC's utilisation and backlog by it). The edge prices load from its
own counts against an operator's capacity figure; the weight corrects that figure by
what the DC delivers: while a DC's requests miss their objectives, its weight falls, so
the edge sends it less before its queues show; once they meet them again, it climbs
back. It moves one bounded step per DC per pass, not at all inside the hysteresis band,
on a window with too few outcomes to judge, or sooner than ``settle_s`` after the DC's
last change. The tables hold no model, so a DC's weight is the same for every model it
serves.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Annotated

from pydantic import Field

from control.controllers.slomax import attainment
from schemas.control import DcWeight, RoutingWeights
from schemas.tables import GoodputTable


@dataclass(frozen=True)
class WeightParams:
    target: Annotated[float, Field(gt=0, le=1)] = 0.9
    """The share of a DC's requests (all classes) that should meet their objectives."""
    band: Annotated[float, Field(ge=0, le=1)] = 0.05
    """Below the target by less than this, the weight stays where it is."""
    lower_by: Annotated[float, Field(gt=0, lt=1)] = 0.8
    """A missing DC's weight is multiplied by this each pass."""
    raise_by: Annotated[float, Field(gt=0)] = 0.1
    """A DC back at its target gains this much weight each pass, up to 1."""
    floor: Annotated[float, Field(gt=0, le=1)] = 0.25
    """The least weight: draining a DC is readiness's job, not the weights'."""
    min_outcomes: Annotated[int, Field(ge=1)] = 30
    settle_s: Annotated[float, Field(ge=0)] = 10.0
    """Time after a DC's change before it may change again: two slides of the tables'
    window, so that the change shows in what the next one judges."""
    ttl_s: Annotated[float, Field(gt=0)] = 60.0


@dataclass(frozen=True)
class WeightController:
    params: WeightParams = WeightParams()

    def reconcile(
        self,
        goodput: Mapping[str, GoodputTable],
        current: Mapping[str, float],
        changed_at: Mapping[str, float],
        now: float,
    ) -> dict[str, float] | None:
        """Each DC's weight as its goodput table calls for (a DC not in ``current``
        stands at 1); None when they are the ``current`` ones. ``changed_at``: when each
        DC's weight last changed."""
        desired = {
            dc: self._desired(table, current.get(dc, 1.0), now - changed_at.get(dc, -1e18))
            for dc, table in sorted(goodput.items())
        }
        if all(current.get(dc, 1.0) == weight for dc, weight in desired.items()):
            return None
        return {**current, **desired}

    def _desired(self, table: GoodputTable, weight: float, since_change_s: float) -> float:
        p = self.params
        met, ended = 0.0, 0
        for row in table.classes:
            share, count = attainment(row)
            met += share * count
            ended += count
        if ended < p.min_outcomes or since_change_s < p.settle_s:
            return weight
        share = met / ended
        if share < p.target - p.band:
            return max(p.floor, round(weight * p.lower_by, 4))
        if share >= p.target:
            return min(1.0, round(weight + p.raise_by, 4))
        return weight

    def snapshot(
        self,
        weights: Mapping[str, float],
        models: Iterable[str],
        scope: str,
        version: int,
        now: float,
    ) -> RoutingWeights:
        """The weights as published for the edge ``scope``: each DC's for every model."""
        return RoutingWeights(
            scope=scope,
            version=version,
            issued_at=now,
            ttl_s=self.params.ttl_s,
            weights=tuple(
                DcWeight(model=model, dc=dc, weight=weight)
                for model in models
                for dc, weight in sorted(weights.items())
            ),
        )


def weights_of(published: RoutingWeights | None, model: str | None = None) -> dict[str, float]:
    """Each DC's weight in ``published`` (for ``model``; None: the first given per DC)."""
    if published is None:
        return {}
    found: dict[str, float] = {}
    for w in published.weights:
        if model is None or w.model == model:
            found.setdefault(w.dc, w.weight)
    return found

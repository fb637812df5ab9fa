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

With ``per_class``, each class has a weight of its own, judged on its own row of the
table: a DC whose chats miss their objective while its long documents meet theirs sends
chats elsewhere and keeps its documents. It is off by default (measured below).

With ``per_region``, each edge gets weights of its own, judged on what each DC delivered
to the requests of the edge's region (the tables' ``regions`` rows), since a DC far from
one region can miss its clients' first-token objective while it serves a near one in
time. Where a region has had fewer than ``min_outcomes`` requests end in a DC within the
window, the DC is judged on all its requests, as it is for an edge with no region. Off
by default (measured below).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Annotated

from pydantic import Field

from control.controllers.slomax import attainment
from schemas.base import TaskClass
from schemas.control import DcWeight, RoutingWeights
from schemas.tables import GoodputRow, GoodputTable

WeightKey = tuple[str, TaskClass | None]
"""A weight's DC and class (None: every class, when weights are not per class)."""


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
    """The fewest requests that must have ended in a DC within the tables' window before
    its weight moves down, or up by what they show: fewer say too little about the DC to
    act on (but see ``regain_after_s``)."""
    regain_after_s: Annotated[float, Field(gt=0)] = 60.0
    """A weight below 1 whose DC had too few requests end to judge regains ``raise_by``
    once this long (the tables' window) has passed since its last change: a low weight
    itself keeps traffic away, and a DC at 0.25 whose stated capacity is 2 requests a
    second takes about 0.45 a second, 27 a window, so it would never be judged again. As
    SLOMax's controller lifts its batch ceiling with no chats to judge by."""
    settle_s: Annotated[float, Field(ge=0)] = 30.0
    """Time after a DC's change before it may change again: half the tables' 60 s window,
    so that what the next judgement reads ended mostly under the new weight. At 10 s (two
    slides) a falling weight went on falling on the outcomes of the weights before it, to
    the floor in 60 s (seed 1's C, 1 to 0.25), and rose again only once the window had
    forgotten them. ``tokenfleet bench fleet --policies fleetmind`` at 81d24f9, seeds 0, 1,
    3 and 4: goodput 6,908, 8,415, 5,487 and 6,305 tokens/s at 30 s against 6,908, 8,390,
    5,473 and 6,332 at 10 s and 6,896, 8,395, 5,492 and 6,303 at 60 s; the hotspot's chats'
    TTFT P95 0.397, 0.449, 0.432 and 0.472 s against 0.393, 0.564, 0.439 and 0.492 at 10 s;
    seed 1's C fell to 0.64. A fall of 0.6 rather than 0.8 a step at 30 s lost on seeds 0
    and 1 (6,905 and 8,386)."""
    ttl_s: Annotated[float, Field(gt=0)] = 60.0
    per_region: bool = False
    """Each edge's weights judged on its own region's requests (``regions`` rows, where
    at least ``min_outcomes`` of them ended); False: every edge's on all requests. Off by
    default: in ``tokenfleet bench fleet`` it lost goodput (6,943 and 7,562 tokens/s on
    seeds 0 and 1, against 6,995 and 7,650). Part of A's overflow into C ran late or was
    refused while D's model warmed up, so C's weight for A fell to 0.64 and A's traffic
    went to D, 80 ms away; judged on all C's requests, its own region's included, it
    stayed whole."""
    per_class: bool = False
    """A weight per (DC, class), each judged on its class's outcomes; False: one per DC
    on all of them, which every class follows. Per class cut the hotspot's TTFT P95 in
    ``tokenfleet bench fleet`` (1.61 s against 2.46 on seed 0) but lost goodput (6,888
    and 7,553 tokens/s on seeds 0 and 1, against 6,995 and 7,650): the chats left B while
    the long documents stayed and filled it."""


@dataclass(frozen=True)
class WeightController:
    params: WeightParams = WeightParams()

    def reconcile(
        self,
        goodput: Mapping[str, GoodputTable],
        current: Mapping[WeightKey, float],
        changed_at: Mapping[WeightKey, float],
        now: float,
        region: str | None = None,
    ) -> dict[WeightKey, float] | None:
        """Each weight, for the edge of source ``region`` (None: judged on every region's
        requests), as its DC's goodput table calls for (one not in ``current`` stands at
        1); None when they are the ``current`` ones. ``changed_at``: when each weight last
        changed. A weight no table in ``goodput`` judges (its DC's tables went stale, or
        its class ended no request there) is one too few requests judge: it regains."""
        since = {key: now - at for key, at in changed_at.items()}
        desired = {
            key: self._desired(rows, current.get(key, 1.0), since.get(key, math.inf))
            for dc, table in sorted(goodput.items())
            for key, rows in self.groups(dc, table, region).items()
        }
        desired |= {
            key: self._desired((), weight, since.get(key, math.inf))
            for key, weight in current.items()
            if key not in desired
        }
        if all(current.get(key, 1.0) == weight for key, weight in desired.items()):
            return None
        return {**current, **desired}

    def groups(
        self, dc: str, table: GoodputTable, region: str | None = None
    ) -> dict[WeightKey, list[GoodputRow]]:
        """The weights ``dc``'s table judges for the edge of ``region``, each with the rows
        it is judged on: with ``per_region``, the region's own where enough of its
        requests ended; else the DC's rows for every region."""
        own = table.region_rows(region) if region is not None and self.params.per_region else {}
        if not self.params.per_class:
            return {(dc, None): self._enough(list(own.values())) or list(table.classes)}
        judged: dict[WeightKey, list[GoodputRow]] = {}
        for row in table.classes:
            task_class = TaskClass(row.key)
            mine = [own[task_class]] if task_class in own else []
            judged[dc, task_class] = self._enough(mine) or [row]
        return judged

    def _enough(self, rows: list[GoodputRow]) -> list[GoodputRow]:
        """``rows`` if at least ``min_outcomes`` of their requests ended, else none."""
        ended = sum(attainment(row)[1] for row in rows)
        return rows if ended >= self.params.min_outcomes else []

    def _desired(self, rows: Iterable[GoodputRow], weight: float, since_change_s: float) -> float:
        p = self.params
        met, ended = 0.0, 0
        for row in rows:
            share, count = attainment(row)
            met += share * count
            ended += count
        if ended < p.min_outcomes:
            regains = weight < 1.0 and since_change_s >= p.regain_after_s
            return min(1.0, round(weight + p.raise_by, 4)) if regains else weight
        if since_change_s < p.settle_s:
            return weight
        share = met / ended
        if share < p.target - p.band:
            return max(p.floor, round(weight * p.lower_by, 4))
        if share >= p.target:
            return min(1.0, round(weight + p.raise_by, 4))
        return weight

    def snapshot(
        self,
        weights: Mapping[WeightKey, float],
        models: Iterable[str],
        scope: str,
        version: int,
        now: float,
    ) -> RoutingWeights:
        """The weights as published for the edge ``scope``: each for every model."""
        return RoutingWeights(
            scope=scope,
            version=version,
            issued_at=now,
            ttl_s=self.params.ttl_s,
            weights=tuple(
                DcWeight(model=model, dc=dc, weight=weight, task_class=task_class)
                for model in models
                for (dc, task_class), weight in sorted(weights.items(), key=_in_order)
            ),
        )


def _in_order(item: tuple[WeightKey, float]) -> tuple[str, str]:
    (dc, task_class), _ = item
    return dc, "" if task_class is None else task_class.value


def weights_of(
    published: RoutingWeights | None,
    model: str | None = None,
    task_class: TaskClass | None = None,
) -> dict[str, float]:
    """Each DC's weight in ``published`` for ``model`` (None: any) and ``task_class``:
    the class's own, else the one for every class; a DC with neither is not named.
    ``task_class`` None: the weights for every class alone."""
    if published is None:
        return {}
    general: dict[str, float] = {}
    own: dict[str, float] = {}
    for w in published.weights:
        if model is not None and w.model != model:
            continue
        if w.task_class is None:
            general.setdefault(w.dc, w.weight)
        elif w.task_class is task_class:
            own.setdefault(w.dc, w.weight)
    return general | own


def take_in(
    current: dict[WeightKey, float],
    changed_at: dict[WeightKey, float],
    weights: Mapping[WeightKey, float],
    at: float,
) -> None:
    """Hold ``weights`` in ``current`` as the ones in force since ``at``, noting in
    ``changed_at`` when each one that moved changed (a weight not held stood at 1)."""
    for key, weight in weights.items():
        if current.get(key, 1.0) != weight:
            changed_at[key] = at
        current[key] = weight


def keyed_weights(published: RoutingWeights) -> dict[WeightKey, float]:
    """Every (DC, class) weight in ``published`` (the same for every model)."""
    found: dict[WeightKey, float] = {}
    for w in published.weights:
        found.setdefault((w.dc, w.task_class), w.weight)
    return found


def weight_for(weights: Mapping[WeightKey, float], dc: str, task_class: TaskClass) -> float | None:
    """``dc``'s weight for ``task_class``: its own, else the one for every class."""
    return weights.get((dc, task_class), weights.get((dc, None)))

"""FleetMind's long cycle: from each DC's load over minutes to the replicas it should
run, as a level-based reconcile loop.

A DC that ran hot over the last window (the edge sent it more than ``grow_above`` of what
its ready replicas serve) is given the replicas that would bring it to ``target``, up to
the GPUs it has; one that ran cold (under ``shrink_below``) gives one back, down to the
replicas it had to begin with. A replica takes minutes to load its model, so a
recommendation pays only after its warm-up: the loop looks at a long window and moves
at most once per ``settle_s`` per DC, so that the next judgement sees the replicas the
last one asked for.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated

from pydantic import Field

from schemas.control import PlacementAction, PlacementRecommendation
from schemas.fleet import InstanceConfig
from schemas.tables import GoodputTable


@dataclass(frozen=True)
class DcReplicas:
    """One DC's replicas of a model, and what it was sent over the window."""

    ready: int
    """Replicas serving."""
    deployed: int
    """Replicas serving or loading the model."""
    floor: int
    """Replicas it keeps whatever the load (its base deployment)."""
    ceiling: int
    """Replicas its GPUs can hold."""
    sent_rps: float
    """Requests per second the edge sent it over the window."""


@dataclass(frozen=True)
class PlacementParams:
    target: Annotated[float, Field(gt=0, le=1)] = 0.7
    """The share of its replicas' capacity a DC is sized to run at."""
    grow_above: Annotated[float, Field(gt=0)] = 0.8
    shrink_below: Annotated[float, Field(ge=0)] = 0.4
    settle_s: Annotated[float, Field(ge=0)] = 120.0
    ttl_s: Annotated[float, Field(gt=0)] = 600.0


@dataclass(frozen=True)
class PlacementController:
    params: PlacementParams = PlacementParams()

    def targets(
        self,
        dcs: Mapping[str, DcReplicas],
        per_replica_rps: float,
        changed_at: Mapping[str, float],
        now: float,
    ) -> dict[str, tuple[int, str]]:
        """Each DC whose replicas should change: the number to deploy, and why."""
        p = self.params
        out = {}
        for name, dc in sorted(dcs.items()):
            if now - changed_at.get(name, -math.inf) < p.settle_s or dc.ready < dc.deployed:
                continue  # settling, or replicas still warming up
            served = per_replica_rps * max(dc.ready, 1)
            load = dc.sent_rps / served
            if load > p.grow_above and dc.deployed < dc.ceiling:
                wanted = math.ceil(dc.sent_rps / (per_replica_rps * p.target))
                out[name] = (min(dc.ceiling, max(wanted, dc.deployed + 1)), f"load {load:.2f}")
            elif load < p.shrink_below and dc.deployed > dc.floor:
                out[name] = (dc.deployed - 1, f"load {load:.2f}")
        return out

    def snapshot(
        self, dc: str, desired: Sequence[PlacementAction], version: int, now: float
    ) -> PlacementRecommendation:
        """``dc``'s replicas of every model the long cycle manages there, whole: whoever
        applies it (an emulator, an operator's tooling) reads only the newest and makes
        its replicas match."""
        return PlacementRecommendation(
            scope=dc,
            version=version,
            issued_at=now,
            ttl_s=self.params.ttl_s,
            actions=tuple(desired),
        )


def concluded_rps(table: GoodputTable) -> float:
    """Requests a DC's window ended per second: completed, failed, cancelled or timed out.
    At saturation this reads what its replicas serve, so a DC that runs hot shows as
    running at capacity and grows a step at a time."""
    span = max(table.window_end - table.window_start, 1e-9)
    ended = sum(r.completed + r.failures + r.cancellations + r.timeouts for r in table.classes)
    return ended / span


def instances_to_run(
    instances: Sequence[InstanceConfig], placed: PlacementRecommendation | None
) -> frozenset[str]:
    """Which of a DC's ``instances`` run under ``placed``: every one not on standby, and
    per model the first standby ones (in the fleet file's order) that bring it to the
    replicas ``placed`` asks for; none of the standby ones without a recommendation."""
    running = {i.id for i in instances if not i.standby}
    for action in placed.actions if placed is not None else ():
        placed_here = [i for i in instances if (i.model, i.dc) == (action.model, action.dc)]
        floor = sum(1 for i in placed_here if not i.standby)
        spare = [i.id for i in placed_here if i.standby]
        running.update(spare[: max(action.target_replicas - floor, 0)])
    return frozenset(running)

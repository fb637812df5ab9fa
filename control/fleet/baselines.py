"""The DC choices operators deploy today, as their projects define them
(``docs/fleetmind-baselines.md`` has what each does upstream, with its sources). Each
applies the hard filters first (``view.admissible``), as an operator would configure it
with only the places a request may go; the rest of their order is their fallback."""

from __future__ import annotations

import math
from dataclasses import dataclass

from control.fleet.view import DataCenterState, DcDecision, DcRequest, FleetState, admissible


@dataclass(frozen=True)
class LocalOnly:
    """Every request runs in its entry region's home DC: the DC whose gateway took it,
    else the DC in that region, or for a region without GPUs the nearest by round trip.
    No fallback: a home DC that cannot run the request leaves it unserved."""

    name: str = "local_only"

    def choose(self, request: DcRequest, fleet: FleetState) -> DcDecision:
        allowed, excluded = admissible(request, fleet)
        by_name = {dc.name: dc for dc in fleet.dcs}
        nearest = fleet.nearest_first(request.source_region, fleet.dcs)
        home = by_name.get(request.source_dc or "") or next(iter(nearest), None)
        return DcDecision(self.name, (home.name,) if home in allowed else (), excluded)


@dataclass(frozen=True)
class EnvoyPriorityFailover:
    """Envoy's priority levels (envoyproxy/envoy, ``LoadBalancerBase::
    recalculatePerPriorityState``, ``recalculatePerPriorityPanic`` and
    ``recalculateLoadInTotalPanic`` in ``load_balancing_policies/common/
    load_balancer_impl.cc``), one level per DC, nearest first. A level's health is
    ``min(100, 140 * healthy // hosts)`` (overprovisioning factor 1.4); the normalised
    total is ``min(100, sum)``, and each level in turn takes ``min(left, health * 100 //
    total)`` percent, the rounding rest to the first healthy level. Below 50 % healthy
    (raw) a level is in panic; when every level is, loads follow host counts. Health is
    all it reads: load never moves traffic."""

    overprovisioning: int = 140
    panic_threshold: int = 50
    name: str = "envoy_priority_failover"

    def choose(self, request: DcRequest, fleet: FleetState) -> DcDecision:
        allowed, excluded = admissible(request, fleet)
        levels = fleet.nearest_first(request.source_region, allowed)
        if not levels:
            return DcDecision(self.name, (), excluded)
        loads = self.priority_loads(levels)
        pick = min(int(request.draw * 100) + 1, 100)  # Envoy draws 1..100
        cumulative, chosen = 0, 0
        for index, load in enumerate(loads):
            cumulative += load
            if pick <= cumulative:
                chosen = index
                break
        return DcDecision(self.name, _led_by(levels[chosen], levels), excluded)

    def priority_loads(self, levels: list[DataCenterState]) -> list[int]:
        """Each level's share of traffic in percent, summing to 100 (empty: none)."""
        if not levels:
            return []
        health = [
            min(100, self.overprovisioning * dc.ready_instances // max(dc.instances, 1))
            for dc in levels
        ]
        total = min(100, sum(health))
        panic = [
            100 * dc.ready_instances // max(dc.instances, 1) < self.panic_threshold for dc in levels
        ]
        if total == 0 or (total < 100 and all(panic)):  # total panic: by host counts
            weights = [dc.instances for dc in levels]
            loads = [100 * w // max(sum(weights), 1) for w in weights]
        else:
            loads, left = [], 100
            for h in health:
                loads.append(min(left, h * 100 // total))
                left -= loads[-1]
        first = next((i for i, h in enumerate(health) if h > 0), 0)
        loads[first] += 100 - sum(loads)
        return loads


@dataclass(frozen=True)
class GcpWaterfall:
    """Google Cloud load balancing's default ``WATERFALL_BY_REGION`` (Cloud Load
    Balancing docs, "Service load balancing policies"): the region nearest the client
    with healthy endpoints and capacity; a DC is full at ``maxUtilization`` (0.8, the
    2017 API's stated default) of its capacity, and one with fewer than 70 % of its
    endpoints healthy (``failoverHealthThreshold``) fails over to the next. When every DC
    is full, GCP's spill is not documented: here the least utilised takes it."""

    max_utilisation: float = 0.8
    failover_health: float = 0.7
    name: str = "gcp_waterfall"

    def choose(self, request: DcRequest, fleet: FleetState) -> DcDecision:
        allowed, excluded = admissible(request, fleet)
        nearest = fleet.nearest_first(request.source_region, allowed)
        healthy = [dc for dc in nearest if dc.healthy_share >= self.failover_health]
        with_room = [dc for dc in healthy if dc.utilisation < self.max_utilisation]
        if with_room:
            first = with_room[0]
        elif healthy:
            first = min(healthy, key=lambda dc: dc.utilisation)
        elif nearest:
            first = nearest[0]
        else:
            return DcDecision(self.name, (), excluded)
        return DcDecision(self.name, _led_by(first, nearest), excluded)


@dataclass(frozen=True)
class SkyServeLeastLoad:
    """SkyPilot SkyServe's default load balancer, ``least_load`` (skypilot
    ``sky/serve/load_balancing_policies.py``): the ready replica with the fewest requests
    in flight, counted by the balancer itself, wherever it runs (no region awareness).
    At DC granularity: the DC whose replicas carry the fewest in flight each, taken as
    spread evenly within the DC; ties rotate upstream, here by the request's draw."""

    name: str = "skyserve_least_load"

    def choose(self, request: DcRequest, fleet: FleetState) -> DcDecision:
        allowed, excluded = admissible(request, fleet)
        if not allowed:
            return DcDecision(self.name, (), excluded)
        rotated = _rotated(allowed, request.draw)
        order = sorted(rotated, key=lambda dc: dc.inflight_requests / max(dc.ready_instances, 1))
        return DcDecision(self.name, tuple(dc.name for dc in order), excluded)


@dataclass(frozen=True)
class LlmdMulticluster:
    """llm-d router's multi-cluster scoring (llm-d/llm-d-router v0.10.0, alpha): each
    cluster one candidate, scored by ``1 - mean KV use`` plus its mean queue min-max
    normalised, ``(max - q) / (max - min)`` (1 when all are equal), weights 1.0; the
    highest wins, ties at random (here by the request's draw). No distance term."""

    kv_weight: float = 1.0
    queue_weight: float = 1.0
    name: str = "llmd_multicluster"

    def choose(self, request: DcRequest, fleet: FleetState) -> DcDecision:
        allowed, excluded = admissible(request, fleet)
        if not allowed:
            return DcDecision(self.name, (), excluded)
        low, high = min(dc.queue for dc in allowed), max(dc.queue for dc in allowed)
        scores = {
            dc.name: self.kv_weight * (1 - dc.kv_use)
            + self.queue_weight * ((high - dc.queue) / (high - low) if high > low else 1.0)
            for dc in allowed
        }
        order = sorted(_rotated(allowed, request.draw), key=lambda dc: -scores[dc.name])
        costs = {name: {"score": score} for name, score in scores.items()}
        return DcDecision(self.name, tuple(dc.name for dc in order), excluded, costs)


def _led_by(first: DataCenterState, rest: list[DataCenterState]) -> tuple[str, ...]:
    """The DCs to try: ``first``, then the others in ``rest``'s order (the fallback)."""
    return (first.name, *(dc.name for dc in rest if dc is not first))


def _rotated(dcs: list[DataCenterState], draw: float) -> list[DataCenterState]:
    """``dcs`` starting at a place the draw picks, so that a stable sort breaks ties by it."""
    start = math.floor(draw * len(dcs)) % len(dcs)
    return dcs[start:] + dcs[:start]

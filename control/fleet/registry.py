"""DC policies by name."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from control.fleet.baselines import (
    EnvoyPriorityFailover,
    GcpWaterfall,
    LlmdMulticluster,
    LocalOnly,
    SkyServeLeastLoad,
)
from control.fleet.fleetmind import FleetMind
from control.fleet.view import DcDecision, DcRequest, FleetState


class DcPolicy(Protocol):
    """Picks the DCs to try for a request, from the edge's view of the fleet; pure."""

    @property
    def name(self) -> str: ...

    def choose(self, request: DcRequest, fleet: FleetState) -> DcDecision: ...


DC_POLICIES: dict[str, Callable[[], DcPolicy]] = {
    "fleetmind": FleetMind,
    "local_only": LocalOnly,
    "envoy_priority_failover": EnvoyPriorityFailover,
    "gcp_waterfall": GcpWaterfall,
    "skyserve_least_load": SkyServeLeastLoad,
    "llmd_multicluster": LlmdMulticluster,
}


def make_dc_policy(name: str) -> DcPolicy:
    try:
        return DC_POLICIES[name]()
    except KeyError:
        known = ", ".join(sorted(DC_POLICIES))
        raise KeyError(f"unknown DC policy {name!r}; known: {known}") from None

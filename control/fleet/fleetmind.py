"""FleetMind's per-request DC choice: the hard filters, then the cheapest DC with room.

A DC's cost is what the request would pay in seconds before its first token: the round
trip from the client's region, the prompt's transfer there, the wait the DC's tables
predict, less a warm prefix's saving and the controller's weight. DCs past their load cap
come after every DC with room (they are the fallback, not the choice), and a DC keeps a
share of its capacity for its own region's clients: to others it is full sooner.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from pydantic import Field

from control.fleet.view import DataCenterState, DcDecision, DcRequest, FleetState, admissible
from control.tokens import BYTES_PER_TOKEN


@dataclass(frozen=True)
class FleetMindParams:
    transfer_bytes_per_s: Annotated[float, Field(gt=0)] = 12.5e6
    """What one request's prompt moves at between regions: 100 Mbit/s, an assumption (a
    32k-token prompt then costs about 10 ms, small beside a round trip)."""
    busy_utilisation: Annotated[float, Field(gt=0)] = 0.9
    """Demand over capacity past which a DC is full: queues there grow faster than they
    drain."""
    reserved_share: Annotated[float, Field(ge=0, lt=1)] = 0.1
    """The share of a DC's capacity that only its own region's clients may fill."""
    warm_bonus_s: Annotated[float, Field(ge=0)] = 0.1
    """What a warm prefix saves: about the prefill of a few thousand tokens on the
    calibrated profiles, an assumption until the simulator measures it per DC."""
    weight_bias_s: Annotated[float, Field(ge=0)] = 0.5
    """What the controller's whole weight (1.0) is worth against the other costs: enough
    to outweigh a cross-continent round trip, not a queue of several seconds."""


@dataclass(frozen=True)
class FleetMind:
    params: FleetMindParams = FleetMindParams()
    name: str = "fleetmind"

    def choose(self, request: DcRequest, fleet: FleetState) -> DcDecision:
        allowed, excluded = admissible(request, fleet)
        costs = {dc.name: self._cost(request, dc, fleet) for dc in allowed}
        order = sorted(
            allowed,
            key=lambda dc: (
                costs[dc.name]["full"],
                costs[dc.name]["cost"],
                dc.name != request.source_dc,
            ),
        )
        return DcDecision(self.name, tuple(dc.name for dc in order), excluded, costs)

    def _cost(self, request: DcRequest, dc: DataCenterState, fleet: FleetState) -> dict[str, float]:
        p = self.params
        local = dc.region == request.source_region
        parts = {
            "rtt_s": fleet.rtt_s(request.source_region, dc.region),
            "transfer_s": 0.0
            if local
            else request.input_tokens * BYTES_PER_TOKEN / p.transfer_bytes_per_s,
            "wait_s": dc.predicted_wait_s,
            "warm_s": -p.warm_bonus_s if dc.warm else 0.0,
            "weight_s": -p.weight_bias_s * (dc.weight or 0.0),
        }
        cap = p.busy_utilisation if local else p.busy_utilisation * (1 - p.reserved_share)
        return {**parts, "cost": sum(parts.values()), "full": float(dc.utilisation >= cap)}

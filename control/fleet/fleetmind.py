"""FleetMind's per-request DC choice: the hard filters, then the cheapest DC with room.

A DC's cost is what the request would pay in seconds before its first token: the round
trip from the client's region, the prompt's transfer there, the wait behind the DC's
backlog, less the prefill a warm prefix saves. DCs past their load cap come after every
DC with room (they are the fallback, not the choice), and a DC keeps a share of its
capacity for its own region's clients: to others it is full sooner. A DC whose admission
holds the request's class back (its concurrency limit for the class reached) is full for
it too. The controller's weight is the share of the DC's stated capacity to count on:
its utilisation and backlog are divided by it (a weight of 0 leaves the DC last, as full).
"""

from __future__ import annotations

import math
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
    prefill_s_per_token: Annotated[float, Field(ge=0)] = 0.0
    """What a warm prompt token is worth: 0, measured. Its prefill costs 1.98e-5 s in the
    step model fitted to Llama-2-70B on four H100s (``sim/profiles.py``), but pricing it
    at 2e-5 cost 0.6 % of goodput in ``tokenfleet bench fleet`` (7,212 against 7,253
    tokens/s, mean of seeds 0 to 2, lower on each): the long documents that share a
    prefix crowd into one DC. Set it where sessions' shared prompts dominate."""


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
                costs[dc.name]["rtt_s"],  # where every cost is endless (weights of 0)
                dc.name != request.source_dc,
            ),
        )
        return DcDecision(self.name, tuple(dc.name for dc in order), excluded, costs)

    def _cost(self, request: DcRequest, dc: DataCenterState, fleet: FleetState) -> dict[str, float]:
        p = self.params
        local = dc.region == request.source_region
        share = 1.0 if dc.weight is None else dc.weight
        parts = {
            "rtt_s": fleet.rtt_s(request.source_region, dc.region),
            "transfer_s": 0.0
            if local
            else request.input_tokens * BYTES_PER_TOKEN / p.transfer_bytes_per_s,
            "wait_s": _per_share(dc.predicted_wait_s, share),
            "warm_s": -p.prefill_s_per_token * dc.warm_tokens,
        }
        cap = p.busy_utilisation if local else p.busy_utilisation * (1 - p.reserved_share)
        no_room = dc.class_room is not None and dc.class_room <= 0
        full = no_room or _per_share(dc.utilisation, share) >= cap
        return {**parts, "cost": sum(parts.values()), "full": float(full), "weight": share}


def _per_share(load: float, share: float) -> float:
    """``load`` against the share of capacity counted on (none: as full as can be)."""
    if share > 0:
        return load / share
    return math.inf

"""The DC choices operators deploy today, as their projects define them. Each applies the
hard filters first (``view.admissible``), as an operator would configure it with only
the places a request may go."""

from __future__ import annotations

from dataclasses import dataclass

from control.fleet.view import DcDecision, DcRequest, FleetState, admissible


@dataclass(frozen=True)
class LocalOnly:
    """Every request runs in its entry region's home DC: the DC in that region, or for a
    region without GPUs, the nearest by round trip. No fallback: a home DC that cannot
    run the request leaves it unserved."""

    name: str = "local_only"

    def choose(self, request: DcRequest, fleet: FleetState) -> DcDecision:
        allowed, excluded = admissible(request, fleet)
        home = min(
            fleet.dcs, key=lambda dc: fleet.rtt_s(request.source_region, dc.region), default=None
        )
        order = (home.name,) if home is not None and home in allowed else ()
        return DcDecision(self.name, order, excluded)

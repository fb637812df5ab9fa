"""Load-only baselines: they ignore prefix caches entirely."""

from __future__ import annotations

import numpy as np

from control.routing.snapshot import Decision, FleetSnapshot, RouteRequest


def _no_eligible(policy: str, fleet: FleetSnapshot) -> Decision:
    return Decision(policy, None, np.full(len(fleet), np.nan))


class RoundRobin:
    """Ready instances in turn."""

    name = "round_robin"

    def __init__(self, rng: np.random.Generator) -> None:
        self._next = 0

    def route(self, request: RouteRequest, fleet: FleetSnapshot, now: float) -> Decision:
        ready = np.flatnonzero(fleet.ready)
        if ready.size == 0:
            return _no_eligible(self.name, fleet)
        chosen = int(ready[self._next % ready.size])
        self._next += 1
        scores = np.where(fleet.ready, 1.0, np.nan)
        scores[chosen] = 0.0
        return Decision(self.name, chosen, scores)


class LeastRequests:
    """The ready instance with the fewest waiting plus running requests; ties at random."""

    name = "least_requests"

    def __init__(self, rng: np.random.Generator) -> None:
        self._rng = rng

    def route(self, request: RouteRequest, fleet: FleetSnapshot, now: float) -> Decision:
        scores = np.where(fleet.ready, fleet.requests.astype(np.float64), np.nan)
        if np.isnan(scores).all():
            return _no_eligible(self.name, fleet)
        best = np.flatnonzero(scores == np.nanmin(scores))
        chosen = int(best[self._rng.integers(best.size)])
        return Decision(self.name, chosen, scores, {"requests": scores})


class PowerOfTwo:
    """Two ready instances drawn at random; the one with fewer requests (waiting plus
    running) wins, the first drawn on a tie (Mitzenmacher, "The Power of Two Choices in
    Randomized Load Balancing", IEEE TPDS 2001)."""

    name = "power_of_two"

    def __init__(self, rng: np.random.Generator) -> None:
        self._rng = rng

    def route(self, request: RouteRequest, fleet: FleetSnapshot, now: float) -> Decision:
        ready = np.flatnonzero(fleet.ready)
        if ready.size == 0:
            return _no_eligible(self.name, fleet)
        drawn = self._rng.choice(ready, size=min(2, ready.size), replace=False)
        requests = fleet.requests
        chosen = int(min(drawn, key=lambda i: requests[i]))
        scores = np.full(len(fleet), np.nan)
        scores[drawn] = requests[drawn]
        return Decision(self.name, chosen, scores, {"requests": scores})

"""Load-only baselines: they ignore prefix caches entirely, and count their own requests
in flight as the balancers they stand for do (``control.routing.inflight``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

import numpy as np
from pydantic import Field

from control.routing.inflight import InFlight
from control.routing.snapshot import Decision, FleetSnapshot, RouteRequest


def _no_eligible(policy: str, fleet: FleetSnapshot) -> Decision:
    return Decision(policy, None, np.full(len(fleet), np.nan))


class CountsOwnRequests:
    """The requests this router sent to each instance and that have not ended, updated at
    dispatch and at the end (``registry.FollowsRequests``)."""

    def __init__(self) -> None:
        self.inflight = InFlight()

    def first_token(self, request_id: str) -> None:
        """The count holds until the end: a first token changes nothing."""

    def ended(self, request_id: str) -> None:
        self.inflight.ended(request_id)

    def own_load(self, fleet: FleetSnapshot) -> np.ndarray:
        """Each ready instance's count as floats, NaN where not ready."""
        return np.where(fleet.ready, self.inflight.counts(len(fleet)).astype(np.float64), np.nan)


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


class LeastRequests(CountsOwnRequests):
    """The ready instance with the fewest of this router's requests in flight; ties at
    random. A full scan, where Envoy's ``LEAST_REQUEST`` samples two (``power_of_two``)."""

    name = "least_requests"

    def __init__(self, rng: np.random.Generator) -> None:
        super().__init__()
        self._rng = rng

    def route(self, request: RouteRequest, fleet: FleetSnapshot, now: float) -> Decision:
        scores = self.own_load(fleet)
        if np.isnan(scores).all():
            return _no_eligible(self.name, fleet)
        best = np.flatnonzero(scores == np.nanmin(scores))
        chosen = int(best[self._rng.integers(best.size)])
        self.inflight.dispatched(request.request_id, chosen)
        return Decision(self.name, chosen, scores, {"requests": scores})


@dataclass(frozen=True)
class PowerOfTwoParams:
    choice_count: Annotated[int, Field(ge=2)] = 2
    """Hosts drawn per decision: Envoy's default (``choice_count``, at least 2)."""


class PowerOfTwo(CountsOwnRequests):
    """Envoy's ``LEAST_REQUEST`` load balancer with equal weights
    (``source/extensions/load_balancing_policies/least_request/least_request_lb.cc`` at
    envoyproxy/envoy 3b0bcb12): ``choice_count`` (default 2) hosts drawn at random *with*
    replacement, the one with fewer of this proxy's active requests (``rq_active_``) wins,
    the first drawn on a tie (Mitzenmacher, "The Power of Two Choices in Randomized Load
    Balancing", IEEE TPDS 2001)."""

    name = "power_of_two"

    def __init__(self, rng: np.random.Generator, params: PowerOfTwoParams | None = None) -> None:
        super().__init__()
        self._rng = rng
        self.params = params or PowerOfTwoParams()

    def route(self, request: RouteRequest, fleet: FleetSnapshot, now: float) -> Decision:
        ready = np.flatnonzero(fleet.ready)
        if ready.size == 0:
            return _no_eligible(self.name, fleet)
        drawn = self._rng.choice(ready, size=self.params.choice_count, replace=True)
        counts = self.inflight.counts(len(fleet))
        chosen = int(drawn[0])
        for candidate in drawn[1:]:
            if counts[candidate] < counts[chosen]:
                chosen = int(candidate)
        scores = np.full(len(fleet), np.nan)
        scores[drawn] = counts[drawn]
        self.inflight.dispatched(request.request_id, chosen)
        return Decision(self.name, chosen, scores, {"requests": scores})

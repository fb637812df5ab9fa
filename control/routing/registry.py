"""Every routing policy by the name ``--policy`` takes: the one list."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, runtime_checkable

import numpy as np

from control.routing.baselines import LeastRequests, PowerOfTwo, RoundRobin
from control.routing.cache_aware import AibrixPrefixCache, DynamoKv, SglangCacheAware
from control.routing.llmd import LlmdDefault
from control.routing.predicted_latency import LlmdPredictedLatency
from control.routing.snapshot import Decision, FleetSnapshot, Observation, RouteRequest


class Router(Protocol):
    """Picks an instance for a request from a snapshot of the fleet.

    ``route`` is synchronous and does no I/O; time and randomness come from the host
    (``now``, and the generator the router was built with), so a simulator replays it.
    """

    name: str

    def route(self, request: RouteRequest, fleet: FleetSnapshot, now: float) -> Decision: ...


@runtime_checkable
class Learner(Protocol):
    """A router that also learns from outcomes; the host calls ``observe`` for each."""

    def observe(self, observation: Observation) -> None: ...


ROUTERS: dict[str, Callable[[np.random.Generator], Router]] = {
    RoundRobin.name: RoundRobin,
    LeastRequests.name: LeastRequests,
    PowerOfTwo.name: PowerOfTwo,
    LlmdDefault.name: LlmdDefault,
    LlmdPredictedLatency.name: LlmdPredictedLatency,
    DynamoKv.name: DynamoKv,
    SglangCacheAware.name: SglangCacheAware,
    AibrixPrefixCache.name: AibrixPrefixCache,
}


def make_router(name: str, seed: int = 0) -> Router:
    try:
        factory = ROUTERS[name]
    except KeyError:
        raise KeyError(f"unknown policy {name!r}; known: {', '.join(sorted(ROUTERS))}") from None
    return factory(np.random.default_rng(seed))

"""Every routing policy by the name ``--policy`` takes: the one list."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

import numpy as np

from control.routing.baselines import LeastRequests, PowerOfTwo, RoundRobin
from control.routing.cache_aware import AibrixPrefixCache, DynamoKv, SglangCacheAware
from control.routing.llmd import LlmdDefault
from control.routing.predicted_latency import LlmdPredictedLatency
from control.routing.snapshot import (
    Decision,
    FleetSnapshot,
    KvEvent,
    Observation,
    PoolModel,
    RouteRequest,
)
from control.routing.tokenpilot import TokenPilot, TokenPilotParams


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


@runtime_checkable
class Withdrawing(Protocol):
    """A router that counts what it routes, and can forget a decision the host dropped."""

    def withdraw(self, request_id: str) -> None: ...


@runtime_checkable
class FollowsRequests(Protocol):
    """A router that counts its own requests in flight (``control.routing.inflight``), as
    SGLang's, AIBrix's, Envoy's and Dynamo's do: the host says when each request it routed
    sent its first token, and when it ended (completed, cancelled, failed or refused)."""

    def first_token(self, request_id: str) -> None: ...

    def ended(self, request_id: str) -> None: ...


@runtime_checkable
class ReadsKvEvents(Protocol):
    """A router whose prefix index follows the engines' KV events (vLLM's BlockStored and
    BlockRemoved, from ``--kv-events-config``); the host passes each instance's events
    in the order the engine published them. ``instance`` is its row in the snapshot."""

    def kv_events(self, instance: int, events: Sequence[KvEvent]) -> None: ...


def implements(router: Router, protocol: type) -> bool:
    """``isinstance(router, protocol)`` for the protocols above, answered once
    per router type: an ``isinstance`` against a runtime-checkable Protocol walks the
    protocol's members on every call, which took about 4 % of the gateway's CPU."""
    return _type_implements(type(router), protocol)


@functools.cache
def _type_implements(kind: type, protocol: type) -> bool:
    return issubclass(kind, protocol)


Factory = Callable[[np.random.Generator, PoolModel | None, TokenPilotParams], Router]
"""A router from its random generator, the pool's model and the parameters a deployment
sets (only TokenPilot has any)."""


def _load_only(kind: Callable[[np.random.Generator], Router]) -> Factory:
    return lambda rng, _pool, _params: kind(rng)


def _tokenpilot(
    _rng: np.random.Generator, pool: PoolModel | None, params: TokenPilotParams
) -> Router:
    if pool is None:
        raise ValueError("tokenpilot needs the pool's step model (a PoolModel)")
    return TokenPilot(pool, params)


ROUTERS: dict[str, Factory] = {
    "tokenpilot": _tokenpilot,
    RoundRobin.name: _load_only(RoundRobin),
    LeastRequests.name: _load_only(LeastRequests),
    PowerOfTwo.name: _load_only(PowerOfTwo),
    LlmdDefault.name: _load_only(LlmdDefault),
    LlmdPredictedLatency.name: _load_only(LlmdPredictedLatency),
    DynamoKv.name: _load_only(DynamoKv),
    SglangCacheAware.name: _load_only(SglangCacheAware),
    AibrixPrefixCache.name: _load_only(AibrixPrefixCache),
}


def make_router(
    name: str,
    seed: int = 0,
    pool: PoolModel | None = None,
    params: TokenPilotParams | None = None,
) -> Router:
    """The router ``name``, seeded; ``pool`` describes the model pool to those that use it,
    ``params`` sets TokenPilot's (None: its defaults)."""
    try:
        factory = ROUTERS[name]
    except KeyError:
        raise KeyError(f"unknown policy {name!r}; known: {', '.join(sorted(ROUTERS))}") from None
    return factory(np.random.default_rng(seed), pool, params or TokenPilotParams())

"""Every routing policy by the name ``--policy`` takes: the one list."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any, Protocol, get_type_hints, runtime_checkable

import numpy as np
from pydantic import TypeAdapter, ValidationError

from control.routing.baselines import LeastRequests, PowerOfTwo, PowerOfTwoParams, RoundRobin
from control.routing.cache_aware import (
    AibrixParams,
    AibrixPrefixCache,
    DynamoKv,
    DynamoParams,
    SglangCacheAware,
    SglangParams,
)
from control.routing.llmd import LlmdDefault, LlmdWeights
from control.routing.predicted_latency import LlmdPredictedLatency, PredictedLatencyParams
from control.routing.snapshot import (
    Decision,
    FleetSnapshot,
    KvEvent,
    Observation,
    PoolModel,
    RouteRequest,
    TtftPrediction,
)
from control.routing.tokenpilot import TokenPilot, TokenPilotParams
from schemas.envelope import describe


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
class PredictsTtft(Protocol):
    """A router with a latency model that admission may ask, without routing: the TTFT a
    client would see for ``request`` on each instance (the API's overhead included)."""

    def predict_ttft(
        self, request: RouteRequest, fleet: FleetSnapshot, now: float
    ) -> TtftPrediction: ...


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


@dataclass(frozen=True)
class NoParams:
    """A policy with nothing to set."""


@dataclass(frozen=True)
class Policy:
    """A routing policy by name: how it is built, and the parameters it takes, whose
    defaults are the ones its code ships (each params class says where they come from)."""

    build: Callable[[np.random.Generator, PoolModel | None, Any], Router]
    """A router from its random generator, the pool's model and its parameters."""
    params: type[Any]


def _tokenpilot(_rng: np.random.Generator, pool: PoolModel | None, params: Any) -> Router:
    if pool is None:
        raise ValueError("TokenPilot prices queues on the pool's step model")
    return TokenPilot(pool, params)


ROUTERS: dict[str, Policy] = {
    "tokenpilot": Policy(_tokenpilot, TokenPilotParams),
    RoundRobin.name: Policy(lambda rng, _pool, _params: RoundRobin(rng), NoParams),
    LeastRequests.name: Policy(lambda rng, _pool, _params: LeastRequests(rng), NoParams),
    PowerOfTwo.name: Policy(lambda rng, _pool, p: PowerOfTwo(rng, p), PowerOfTwoParams),
    LlmdDefault.name: Policy(lambda rng, _pool, p: LlmdDefault(rng, p), LlmdWeights),
    LlmdPredictedLatency.name: Policy(
        lambda rng, _pool, p: LlmdPredictedLatency(rng, p), PredictedLatencyParams
    ),
    DynamoKv.name: Policy(lambda rng, _pool, p: DynamoKv(rng, p), DynamoParams),
    SglangCacheAware.name: Policy(lambda rng, _pool, p: SglangCacheAware(rng, p), SglangParams),
    AibrixPrefixCache.name: Policy(lambda rng, _pool, p: AibrixPrefixCache(rng, p), AibrixParams),
}
"""Every routing policy, one line each."""


def policy(name: str) -> Policy:
    """The policy ``name``, or KeyError naming the known ones."""
    try:
        return ROUTERS[name]
    except KeyError:
        raise KeyError(f"unknown policy {name!r}; known: {', '.join(sorted(ROUTERS))}") from None


def policy_params(name: str, values: Mapping[str, Any]) -> Any:
    """The parameters of policy ``name`` from ``values`` (a fleet file's routing profile),
    the others at their defaults; ValueError naming an unknown or invalid one (strictly
    typed: a fleet file's ``true`` is no count, nor ``"2"`` a number)."""
    kind = policy(name).params
    known = {f.name for f in fields(kind)}
    unknown = sorted(set(values) - known)
    if unknown:
        takes = ", ".join(sorted(known)) or "none"
        raise ValueError(f"policy {name!r} takes no {', '.join(unknown)} (it takes: {takes})")
    hints = get_type_hints(kind, include_extras=True)
    checked = {}
    for field_name, value in values.items():
        try:
            checked[field_name] = TypeAdapter(hints[field_name]).validate_python(value, strict=True)
        except ValidationError as exc:
            raise ValueError(f"policy {name!r}: {describe(exc, field_name)}") from None
    return kind(**checked)


def make_router(
    name: str,
    seed: int = 0,
    pool: PoolModel | None = None,
    params: Any = None,
) -> Router:
    """The router ``name``, seeded; ``pool`` describes the model pool to those that use it,
    ``params`` are its parameters (None: the defaults its code ships)."""
    chosen = policy(name)
    if params is None:
        params = chosen.params()
    elif not isinstance(params, chosen.params):
        raise TypeError(f"policy {name!r} takes {chosen.params.__name__}, not {params!r}")
    return chosen.build(np.random.default_rng(seed), pool, params)

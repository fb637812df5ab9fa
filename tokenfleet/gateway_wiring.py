"""Builds a gateway from a fleet file and the environment.

Embedded default (no ``TOKENFLEET_KAFKA_BOOTSTRAP``): an in-process bus, with the
telemetry collector and the table processors running in the gateway's process. With a
broker: Kafka, and both run apart (``tokenfleet collect``, ``tokenfleet worker``). With
``TOKENFLEET_REDIS_URL``: shared state in Redis, falling back to local state while Redis
is away; without: local state.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import socket
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from dataclasses import asdict, replace
from typing import Any

import aiohttp
import uvicorn
from fastapi import FastAPI

from control.admission.registry import CONTROLLED, Admission, make_admission
from control.pipeline import check_pairing
from control.routing import PoolModel, make_router, policy_params
from control.routing.registry import Router
from control.routing.tokenpilot import TokenPilotParams
from gateway.app import GatewayParts, create_app
from gateway.decide import CONTROLS
from gateway.fallback_state import FallbackState
from gateway.redis_state import RedisState
from gateway.settings import GatewaySettings
from gateway.state import Accounting, LocalState, SharedState
from schemas.fleet import FleetConfig
from sim.profiles import PROFILES, check_fleet_profiles, profile
from streams.bus import EventBus
from streams.collector import Collector
from streams.kafka import KafkaBus
from streams.memory import InMemoryBus
from streams.settings import WorkerSettings
from streams.table_host import TableHost
from streams.tables.builder import TableBuilder
from tokenfleet.controller_host import QuotaHost, WeightHost
from tokenfleet.settings import Settings

log = logging.getLogger(__name__)


def router_factory(
    fleet: FleetConfig, policy: str, seed: int = 0, params: Any = None
) -> Callable[[str], Router]:
    """Routers for the fleet's models; a model's ``profile`` gives TokenPilot its step model.
    ValueError at once for an unknown profile; ValueError (or KeyError for an unknown
    policy) when a router is made, which ``gateway_parts`` does at start."""
    check_fleet_profiles(fleet)

    def make(model_name: str) -> Router:
        model = fleet.model(model_name)
        assert model is not None
        with _profile_named_where_missing(model.name, model.profile, "--policy least_requests"):
            return make_router(policy, seed, pool_model(model.profile, model.max_num_seqs), params)

    return make


@contextlib.contextmanager
def _profile_named_where_missing(
    model: str, profile_name: str | None, without: str
) -> Iterator[None]:
    """A policy that cannot be built for a model without ``profile`` says what to do: give
    one, or run the gateway ``without`` it (a policy that needs none)."""
    try:
        yield
    except ValueError as exc:
        if profile_name is not None:
            raise
        known = ", ".join(sorted(PROFILES))
        raise ValueError(
            f"model {model!r} has no `profile` in the fleet file, and {exc}: give it the "
            f"calibrated profile closest to its size and GPUs ({known}), or run the gateway "
            f"with {without}, which needs none"
        ) from None


def pool_model(profile_name: str | None, max_num_seqs: int | None) -> PoolModel | None:
    """What a model's router and admission may know of its pool: the profile's step model
    and the fleet file's ``max_num_seqs`` (the profile's own engine limit is the
    simulator's, not the fleet's); None without a profile."""
    if profile_name is None:
        return None
    return replace(profile(profile_name).pool_model(), max_num_seqs=max_num_seqs)


def admission_factory(fleet: FleetConfig, name: str) -> Callable[[str], Admission]:
    """Admission policies for the fleet's models, built with the model's pool (its step
    model and engine limits) for those that use it; KeyError (unknown) or ValueError when
    one is made, which ``gateway_parts`` does at start."""

    def make(model_name: str) -> Admission:
        model = fleet.model(model_name)
        assert model is not None
        with _profile_named_where_missing(model.name, model.profile, "--admission slomax"):
            pool = pool_model(model.profile, model.max_num_seqs)
            return make_admission(name, pool, ablations=False)

    return make


def routing_params(fleet: FleetConfig, settings: GatewaySettings) -> tuple[str, Any]:
    """The policy the gateway runs (its setting, else the fleet file's profile) and its
    parameters: the profile's where the policy is the profile's, else the defaults; the
    ``token_lag_s`` setting, where set, is TokenPilot's."""
    profile_ = fleet.routing
    params = policy_params(profile_.policy, profile_.params)  # checked even if overridden
    policy = settings.policy or profile_.policy
    if policy != profile_.policy:
        params = policy_params(policy, {})
    if isinstance(params, TokenPilotParams) and settings.token_lag_s is not None:
        params = replace(params, token_lag_s=settings.token_lag_s)
    return policy, params


def gateway_parts(
    fleet: FleetConfig,
    settings: GatewaySettings,
    bus: EventBus,
    state: SharedState,
    controls: frozenset[str] = CONTROLS,
) -> GatewayParts:
    # Each replica its own seed: with one seed, replicas break ties alike and pile onto
    # the same instance.
    seed = secrets.randbits(32)
    policy, params = routing_params(fleet, settings)
    routers = router_factory(fleet, policy, seed, params)
    admissions = admission_factory(fleet, settings.admission)
    # Both built once at start for every model, the router first: an unknown policy, a
    # bad parameter, a model without the profile its policy needs or a pairing that
    # cannot work fails now, not at the first request.
    for model in fleet.models:
        router = routers(model.name)
        check_pairing(admissions(model.name), router)

    def recipe(model: str) -> dict[str, Any]:
        """How ``routers`` and ``admissions`` build ``model``'s pool, for an auditor."""
        config = fleet.model(model)
        assert config is not None
        routing = {"policy": policy, "params": asdict(params), "seed": seed}
        pool = {"profile": config.profile, "max_num_seqs": config.max_num_seqs}
        return routing | {"admission": settings.admission} | pool

    return GatewayParts(fleet, settings, state, bus, routers, admissions, recipe, controls)


def published_controls(
    fleet: FleetConfig, settings: GatewaySettings, embedded: bool
) -> frozenset[str]:
    """The controls a controller publishes to this gateway. Beside Kafka, the deployed
    controller's: quotas, and weights where it reads the fleet file. Embedded, the gateway
    runs the quota controller for an admission policy it steers, and the weights
    controller for a fleet of several DCs, where there is a DC to choose."""
    if not embedded:
        return CONTROLS
    steered = {"quotas"} if settings.admission in CONTROLLED else set()
    return frozenset(steered | ({"weights"} if len(fleet.dcs) > 1 else set()))


def shared_state(fleet: FleetConfig, services: Settings, settings: GatewaySettings) -> SharedState:
    if services.redis_url is None:
        return LocalState()
    own = Accounting()  # one record of this replica's requests, whichever state serves
    pools = {i.id: f"{i.model}@{i.dc}" for i in fleet.instances}
    redis = RedisState(
        services.redis_url,
        settings.redis_prefix,
        replica=f"{settings.name}-{secrets.token_hex(4)}",
        share_ttl_s=settings.share_ttl_s,
        own=own,
        shard_of=lambda instance_id: pools.get(instance_id, "unknown"),
        cluster=services.redis_cluster,
    )
    return FallbackState(redis, LocalState(own))


@contextlib.asynccontextmanager
async def running_gateway(
    fleet: FleetConfig,
    settings: GatewaySettings,
    services: Settings,
    host: str,
    port: int,
) -> AsyncIterator[FastAPI]:
    """Serve a gateway on ``host:port`` (0: any free port; ``app.state.address`` says
    which) until the context exits (``OSError`` when the port is taken; ``ValueError``
    for settings that cannot work together, a tenant's key variable unset, or a Redis
    that refuses the gateway's password or database)."""
    fleet = fleet.with_tenant_keys(os.environ)
    if settings.journal and not services.kafka_bootstrap:
        # On the in-process bus nobody could read it, and it would be kept until exit.
        to_file = (
            "TOKENFLEET_GATEWAY_JOURNAL_FILE already writes it to a file: drop --journal "
            "(TOKENFLEET_GATEWAY_JOURNAL)"
            if settings.journal_file
            else "without Kafka, write it to a file (TOKENFLEET_GATEWAY_JOURNAL_FILE) instead"
        )
        raise ValueError(
            "--journal (TOKENFLEET_GATEWAY_JOURNAL) publishes the journal on Kafka, and "
            f"TOKENFLEET_KAFKA_BOOTSTRAP is unset; {to_file}"
        )
    bus: EventBus = (
        KafkaBus(services.kafka_bootstrap, source=settings.name)
        if services.kafka_bootstrap
        else InMemoryBus(source=settings.name)
    )
    state = shared_state(fleet, services, settings)
    controls = published_controls(fleet, settings, embedded=services.kafka_bootstrap is None)
    try:
        if isinstance(state, FallbackState):
            await state.check()
        app = create_app(gateway_parts(fleet, settings, bus, state, controls))
        # Bound here, so that a port taken raises OSError, where uvicorn would log it and
        # exit the process.
        with socket.create_server((host, port)) as listening:
            address = f"{host}:{listening.getsockname()[1]}"  # port 0: the one it got
            app.state.address = address
            async with _serving(
                app, listening, fleet, bus, services, address, controls, settings.drain_s
            ):
                yield app
    finally:
        await state.close()
        await bus.close()


def _embedded(part: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
    """A part of the embedded mode, run beside the server; one that stops on an error
    says so in the log (the server goes on without it: its tables, or its controls, go
    stale, and the gateways fall back as they would without the part)."""

    def said(task: asyncio.Task[None]) -> None:
        if not task.cancelled() and (error := task.exception()) is not None:
            log.error("the embedded %s stopped", name, exc_info=error)

    task = asyncio.create_task(part)
    task.add_done_callback(said)
    return task


@contextlib.asynccontextmanager
async def _serving(
    app: FastAPI,
    listening: socket.socket,
    fleet: FleetConfig,
    bus: EventBus,
    services: Settings,
    address: str,
    controls: frozenset[str],
    drain_s: int,
) -> AsyncIterator[None]:
    """uvicorn on the bound socket, and in embedded mode the collector, the tables and the
    controllers of ``controls`` (``published_controls``). At the end, requests in progress get
    ``drain_s`` to finish; then uvicorn cancels them, and each closes its books."""
    config = uvicorn.Config(
        app, log_level="warning", access_log=False, timeout_graceful_shutdown=drain_s
    )
    server = uvicorn.Server(config)
    tasks = [asyncio.create_task(server.serve([listening]))]
    async with aiohttp.ClientSession() as scraper:
        if services.kafka_bootstrap is None:  # embedded: the collector and tables run here
            tables = WorkerSettings()
            table_host = TableHost(
                bus, TableBuilder(tables.spec, fleet.all_objectives(), time.time), tables.publish_s
            )
            # Its metrics on the gateway's /metrics: nothing else serves them here.
            registry = app.state.gateway.metrics.registry
            collector = Collector(fleet.instances, bus, scraper, registry=registry)
            tasks.append(_embedded(collector.run(), "collector"))
            tasks.append(_embedded(table_host.run(), "tables"))
            if "quotas" in controls:
                tasks.append(_embedded(QuotaHost(bus).run(), "quota controller"))
            if "weights" in controls:
                models, edges = [m.name for m in fleet.models], fleet.edge_regions()
                tasks.append(_embedded(WeightHost(bus, models, edges).run(), "weights controller"))
        try:
            while not server.started:
                if tasks[0].done():
                    await tasks[0]  # surfaces the start-up error
                    raise OSError(f"the gateway did not start on {address}")
                await asyncio.sleep(0.01)
            yield
        finally:
            # first, so that no held request keeps the server waiting for its connection
            app.state.gateway.decider.admission.close()
            server.should_exit = True
            for task in tasks[1:]:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

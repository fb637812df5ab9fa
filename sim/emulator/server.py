"""Many emulated instances in one process, each on its own loopback port."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, replace

import uvicorn
from fastapi import FastAPI
from starlette.types import ASGIApp, Receive, Scope, Send

from control.admission.registry import EngineScheduling
from control.fleet.view import FleetState
from schemas.fleet import FleetConfig, InstanceConfig
from sim.cluster import InstanceProfile
from sim.emulator.app import create_app
from sim.emulator.driver import EngineDriver
from sim.emulator.kv_feed import KvEventFeed
from sim.emulator.metrics import EngineMetrics
from sim.engine import Engine
from sim.profiles import DEFAULT_PROFILE, profile

DRAIN_S = 30
"""How long a stopping instance lets the requests it runs finish before cutting them."""


class SignalFreeServer(uvicorn.Server):
    """uvicorn without its signal handling, which each server installs and restores on
    exit: servers that start and stop out of order (replicas placed and taken back) left
    a stopped one's handler in place, and the process deaf to SIGTERM and Ctrl-C. The
    process handles its signals itself."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


@dataclass
class EmulatedInstance:
    url: str
    driver: EngineDriver
    kv_feed: KvEventFeed | None
    app: FastAPI


def build_instance(
    profile: InstanceProfile,
    model: str,
    port: int,
    speedup: float,
    kv_events: bool = False,
    reasoning: bool = False,
) -> EmulatedInstance:
    """``kv_events``: keep the engine's KV events and serve them at ``/kv-events``; off by
    default, as vLLM publishes none without ``--kv-events-config``. ``reasoning``: answer
    as a reasoning model (``sim.emulator.answers``)."""
    engine = Engine(profile.engine, profile.step_time, kv_events=kv_events)
    metrics = EngineMetrics(engine, model)
    feed = KvEventFeed(engine.pool) if kv_events else None
    on_step = feed.collect if feed is not None else None
    driver = EngineDriver(engine, speedup, on_finish=metrics.observe, on_step=on_step)
    app = create_app(driver, model, metrics, feed, reasoning)
    return EmulatedInstance(f"http://127.0.0.1:{port}", driver, feed, app)


@contextlib.asynccontextmanager
async def serve(
    profile: InstanceProfile,
    model: str,
    ports: Sequence[int],
    speedup: float = 1.0,
    kv_events: bool = False,
    reasoning: bool = False,
    network_s: float = 0.0,
) -> AsyncIterator[list[EmulatedInstance]]:
    """Start one instance per port on 127.0.0.1 (port 0: any free one); stop them all on
    exit. A port taken raises ``OSError`` before any starts. ``network_s``: a round trip
    added before each request is handled, as a client in another region would see, in
    the model's seconds as the steps and the API overhead are (``speedup`` times shorter
    in wall time): a replay, which reads wall time times ``speedup``, then sees the round
    trip the simulator adds."""
    with contextlib.ExitStack() as bound:
        sockets = [bound.enter_context(socket.create_server(("127.0.0.1", port))) for port in ports]
        bound.pop_all()  # every port is ours: the servers own the sockets from here
    ports = [sock.getsockname()[1] for sock in sockets]
    instances = [
        build_instance(profile, model, port, speedup, kv_events, reasoning) for port in ports
    ]
    servers = [
        SignalFreeServer(
            uvicorn.Config(
                _behind(i.app, network_s / speedup),
                host="127.0.0.1",
                port=port,
                log_level="warning",
                lifespan="off",
                timeout_graceful_shutdown=DRAIN_S,
            )
        )
        for i, port in zip(instances, ports, strict=True)
    ]
    tasks = [asyncio.create_task(s.serve([sock])) for s, sock in zip(servers, sockets, strict=True)]
    tasks += [asyncio.create_task(i.driver.run()) for i in instances]
    try:
        while not all(s.started for s in servers):
            if any(t.done() for t in tasks):
                await asyncio.gather(*tasks)  # surfaces the start-up error
            await asyncio.sleep(0.01)
        yield instances
    finally:  # stop listening, let what runs finish, then stop the engines
        for server in servers:
            server.should_exit = True
        try:
            await asyncio.gather(*tasks[: len(servers)], return_exceptions=True)
        finally:
            for task in tasks[len(servers) :]:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


def _behind(app: ASGIApp, network_s: float) -> ASGIApp:
    """``app`` as seen across a network whose round trip is ``network_s``."""
    if network_s <= 0:
        return app

    async def delayed(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            await asyncio.sleep(network_s)
        await app(scope, receive, send)

    return delayed


@dataclass(frozen=True)
class FleetOptions:
    """How ``tokenfleet emulate --fleet`` runs every instance it starts: ``profile``, for
    the models the fleet file gives none; ``reasoning`` and ``scheduling_policy`` as
    ``serve`` and ``EngineConfig`` take them."""

    speedup: float = 1.0
    kv_events: bool = False
    reasoning: bool = False
    scheduling_policy: EngineScheduling = "fcfs"
    profile: str = DEFAULT_PROFILE


@contextlib.asynccontextmanager
async def serve_fleet(
    fleet: FleetConfig,
    region: str,
    options: FleetOptions = FleetOptions(),
    dc: str | None = None,
) -> AsyncIterator[list[EmulatedInstance]]:
    """Every instance of ``fleet`` on this machine's loopback (its URL's port) but those
    on standby (``sim.emulator.standby`` starts them when a placement asks), each as
    ``serve_instance`` serves it; ``dc``: that DC's alone (one process per DC, so that a
    DC can be stopped on its own)."""
    local = fleet.local_instances(dc)
    if not local:
        where = "" if dc is None else f" of {dc}"
        raise ValueError(f"no instance{where} of the fleet file is on 127.0.0.1 or localhost")
    async with contextlib.AsyncExitStack() as stack:
        started = []
        for instance in (i for i in local if not i.standby):
            serving = serve_instance(fleet, instance, region, options)
            started += await stack.enter_async_context(serving)
        yield started


def serve_instance(
    fleet: FleetConfig,
    instance: InstanceConfig,
    region: str,
    options: FleetOptions = FleetOptions(),
) -> contextlib.AbstractAsyncContextManager[list[EmulatedInstance]]:
    """One instance of ``fleet`` on its URL's port, as ``fleet_profile`` sets its engine,
    behind the round trip between ``region`` and its DC's region (the fleet file's
    ``[[network]]``; pairs not named, ``DEFAULT_RTT_S``)."""
    regions = {dc.name: dc.region for dc in fleet.dcs}
    chosen = fleet_profile(fleet, instance.model, options)
    network = FleetState((), fleet.round_trips_s()).rtt_s(region, regions[instance.dc])
    port = instance.url.port or 80
    return serve(
        chosen,
        instance.model,
        [port],
        options.speedup,
        options.kv_events,
        options.reasoning,
        network_s=network,
    )


def fleet_profile(fleet: FleetConfig, model: str, options: FleetOptions) -> InstanceProfile:
    """The profile an instance of ``model`` runs: the model's (else ``options.profile``),
    its engine started as the fleet file says the real ones are (``context_tokens`` as
    ``--max-model-len``, ``max_num_seqs`` as ``--max-num-seqs`` where set), so that the
    gateway's admission reserves seats the engine really has."""
    config = fleet.model(model)
    chosen = profile((config.profile if config else None) or options.profile)
    engine = replace(chosen.engine, scheduling_policy=options.scheduling_policy)
    if config is not None:
        seats = config.max_num_seqs or engine.max_num_seqs
        engine = replace(engine, max_model_len=config.context_tokens, max_num_seqs=seats)
    return replace(chosen, engine=engine)

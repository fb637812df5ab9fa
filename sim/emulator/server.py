"""Many emulated instances in one process, each on its own loopback port."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

import uvicorn
from fastapi import FastAPI

from sim.cluster import InstanceProfile
from sim.emulator.app import create_app
from sim.emulator.driver import EngineDriver
from sim.emulator.kv_feed import KvEventFeed
from sim.emulator.metrics import EngineMetrics
from sim.engine import Engine


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
) -> AsyncIterator[list[EmulatedInstance]]:
    """Start one instance per port on 127.0.0.1 (port 0: any free one); stop them all on
    exit. A port taken raises ``OSError`` before any starts."""
    with contextlib.ExitStack() as bound:
        sockets = [bound.enter_context(socket.create_server(("127.0.0.1", port))) for port in ports]
        bound.pop_all()  # every port is ours: the servers own the sockets from here
    ports = [sock.getsockname()[1] for sock in sockets]
    instances = [
        build_instance(profile, model, port, speedup, kv_events, reasoning) for port in ports
    ]
    servers = [
        uvicorn.Server(
            uvicorn.Config(i.app, host="127.0.0.1", port=port, log_level="warning", lifespan="off")
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
    finally:
        for server in servers:
            server.should_exit = True
        for task in tasks[len(servers) :]:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

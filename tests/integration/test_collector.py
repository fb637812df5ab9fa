"""The telemetry collector against live endpoints: an emulated vLLM, a slow one, a dead one."""

from __future__ import annotations

import asyncio
import time

import aiohttp
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from schemas.fleet import InstanceConfig
from sim.emulator.server import serve
from sim.profiles import profile
from streams.collector import Collector
from streams.memory import InMemoryBus
from tests.gateway_harness import PROFILE, emulated, http_server
from tokenfleet.services.process import free_port


def _slow(delay_s: float) -> Starlette:
    async def metrics(_: Request) -> PlainTextResponse:
        await asyncio.sleep(delay_s)
        return PlainTextResponse("vllm:num_requests_running 1\n")

    return Starlette(routes=[Route("/metrics", metrics)])


def _instance(name: str, url: str) -> InstanceConfig:
    return InstanceConfig(id=name, dc="dc-a", url=url, model="m")


async def test_one_slow_instance_delays_no_other_and_the_dead_are_not_ready() -> None:
    async with emulated(1) as [alive], http_server(_slow(5.0)) as slow:
        instances = [
            _instance("alive", alive.url),
            _instance("slow", slow),
            _instance("dead", f"http://127.0.0.1:{free_port()}"),
        ]
        async with aiohttp.ClientSession() as client:
            collector = Collector(instances, InMemoryBus(), client, timeout_s=0.5)
            started = time.monotonic()
            readings = {t.instance_id: t for t in await collector.scrape_once()}
            took = time.monotonic() - started
    assert took < 2.0  # one timeout, not the slow instance's five seconds
    assert readings["alive"].ready
    assert readings["alive"].kv_blocks_total == alive.driver.engine.pool.num_blocks
    assert not readings["slow"].ready
    assert not readings["dead"].ready


async def test_an_instance_that_answers_again_is_published_ready_again() -> None:
    port = free_port()
    instance = _instance("flaky", f"http://127.0.0.1:{port}")
    async with aiohttp.ClientSession() as client:
        collector = Collector([instance], InMemoryBus(), client, timeout_s=0.5)
        [down] = await collector.scrape_once()
        async with serve(profile(PROFILE), "m", [port]):  # the same address answers again
            [up] = await collector.scrape_once()
    assert not down.ready
    assert up.ready

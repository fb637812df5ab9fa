"""The telemetry collector against live endpoints: an emulated vLLM, a slow one, a dead one."""

from __future__ import annotations

import asyncio
import os
import sys
import time
from pathlib import Path

import aiohttp
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from control.tokens import block_hashes
from schemas.fleet import InstanceConfig
from schemas.telemetry import KvAllCleared, KvBlocksStored
from sim.emulator.server import serve
from sim.profiles import profile
from streams.collector import Collector
from streams.memory import InMemoryBus
from tests.gateway_harness import MODEL, PROFILE, emulated, http_server
from tests.services import Service
from tokenfleet.services.process import answers_http, free_port

LOCAL_FLEET = Path(__file__).parents[2] / "examples" / "fleet-local.toml"


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


async def test_kv_events_are_read_once_and_a_restart_clears_the_instance() -> None:
    port = free_port()
    instance = _instance("emulated", f"http://127.0.0.1:{port}")
    prompt = "the same long system prompt " * 30
    async with aiohttp.ClientSession() as client:
        collector = Collector([instance], InMemoryBus(), client, timeout_s=2.0)
        async with serve(profile(PROFILE), MODEL, [port], speedup=10.0, kv_events=True):
            body = {"model": MODEL, "prompt": prompt, "max_tokens": 2}
            url = f"{str(instance.url).rstrip('/')}/v1/completions"
            async with client.post(url, json=body) as answer:
                assert answer.status == 200
            [stored] = await collector.kv_events_once()
            assert await collector.kv_events_once() == []  # nothing new
        async with serve(profile(PROFILE), MODEL, [port], 10.0, kv_events=True):  # restarted
            body = {"model": MODEL, "prompt": prompt.upper(), "max_tokens": 2}
            async with client.post(url, json=body) as answer:
                assert answer.status == 200
            [cleared, stored_since] = await collector.kv_events_once()
    assert isinstance(stored, KvBlocksStored)
    assert stored.instance_id == "emulated"
    assert stored.block_hashes == block_hashes(prompt)
    assert isinstance(cleared, KvAllCleared)
    assert cleared.reason == "instance restarted"
    assert isinstance(stored_since, KvBlocksStored)  # the new run's first events are not skipped
    assert stored_since.block_hashes == block_hashes(prompt.upper())


async def test_an_instance_without_a_kv_event_feed_is_asked_once() -> None:
    asked = 0

    async def missing(_: Request) -> PlainTextResponse:
        nonlocal asked
        asked += 1
        return PlainTextResponse("Not Found", status_code=404)

    app = Starlette(routes=[Route("/kv-events", missing)])
    async with http_server(app) as url, aiohttp.ClientSession() as client:
        collector = Collector([_instance("vllm", url)], InMemoryBus(), client, timeout_s=0.5)
        assert await collector.kv_events_once() == []
        assert await collector.kv_events_once() == []
    assert asked == 1


class _FailingOnce(InMemoryBus):
    """A bus whose first publication of KV events fails, as during an outage."""

    def __init__(self) -> None:
        super().__init__()
        self.failed = False

    async def publish_events(self, envelopes) -> None:
        carries_kv = any(isinstance(e.payload, KvBlocksStored) for e in envelopes)
        if carries_kv and not self.failed:
            self.failed = True
            raise ConnectionError("broker away")
        await super().publish_events(envelopes)


async def test_kv_events_lost_to_a_bus_outage_clear_their_instance() -> None:
    async with (
        serve(profile(PROFILE), MODEL, [free_port()], 10.0, kv_events=True) as [alive],
        aiohttp.ClientSession() as client,
    ):
        prompt = "a prompt that stores blocks " * 20
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 2}
        async with client.post(f"{alive.url}/v1/completions", json=body) as answer:
            assert answer.status == 200
        bus = _FailingOnce()
        collector = Collector([_instance("alive", alive.url)], bus, client, kv_interval_s=0.05)
        task = asyncio.create_task(collector.run())
        try:
            async with asyncio.timeout(5), bus.subscribe("tf.kv-events") as events:
                received = await anext(aiter(events))
        finally:
            task.cancel()
    assert bus.failed
    assert isinstance(received.envelope.payload, KvAllCleared)
    assert received.envelope.payload.reason == "KV events read but not published"


@pytest.mark.kafka
async def test_collect_serves_its_metrics_once_connected_and_another_on_its_port_exits(
    kafka: Service,
) -> None:
    """What ``tokenfleet up`` waits for: the collector's ``/metrics``, served once its bus
    is connected; a second collector told the same port exits 2, naming it. SIGTERM
    stops the first with exit 0 and no traceback (it now stops where it waits; the
    command line's handler raised wherever the signal landed, once in a weakref's
    callback, where it was ignored until ``down`` killed the collector 30 s later: a
    probe's log, a race this test does not reproduce)."""
    port = free_port()
    argv = ["-m", "tokenfleet.cli", "collect", "--fleet", str(LOCAL_FLEET)]
    argv += ["--metrics-port", str(port)]
    env = os.environ | {"TOKENFLEET_KAFKA_BOOTSTRAP": kafka.address}
    quiet = asyncio.subprocess.DEVNULL
    first = await asyncio.create_subprocess_exec(
        sys.executable, *argv, env=env, stdout=quiet, stderr=asyncio.subprocess.PIPE
    )
    url = f"http://127.0.0.1:{port}/metrics"
    try:
        for _ in range(300):  # its imports and the broker's connection: seconds here
            if first.returncode is not None or await asyncio.to_thread(answers_http, url):
                break
            await asyncio.sleep(0.2)
        async with aiohttp.ClientSession() as client, client.get(url) as answer:
            exposition = await answer.text()
        assert 'tokenfleet_collector_scrapes_total{instance_id="a-0"}' in exposition
        assert 'tokenfleet_collector_events_published_total{topic="tf.telemetry"}' in exposition
        second = await asyncio.create_subprocess_exec(
            sys.executable, *argv, env=env, stdout=quiet, stderr=asyncio.subprocess.PIPE
        )
        _, err = await asyncio.wait_for(second.communicate(), timeout=60)
        assert second.returncode == 2
        assert f"cannot serve /metrics on 127.0.0.1:{port}" in err.decode()
    finally:
        first.terminate()
        _, stopped = await asyncio.wait_for(first.communicate(), timeout=30)
    assert first.returncode == 0, stopped.decode()
    assert "Traceback" not in stopped.decode()

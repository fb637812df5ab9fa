"""FleetMind's weights loop closed end to end on real services: the gateway's lifecycle
events on Kafka, the Faust worker's goodput tables, the weights controller reading them
and publishing tf.control.weights, the gateway (its shared state in Redis) choosing DCs
by them.

The instances are scripted so that the loop, not this machine's speed, decides: dc-a's
answers all miss the chats' objective (2.5 s, against 2 s) while dc-b's are quick but
250 ms away. The fleet file states a capacity (100 requests a second an instance) under
which dc-a's backlog stays below that round trip, so only the weights move traffic off it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Iterator

import aiohttp
import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from control.controllers.fleetmind import WeightController, WeightParams, weights_of
from schemas.base import TaskClass
from schemas.control import RoutingWeights
from schemas.fleet import FleetConfig
from streams.collector import Collector
from streams.kafka import KafkaBus
from streams.tables.windows import WindowSpec
from tests.conftest import own_broker_for_module, read_for
from tests.gateway_harness import (
    KEY,
    MODEL,
    PROFILE,
    chat,
    chat_answer,
    gateway,
    http_server,
    until_ready,
    vllm_metrics,
)
from tests.integration.test_closed_loop import _running
from tests.integration.test_tables_on_kafka import worker
from tests.services import Service
from tokenfleet.controller_host import WEIGHTS_TOPIC, WeightHost

pytestmark = [pytest.mark.kafka, pytest.mark.redis]

SLOW_S, QUICK_S = 2.5, 0.05
EVERY_S, RUN_S = 0.2, 30.0
"""Five chats a second for 30 s, and one bound to eu-west every second."""


@pytest.fixture(scope="module")
def kafka(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    with own_broker_for_module(tmp_path_factory.mktemp("weights")) as service:
        yield service


def instance(served: list[tuple[str, float, bool]], dc: str, answer_s: float) -> Starlette:
    """Answers every chat after ``answer_s``; notes where and when, and whether the chat
    was bound to its region."""

    async def metrics(_: Request) -> Response:
        return vllm_metrics(waiting=0, running=0)

    async def answer(request: Request) -> Response:
        body = await request.json()
        served.append((dc, time.monotonic(), body["messages"][0]["content"] == "resident"))
        await asyncio.sleep(answer_s)
        return chat_answer()

    return Starlette(
        routes=[Route("/metrics", metrics), Route("/v1/chat/completions", answer, methods=["POST"])]
    )


def two_dcs(urls: dict[str, str]) -> FleetConfig:
    return FleetConfig.model_validate(
        {
            "dcs": [
                {"name": "dc-a", "region": "eu-west"},
                {"name": "dc-b", "region": "ap-south"},
            ],
            "network": [{"regions": ["eu-west", "ap-south"], "rtt_ms": 250}],
            "models": [{"name": MODEL, "profile": PROFILE, "rps_per_instance": 100}],
            "instances": [
                {"id": f"i-{dc}", "dc": dc, "url": url, "model": MODEL} for dc, url in urls.items()
            ],
            "tenants": [{"name": "anyone", "api_keys": [KEY]}],
        }
    )


async def test_a_dc_that_misses_loses_weight_and_its_traffic_moves_but_not_the_resident(
    kafka: Service, redis_server: Service
) -> None:
    served: list[tuple[str, float, bool]] = []
    async with contextlib.AsyncExitStack() as stack:
        urls = {
            dc: await stack.enter_async_context(http_server(instance(served, dc, seconds)))
            for dc, seconds in (("dc-a", SLOW_S), ("dc-b", QUICK_S))
        }
        fleet = two_dcs(urls)
        stack.enter_context(
            worker(kafka, f"weights-{uuid.uuid4().hex[:8]}", WindowSpec(10.0, 1.0, 2.0))
        )
        bus = KafkaBus(kafka.address, source="test")
        stack.push_async_callback(bus.close)
        # per region: dc-a's edge judges each DC on its own region's requests (all of them)
        controller = WeightController(WeightParams(settle_s=1.0, min_outcomes=5, per_region=True))
        host = WeightHost(bus, [MODEL], fleet.edge_regions(), controller, period_s=1.0)
        scraper = await stack.enter_async_context(aiohttp.ClientSession())
        front = await stack.enter_async_context(
            gateway(fleet, kafka=kafka.address, redis=redis_server.address, dc="dc-a")
        )
        async with _running(Collector(fleet.instances, bus, scraper).run(), host.run()):
            await until_ready(front)
            start, start_wall = time.monotonic(), time.time()
            await _traffic(front.url, start)
            pace = front.app.state.gateway.view.completed_per_s(MODEL, "dc-a")
        weights = [
            w for w in await read_for(bus, WEIGHTS_TOPIC, 3.0) if isinstance(w, RoutingWeights)
        ]
    chats = [(w.issued_at, weights_of(w, MODEL, TaskClass.INTERACTIVE)) for w in weights]
    lowered = [at for at, by_dc in chats if by_dc.get("dc-a", 1.0) < 1.0]
    abroad = [at - start for dc, at, _ in served if dc == "dc-b"]
    print(f"dc-a's weights for chats {[by_dc.get('dc-a') for _, by_dc in chats]}")
    first = min(abroad, default=-1.0)
    print(f"first chat in dc-b after {first:.1f} s; {len(abroad)} of {len(served)}")
    assert lowered, "the controller never lowered dc-a's weight"
    first_lowered_s = min(lowered) - start_wall
    assert first_lowered_s < 15.0  # its misses reached the tables and moved its weight
    assert abroad, "no chat moved to dc-b"
    assert min(abroad) > first_lowered_s  # nothing went abroad before the weights said so
    assert min(abroad) < first_lowered_s + 10.0  # and the overflow came soon after
    assert len(abroad) > 0.2 * len(served)
    assert all(dc == "dc-a" for dc, _, resident in served if resident)
    assert pace > 0  # the gateway read dc-a's goodput tables off Kafka too


async def _traffic(url: str, start: float) -> None:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
    headers = {"authorization": f"Bearer {KEY}"}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=60, limits=limits) as http:

        async def one(at_s: float, resident: bool) -> None:
            await asyncio.sleep(max(0.0, start + at_s - time.monotonic()))
            extra = {"x-tokenfleet-residency": "eu-west"} if resident else {}
            content = "resident" if resident else "a question"
            response = await http.post("/v1/chat/completions", json=chat(content), headers=extra)
            assert response.status_code == 200

        steps = round(RUN_S / EVERY_S)
        await asyncio.gather(*(one(n * EVERY_S, n % 5 == 0) for n in range(steps)))

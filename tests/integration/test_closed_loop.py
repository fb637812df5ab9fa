"""The admission loop closed end to end on real services: the gateway's lifecycle events
on Kafka, the Faust worker's goodput and capacity tables, SLOMax's controller reading
them and publishing quotas, the gateway (its shared state in Redis) applying them.

The instances are scripted so that the loop, not this machine's speed, decides the
outcome: a chat takes longer the more long documents or batch jobs its instance is
running, as a long prefill or a batch of decodes shares the steps of the chats beside it.
A flood of either makes chats miss until the controller lowers that class's ceiling."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Coroutine, Iterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from control.controllers.slomax import QuotaController, QuotaControllerParams, ceiling
from gateway.inbound import CLASS_HEADER, DEADLINE_HEADER
from schemas.base import TaskClass
from schemas.control import AdmissionQuotas
from streams.collector import Collector
from streams.kafka import KafkaBus
from streams.tables.windows import WindowSpec
from tests.conftest import own_broker_for_module, read_for
from tests.gateway_harness import (
    KEY,
    Gateway,
    chat,
    chat_answer,
    fleet_for,
    gateway,
    http_server,
    until_ready,
    vllm_metrics,
)
from tests.integration.test_tables_on_kafka import worker
from tests.services import Service
from tokenfleet.controller_host import QUOTAS_TOPIC, QuotaHost

pytestmark = [pytest.mark.kafka, pytest.mark.redis]

CHAT_TTFT_S = 2.0
"""The interactive objective a whole (unstreamed) chat must meet: its answer within 2 s."""
CHAT_S, CHAT_S_PER_HEAVY = 0.05, 0.7
"""A chat's time on an instance: 50 ms, and 0.7 s more for each long document or batch job
there.
Three documents on an instance make a chat miss its objective; two do not. (At 0.6 s a
chat missed only beside four, and the controller's first step, from eight documents to
six, let most chats meet it again while the two instances split the six unevenly: once
the worst 2 s window of the flood still had 65 % of chats in time.)"""
HEAVY_S = 1.5
CHAT_EVERY_S, HEAVY_EVERY_S = 0.05, 0.1
"""Twenty chats a second all along; ten documents (or batch jobs) a second during the
flood, which at 1.5 s each would keep 15 in flight: more than SLOMax's starting limit of
four documents per instance (and batch has no ceiling until the controller sets one), so
until the controller brings the class to two per instance chats miss."""
HEAVY = "a long document, or a batch job"
"""What the instances tell the flood from chats by (the class header stays at the gateway)."""
BATCH_DEADLINE_S = 10.0
"""A batch job's deadline: held past it, the job is answered (503), so the run ends soon
after the flood does."""
RUN_S = 40.0
FLOOD_FROM_S, FLOOD_UNTIL_S = 5.0, 36.0
"""Seen on this project's 2-core machine, in four runs: chats met their objective in every
2 s window from the one at 12 to 16 s on, the ceiling at one or two a DC by then; the last
10 s of the flood, which are judged, begin 10 s later. (Until 2026-12-07 the flood lasted
40 s and the run 50.)"""


@pytest.fixture(scope="module")
def kafka(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    """A broker of this module's own: the worker reads its input topics from the start."""
    with own_broker_for_module(tmp_path_factory.mktemp("loop")) as service:
        yield service


def instance() -> Starlette:
    """Answers chats (slower the more heavy requests it runs) and heavy requests."""
    heavy = 0

    async def metrics(_: Request) -> Response:
        return vllm_metrics(waiting=0, running=heavy)

    async def answer(request: Request) -> Response:
        nonlocal heavy
        body = await request.json()
        if body["messages"][0]["content"] != HEAVY:
            await asyncio.sleep(CHAT_S + CHAT_S_PER_HEAVY * heavy)
            return chat_answer()
        heavy += 1
        try:
            await asyncio.sleep(HEAVY_S)
        finally:
            heavy -= 1
        return chat_answer()

    return Starlette(
        routes=[Route("/metrics", metrics), Route("/v1/chat/completions", answer, methods=["POST"])]
    )


@dataclass(frozen=True)
class Chat:
    sent_s: float
    """Seconds since the run started."""
    met: bool


FLOODS = {
    TaskClass.LONG_DOCUMENT: {CLASS_HEADER: "long_document"},
    TaskClass.BATCH: {CLASS_HEADER: "batch", DEADLINE_HEADER: str(BATCH_DEADLINE_S)},
}


@pytest.mark.parametrize("flooding", list(FLOODS), ids=lambda c: c.value)
async def test_a_flood_lowers_its_class_ceiling_through_the_tables_and_chats_recover(
    kafka: Service, redis_server: Service, flooding: TaskClass
) -> None:
    """Long documents answer for late chats; batch work, when no long documents ran in
    the window."""
    async with contextlib.AsyncExitStack() as stack:
        urls = [await stack.enter_async_context(http_server(instance())) for _ in range(2)]
        fleet = fleet_for(urls)
        stack.enter_context(
            worker(kafka, f"loop-{uuid.uuid4().hex[:8]}", WindowSpec(10.0, 1.0, 2.0))
        )
        bus = KafkaBus(kafka.address, source="test")
        stack.push_async_callback(bus.close)
        params = QuotaControllerParams(lower_after_s=2.0, raise_after_s=600.0, min_outcomes=20)
        scraper = await stack.enter_async_context(aiohttp.ClientSession())
        front = await stack.enter_async_context(
            gateway(fleet, kafka=kafka.address, redis=redis_server.address, admission="slomax")
        )
        async with _running(
            Collector(fleet.instances, bus, scraper).run(),
            QuotaHost(bus, QuotaController(params), period_s=1.0).run(),
        ):
            await until_ready(front)
            chats = await _traffic(front, FLOODS[flooding])
        published = [
            q for q in await read_for(bus, QUOTAS_TOPIC, 3.0) if isinstance(q, AdmissionQuotas)
        ]
    limits = [limit for q in published if (limit := ceiling(q, flooding)) is not None]
    early = [_share_met(chats, t, t + 2.0) for t in range(int(FLOOD_FROM_S), 20)]
    late = _share_met(chats, FLOOD_UNTIL_S - 10.0, FLOOD_UNTIL_S)
    print(f"{flooding.value} limits {limits}; chats met {early} (2 s windows), then {late:.2f}")
    assert limits, f"the controller published no {flooding.value} ceiling"
    if flooding is TaskClass.LONG_DOCUMENT:
        # Where SLOMax starts (four per ready instance), or the controller's first step
        # from there when the flood reached the tables before its first pass did: down
        # where chats missed (to 6, or 4 far below), up one (x 1.25) where chats still
        # had room and documents had been turned away (seen once in CI on a loaded
        # machine: 10)
        assert limits[0] in (4, 6, 8, 10)
    assert min(limits) <= 4  # lowered through the tables to two per instance at most
    assert min(early) < 0.5  # the flood made chats miss
    assert late > 0.9  # and with fewer of the class at once they met their objective again


@contextlib.asynccontextmanager
async def _running(*loops: Coroutine[Any, Any, None]) -> AsyncIterator[None]:
    tasks = [asyncio.ensure_future(loop) for loop in loops]
    try:
        yield
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _traffic(front: Gateway, flood_headers: dict[str, str]) -> list[Chat]:
    """Chats all along; heavy requests (with ``flood_headers``) flooding in between
    ``FLOOD_FROM_S`` and ``FLOOD_UNTIL_S``. The chats' outcomes, as their clients saw them;
    heavy requests not answered when the last chat is, their clients leave. (Until
    2026-12-07 the run waited for them: 25 s more, long documents held to the end of
    their 30 s objective.)"""
    start = time.monotonic()
    # a fresh connection per request: reusing one the server is closing for idleness
    # fails the request with a ReadError (uvicorn closes idle connections after 5 s)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
    headers = {"authorization": f"Bearer {KEY}"}
    async with httpx.AsyncClient(
        base_url=front.url, headers=headers, timeout=120, limits=limits
    ) as http:
        chats = [
            asyncio.create_task(_chat(http, start, at)) for at in _every(CHAT_EVERY_S, 0.0, RUN_S)
        ]
        flood = [
            asyncio.create_task(_heavy(http, start, at, flood_headers))
            for at in _every(HEAVY_EVERY_S, FLOOD_FROM_S, FLOOD_UNTIL_S)
        ]
        outcomes = await asyncio.gather(*chats)
        for heavy in flood:  # those still held would wait out their objective (30 s)
            heavy.cancel()
        for ended in await asyncio.gather(*flood, return_exceptions=True):
            if isinstance(ended, Exception):  # an answer that was not 200, 429 or 503
                raise ended
    return outcomes


def _every(period_s: float, start_s: float, end_s: float) -> list[float]:
    return [start_s + n * period_s for n in range(round((end_s - start_s) / period_s))]


def _share_met(chats: list[Chat], from_s: float, until_s: float) -> float:
    window = [c.met for c in chats if from_s <= c.sent_s < until_s]
    return sum(window) / len(window)


async def _chat(http: httpx.AsyncClient, start: float, at_s: float) -> Chat:
    await asyncio.sleep(max(0.0, start + at_s - time.monotonic()))
    sent = time.monotonic()
    response = await http.post("/v1/chat/completions", json=chat("a question"))
    return Chat(at_s, response.status_code == 200 and time.monotonic() - sent <= CHAT_TTFT_S)


async def _heavy(
    http: httpx.AsyncClient, start: float, at_s: float, headers: dict[str, str]
) -> None:
    await asyncio.sleep(max(0.0, start + at_s - time.monotonic()))
    response = await http.post("/v1/chat/completions", json=chat(HEAVY), headers=headers)
    assert response.status_code in {200, 429, 503}

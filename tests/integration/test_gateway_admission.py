"""SLOMax on the live path: the gateway holds, releases and refuses requests by class, in
front of instances whose scraped load the test sets."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, replace

import httpx
import numpy as np
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

from control.admission.slomax import SLOMaxParams
from control.pipeline import ROUTING_FAILED, ClassLoad
from control.routing import Router, make_router
from gateway.admission import Admitted, GatewayAdmission, Waiting
from gateway.state import AdmissionLoads, SlotClaim
from schemas import topic_for
from schemas.base import TaskClass
from schemas.control import AdmissionQuotas, ClassQuota
from schemas.lifecycle import RejectReason, RequestRejected
from schemas.openai_api import ApiError
from tests.admission_harness import READY, document, slomax_host
from tests.conftest import read_for
from tests.gateway_harness import (
    MODEL,
    Gateway,
    chat,
    chat_answer,
    emulated,
    fleet_for,
    gateway,
    http_server,
    scraped,
    until_ready,
    vllm_metrics,
)
from tests.unit.test_pipeline import _BreaksOnSecondRoute

BATCH = {"x-tokenfleet-class": "batch", "x-tokenfleet-deadline-s": "60"}


@dataclass
class Load:
    """What the scripted instances report on /metrics."""

    waiting: int = 0


def scripted(load: Load) -> Starlette:
    """A vLLM-like instance that answers every chat at once and reports ``load``."""

    async def metrics(_: Request) -> Response:
        return vllm_metrics(load.waiting, running=0)

    async def answer(_: Request) -> Response:
        return chat_answer()

    return Starlette(
        routes=[Route("/metrics", metrics), Route("/v1/chat/completions", answer, methods=["POST"])]
    )


@pytest.fixture
async def load() -> Load:
    return Load(waiting=3)


@contextlib.asynccontextmanager
async def scripted_fleet(load: Load) -> AsyncIterator[Gateway]:
    """Two scripted instances behind a gateway running SLOMax, ready."""
    async with contextlib.AsyncExitStack() as stack:
        urls = [await stack.enter_async_context(http_server(scripted(load))) for _ in range(2)]
        running = await stack.enter_async_context(gateway(fleet_for(urls), admission="slomax"))
        await until_ready(running)
        yield running


@pytest.fixture
async def front(load: Load) -> AsyncIterator[Gateway]:
    async with scripted_fleet(load) as running:
        yield running


async def until(check: object, timeout_s: float = 5.0) -> None:
    assert callable(check)
    for _ in range(int(timeout_s / 0.02)):
        if await check():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("the condition never held")


async def depth(front: Gateway, task_class: str) -> float:
    return await scraped(front.url, "tokenfleet_gateway_pool_depth", task_class=task_class)


async def test_batch_waits_in_its_pool_while_the_fleet_queues_and_starts_once_it_drains(
    front: Gateway, load: Load
) -> None:
    async with front.client() as http:
        chat_answer = await http.post("/v1/chat/completions", json=chat("hi"))
        assert chat_answer.status_code == 200  # interactive traffic goes at once
        batch = asyncio.create_task(
            http.post("/v1/chat/completions", json=chat("hi"), headers=BATCH)
        )

        async def held() -> bool:
            return await depth(front, "batch") == 1

        await until(held)
        await asyncio.sleep(0.3)  # a scrape or more later, still held
        assert not batch.done()
        load.waiting = 0
        answer = await asyncio.wait_for(batch, 5)
    assert answer.status_code == 200
    assert await depth(front, "batch") == 0
    admissions = "tokenfleet_gateway_admissions_total"
    assert await scraped(front.url, admissions, task_class="batch", verdict="hold") == 1
    assert await scraped(front.url, admissions, task_class="batch", verdict="dispatch") == 1
    goodput = "tokenfleet_gateway_output_tokens_total"
    assert await scraped(front.url, goodput, task_class="batch", met="true") == 2


async def test_a_held_request_that_can_no_longer_meet_its_deadline_gets_503(
    front: Gateway,
) -> None:
    headers = {**BATCH, "x-tokenfleet-deadline-s": "1"}
    async with front.client() as http:
        answer = await http.post("/v1/chat/completions", json=chat("hi"), headers=headers)
    assert answer.status_code == 503
    error = answer.json()["error"]
    assert "can no longer meet its objective" in error["message"]
    assert "retry-after" not in answer.headers
    assert await depth(front, "batch") == 0


async def test_a_request_that_cannot_meet_its_deadline_is_refused_at_once_with_429(
    front: Gateway,
) -> None:
    headers = {**BATCH, "x-tokenfleet-deadline-s": "0.000001"}
    async with front.client() as http:
        answer = await http.post("/v1/chat/completions", json=chat("hi"), headers=headers)
    assert answer.status_code == 429
    assert answer.json()["error"]["type"] == "rate_limit_error"
    assert "(deadline)" in answer.json()["error"]["message"]
    assert int(answer.headers["retry-after"]) >= 1
    assert await depth(front, "batch") == 0
    bus = front.app.state.gateway.parts.bus
    events = await read_for(bus, topic_for(RequestRejected).name, 0.5)
    [rejected] = [m for m in events if isinstance(m, RequestRejected)]
    assert rejected.reason is RejectReason.DEADLINE  # not a quota: it could not be in time
    assert rejected.dc == "dc-a"  # the DC whose admission refused it


async def test_a_client_that_leaves_while_held_leaves_its_pool(front: Gateway) -> None:
    async with front.client() as http:
        with pytest.raises(httpx.ReadTimeout):
            await http.post("/v1/chat/completions", json=chat("hi"), headers=BATCH, timeout=0.5)

    async def withdrawn() -> bool:
        return await depth(front, "batch") == 0

    await until(withdrawn)
    cancelled = await scraped(front.url, "tokenfleet_gateway_cancellations_total")
    assert cancelled == 1


async def test_a_gateway_that_stops_answers_its_held_requests_first(load: Load) -> None:
    serving = scripted_fleet(load)
    front = await serving.__aenter__()
    async with front.client() as http:
        batch = asyncio.create_task(
            http.post("/v1/chat/completions", json=chat("hi"), headers=BATCH)
        )

        async def held() -> bool:
            return await depth(front, "batch") == 1

        await until(held)
        stopping = asyncio.create_task(serving.__aexit__(None, None, None))
        answer = await asyncio.wait_for(batch, 5)
        await asyncio.wait_for(stopping, 10)
    assert answer.status_code == 503
    assert "stopping" in answer.json()["error"]["message"]
    assert answer.headers["retry-after"] == "1"


@pytest.mark.parametrize(("engine", "sign"), [("vllm", 1), ("sglang", -1)])
async def test_under_vllm_priority_the_gateway_sends_each_request_its_class_s_priority(
    engine: str, sign: int
) -> None:
    """vLLM runs low values first, SGLang high ones (by default): the sign follows the
    instance's engine."""
    sent: list[object] = []

    async def answer(request: Request) -> Response:
        sent.append((await request.json()).get("priority"))
        return chat_answer()

    async def metrics(_: Request) -> Response:
        if engine == "sglang":
            text = "sglang:num_running_reqs 0\nsglang:num_queue_reqs 0\nsglang:token_usage 0.1\n"
            return PlainTextResponse(text)
        return vllm_metrics(waiting=0, running=0)

    instance = Starlette(
        routes=[Route("/metrics", metrics), Route("/v1/chat/completions", answer, methods=["POST"])]
    )
    async with http_server(instance) as url:
        served = [{"id": "i0", "dc": "dc-a", "url": url, "model": MODEL, "engine": engine}]
        async with (
            gateway(fleet_for([url], instances=served), admission="vllm_priority") as front,
            front.client() as http,
        ):
            await until_ready(front)
            for headers, body in (
                ({}, chat("hi")),
                (BATCH, chat("hi")),
                (BATCH, chat("hi", priority=-100)),  # a batch tenant's own would overtake chats
            ):
                answer_ = await http.post("/v1/chat/completions", json=body, headers=headers)
                assert answer_.status_code == 200
    assert sent == [0, 2 * sign, 2 * sign]


async def test_the_emulator_takes_vllm_s_priority_and_refuses_one_that_is_not_a_number() -> None:
    async with emulated(1, speedup=10.0) as [instance], httpx.AsyncClient() as http:
        url = f"{instance.url}/v1/chat/completions"
        assert (await http.post(url, json=chat("hi", priority=3))).status_code == 200
        refused = await http.post(url, json=chat("hi", priority="high"))
    assert refused.status_code == 400
    assert refused.json()["error"]["param"] == "priority"


async def test_a_release_pass_applies_the_quotas_published_since_the_last_arrival() -> None:
    """Held under a ceiling of one, a document starts at the next pass once the ceiling
    is raised, though nothing arrived since."""
    host, held, published = _one_running_one_held(make_router("round_robin"))
    assert await host.release_pass() == 0
    published.append(_documents_ceiling(4, 2))
    assert await host.release_pass() == 1
    assert isinstance(await held.decision(), Admitted)


async def test_a_release_pass_that_fails_answers_the_request_it_failed_on() -> None:
    """A router's error in a pass escaped it, and the document it had let go was never
    answered."""
    host, held, published = _one_running_one_held(_BreaksOnSecondRoute())  # 1st route: fine
    published.append(_documents_ceiling(4, 2))
    assert await host.release_pass() == 1  # its second route fails: refused
    with pytest.raises(ApiError) as refused:
        await held.decision()
    assert (refused.value.status, ROUTING_FAILED in refused.value.message) == (503, True)


@pytest.mark.parametrize(
    ("held", "drained_per_s", "ready", "retry_after_s"),
    [(10, 0.5, True, 20.0), (1_000, 0.5, True, 60.0), (10, 0.0, False, 60.0), (10, 0.0, True, 1.0)],
)
async def test_a_refusal_for_a_full_pool_says_to_retry_once_the_pool_has_drained(
    held: int, drained_per_s: float, ready: bool, retry_after_s: float
) -> None:
    """The pool, on another replica, drains one request every 2 s: a request refused as
    the pool is full is told to come back once it has drained (a minute at most), not in
    1 s, when it would meet the pool still full. A pool holding requests while no
    instance is ready says the minute; one not measured yet (nothing let go in its
    window, an instance ready), the policy's own second."""

    async def alone(_own: str, _slots: Mapping[str, SlotClaim]) -> AdmissionLoads:
        return AdmissionLoads([], {})

    host = slomax_host(alone, params=SLOMaxParams(pool_depth=1))
    pool = ClassLoad(held=held, drained_per_s=drained_per_s)
    host.pipeline(MODEL, "dc-a").peers = {TaskClass.LONG_DOCUMENT: pool}
    snapshot = READY if ready else replace(READY, ready=np.array([False]))
    with pytest.raises(ApiError) as refused:
        document(host, snapshot=snapshot)
    assert (refused.value.status, "(pool_full)" in refused.value.message) == (429, True)
    assert refused.value.retry_after_s == retry_after_s


def _one_running_one_held(
    router: Router,
) -> tuple[GatewayAdmission, Waiting, list[AdmissionQuotas]]:
    """A lone host under a ceiling of one long document (the last of the quotas it
    returns, as the host reads them), one document running and one held."""

    async def alone(_own: str, _slots: Mapping[str, SlotClaim]) -> AdmissionLoads:
        return AdmissionLoads([], {})

    published = [_documents_ceiling(1, 1)]
    host = slomax_host(alone, held_quotas=published, router=lambda: router)
    assert isinstance(document(host, published[-1])[1], Admitted)
    _, held = document(host, published[-1])
    assert isinstance(held, Waiting)
    return host, held, published


def _documents_ceiling(limit: int, version: int) -> AdmissionQuotas:
    quota = ClassQuota(task_class=TaskClass.LONG_DOCUMENT, max_concurrency=limit)
    return AdmissionQuotas(
        scope="dc-a", version=version, issued_at=time.time(), ttl_s=60, quotas=(quota,)
    )

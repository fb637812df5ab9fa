"""SLOMax on the live path: the gateway holds, releases and refuses requests by class, in
front of instances whose scraped load the test sets."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, replace

import httpx
import numpy as np
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from control.admission.slomax import SLOMax, SLOMaxParams
from control.pipeline import ROUTING_FAILED, ClassLoad
from control.routing import FleetSnapshot, Router, RouteRequest, make_router
from gateway.admission import Admitted, GatewayAdmission, Waiting
from gateway.inbound import Inbound, read_inbound
from gateway.metrics import GatewayMetrics
from gateway.redis_state import RedisState
from gateway.state import AdmissionLoads, SlotClaim
from schemas import topic_for
from schemas.base import TaskClass
from schemas.control import AdmissionQuotas, ClassQuota
from schemas.lifecycle import RejectReason, RequestRejected
from schemas.objectives import Objectives
from schemas.openai_api import ApiError
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
from tests.services import Service
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


async def test_under_vllm_priority_the_gateway_sends_each_request_its_class_s_priority() -> None:
    sent: list[object] = []

    async def answer(request: Request) -> Response:
        sent.append((await request.json()).get("priority"))
        return chat_answer()

    async def metrics(_: Request) -> Response:
        return vllm_metrics(waiting=0, running=0)

    instance = Starlette(
        routes=[Route("/metrics", metrics), Route("/v1/chat/completions", answer, methods=["POST"])]
    )
    async with (
        http_server(instance) as url,
        gateway(fleet_for([url]), admission="vllm_priority") as front,
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
    assert sent == [0, 2, 2]


async def test_the_emulator_takes_vllm_s_priority_and_refuses_one_that_is_not_a_number() -> None:
    async with emulated(1, speedup=10.0) as [instance], httpx.AsyncClient() as http:
        url = f"{instance.url}/v1/chat/completions"
        assert (await http.post(url, json=chat("hi", priority=3))).status_code == 200
        refused = await http.post(url, json=chat("hi", priority="high"))
    assert refused.status_code == 400
    assert refused.json()["error"]["param"] == "priority"


DOCUMENT_S = 1.5
"""How long the scripted instance takes over a long document: longer than the sending
takes, so every held document is held before the first ends."""


@pytest.mark.redis
async def test_replicas_side_by_side_keep_one_class_ceiling_and_one_pool_order(
    redis_server: Service,
) -> None:
    """Two gateways on one Redis, long documents sent to both: together they keep SLOMax's
    ceiling (four per ready instance, one instance here), where each alone would let four
    in, and the held ones start in the order they came, whichever gateway holds them. The
    first four go through one gateway and the rest to each in turn, starting with the
    other: capacity frees on the first while the next in line waits on the second."""
    started: list[str] = []
    running = 0
    most = 0

    async def metrics(_: Request) -> Response:
        return vllm_metrics(waiting=0, running=running)

    async def answer(request: Request) -> Response:
        nonlocal running, most
        started.append((await request.json())["messages"][0]["content"])
        running += 1
        most = max(most, running)
        try:
            await asyncio.sleep(DOCUMENT_S)
        finally:
            running -= 1
        return chat_answer()

    instance = Starlette(
        routes=[Route("/metrics", metrics), Route("/v1/chat/completions", answer, methods=["POST"])]
    )
    documents = [f"document {n}" for n in range(12)]
    async with contextlib.AsyncExitStack() as stack:
        fleet = fleet_for([await stack.enter_async_context(http_server(instance))])
        shared = {"redis": redis_server.address, "redis_prefix": f"test-{uuid.uuid4().hex}:"}
        fronts = [
            await stack.enter_async_context(gateway(fleet, admission="slomax", **shared))
            for _ in range(2)
        ]
        for front in fronts:
            await until_ready(front)
        clients = [await stack.enter_async_context(f.client()) for f in fronts]
        sent = []
        for n, document in enumerate(documents):
            request = clients[0 if n < 4 else (n + 1) % 2].post(
                "/v1/chat/completions",
                json=chat(document),
                headers={"x-tokenfleet-class": "long_document"},
            )
            sent.append(asyncio.create_task(request))
            await asyncio.sleep(0.08)
        answers = await asyncio.gather(*sent)
    assert [a.status_code for a in answers] == [200] * len(documents)
    assert most == 4
    assert started == documents


async def test_a_peer_load_this_replica_cannot_read_is_skipped_and_the_rest_counted() -> None:
    """A replica of another version (mid-upgrade) publishes a load with a class this one
    does not know, or too few fields: it is left out, and the others still count. An
    earlier version's load without the rate reads as sending none; a later one's fields
    past those this one knows are read past."""
    earlier = {"interactive": [3, 1, 2, 0.5, None]}  # an earlier version sends no rate
    current = {"interactive": [1, 0, 1, 0.25, None, 4.0]}
    later = {"interactive": [1, 0, 0, 0.0, None, 2.0, "what a later version adds"]}
    published = [
        json.dumps({f"{MODEL}/dc-a": {"video": [1, 0, 0, 0.0, None, 0.0]}}),
        json.dumps({f"{MODEL}/dc-a": {"interactive": [1, 0, 0, 0.0]}}),
        "not json",
        json.dumps({f"{MODEL}/dc-a": earlier}),
        json.dumps({f"{MODEL}/dc-a": current}),
        json.dumps({f"{MODEL}/dc-a": later}),
    ]

    async def loads(_own: str, _slots: Mapping[str, SlotClaim]) -> AdmissionLoads:
        return AdmissionLoads(published, {})

    host = _slomax_host(loads)
    pipeline = host.pipeline(MODEL, "dc-a")
    await host.share_loads()
    assert pipeline.peers[TaskClass.INTERACTIVE] == ClassLoad(5, 1, 3, 0.75, None, 6.0)
    _, _, sent_per_s = host.pool_load(MODEL, "dc-a")
    assert sent_per_s == 6.0  # what the others send in, beside this replica's none


@pytest.mark.parametrize("others", [0, 1])
async def test_a_lone_replica_shares_its_load_once_a_tick_and_one_among_others_at_each_pass(
    others: int,
) -> None:
    """Alone as last heard, a replica tells no one of each pass, only of each tick; beside
    another, it shares before every pass."""
    shared: list[str] = []

    async def loads(own: str, _slots: Mapping[str, SlotClaim]) -> AdmissionLoads:
        shared.append(own)
        load = json.dumps({f"{MODEL}/dc-a": {"interactive": [1, 0, 0, 0.0, None]}})
        return AdmissionLoads([load] * others, {})

    host = _slomax_host(loads, tick_s=5.0)
    running = asyncio.create_task(host.run())
    try:
        for _ in range(20):
            host.wake()
            await asyncio.sleep(0.01)
    finally:
        running.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await running
    passes = len(shared) - 1  # the last: leaving, the others stop counting this one
    assert passes == (1 if others == 0 else 20)


READY = FleetSnapshot(("i0",), *(np.array([v]) for v in (True, 0, 0, 0, 0, 100)), np.array([0.0]))
"""One ready instance: a ceiling of four long documents."""


async def test_a_replica_claims_a_ceiling_whole_alone_and_beside_others_what_it_needs() -> None:
    """Alone, a replica claims all four slots and starts documents as the ceiling lets it;
    beside another, it starts them only in the slots granted to it, and claims one for
    each it holds while its pool's head stands before the other's, and one for the next
    arrival while no one holds any."""
    peers: list[str] = []
    granted = 0
    claims: list[SlotClaim] = []

    async def loads(_own: str, slots: Mapping[str, SlotClaim]) -> AdmissionLoads:
        claims.extend(slots.values())
        return AdmissionLoads(list(peers), dict.fromkeys(slots, granted))

    host = _slomax_host(loads)
    assert isinstance(_document(host)[1], Admitted)
    await host.share_loads()
    assert claims.pop() == SlotClaim(running=1, wanted=4, limit=4)
    peers.append(json.dumps({f"{MODEL}/dc-a": {}}))  # another replica, holding nothing
    granted = 1
    await host.share_loads()
    assert claims.pop() == SlotClaim(running=1, wanted=4, limit=4)  # as yet alone
    _, held = _document(host)
    assert isinstance(held, Waiting)  # the ceiling has room, its slots not
    await host.share_loads()
    assert claims.pop() == SlotClaim(running=1, wanted=2, limit=4)
    before = time.time() - 60.0  # the other's head, on the wall clock
    peers[0] = json.dumps({f"{MODEL}/dc-a": {"long_document": [0, 0, 1, 0.0, before]}})
    await host.share_loads()  # hears the other holds one from before its own
    granted = 2
    await host.share_loads()
    assert claims.pop() == SlotClaim(running=1, wanted=1, limit=4)
    assert await host.release_pass() == 0  # the other's comes first
    peers[0] = json.dumps({f"{MODEL}/dc-a": {}})
    await host.share_loads()
    assert await host.release_pass() == 1
    assert isinstance(await held.decision(), Admitted)
    await host.share_loads()
    assert claims.pop() == SlotClaim(running=2, wanted=3, limit=4)


async def test_beside_others_a_pool_s_first_request_finds_a_slot_claimed_for_it() -> None:
    """Beside another replica, the first request to a pool claims its slot before it is
    admitted, once, under the ceiling its DC's quota sets: it starts at once rather than
    waiting a pass in the pool."""
    claims: list[SlotClaim] = []

    async def loads(_own: str, slots: Mapping[str, SlotClaim]) -> AdmissionLoads:
        claims.extend(slots.values())
        return AdmissionLoads([json.dumps({f"{MODEL}/dc-a": {}})], dict.fromkeys(slots, 1))

    quota = ClassQuota(task_class=TaskClass.LONG_DOCUMENT, max_concurrency=2)
    quotas = AdmissionQuotas(scope="dc-a", version=1, issued_at=0.0, ttl_s=60, quotas=(quota,))
    host = _slomax_host(loads, quotas)
    await host.join()
    await host.open_pool(MODEL, "dc-a")
    assert claims == [SlotClaim(running=0, wanted=1, limit=2)]
    assert isinstance(_document(host, quotas)[1], Admitted)
    await host.open_pool(MODEL, "dc-a")  # opened already: no claim
    assert len(claims) == 1


async def test_a_replica_whose_shares_fail_keeps_its_slots_a_while_then_decides_alone() -> None:
    """A share that fails (Redis slow or away) leaves the replica with what it last heard,
    for as long as the others count it, then alone on the whole ceiling."""
    failing = False

    async def loads(_own: str, slots: Mapping[str, SlotClaim]) -> AdmissionLoads:
        if failing:
            raise ConnectionError("Redis is away")
        return AdmissionLoads([json.dumps({f"{MODEL}/dc-a": {}})], dict.fromkeys(slots, 1))

    host = _slomax_host(loads, heard_for_s=0.2)
    await host.join()
    await host.open_pool(MODEL, "dc-a")
    failing = True
    await host.join()
    assert (host.replicas, host.pipeline(MODEL, "dc-a").slots) == (2, {TaskClass.LONG_DOCUMENT: 1})
    await asyncio.sleep(0.25)
    await host.join()
    assert (host.replicas, host.pipeline(MODEL, "dc-a").slots) == (1, None)


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

    host = _slomax_host(alone, params=SLOMaxParams(pool_depth=1))
    pool = ClassLoad(held=held, drained_per_s=drained_per_s)
    host.pipeline(MODEL, "dc-a").peers = {TaskClass.LONG_DOCUMENT: pool}
    snapshot = READY if ready else replace(READY, ready=np.array([False]))
    with pytest.raises(ApiError) as refused:
        _document(host, snapshot=snapshot)
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
    host = _slomax_host(alone, held_quotas=published, router=lambda: router)
    assert isinstance(_document(host, published[-1])[1], Admitted)
    _, held = _document(host, published[-1])
    assert isinstance(held, Waiting)
    return host, held, published


def _documents_ceiling(limit: int, version: int) -> AdmissionQuotas:
    quota = ClassQuota(task_class=TaskClass.LONG_DOCUMENT, max_concurrency=limit)
    return AdmissionQuotas(
        scope="dc-a", version=version, issued_at=time.time(), ttl_s=60, quotas=(quota,)
    )


@pytest.mark.redis
async def test_replicas_on_one_redis_never_start_more_than_the_ceiling_between_them(
    redis_server: Service,
) -> None:
    """Two hosts on one Redis, driven pass by pass, a ceiling of four. The first, its
    running documents down from three to one, claims two slots (one and one for the next
    arrival); of three documents that reach it while that claim is on its way, one starts.
    Started, the second would be in no grant, and the other host, granted the slots the
    claim gave back, would make five."""
    prefix = f"test-{uuid.uuid4().hex}:"
    states = [  # loads that outlive the test's passes, however slow the machine
        RedisState(redis_server.address, prefix, replica=r, load_ttl_s=30.0) for r in ("a", "b")
    ]
    arrivals: list[Admitted | Waiting] = []
    arriving = 0

    async def loads_a(own: str, slots: Mapping[str, SlotClaim]) -> AdmissionLoads:
        arrivals.extend(_document(a)[1] for _ in range(arriving))  # while the claim is away
        return await states[0].admission_loads(own, slots)

    a, b = _slomax_host(loads_a), _slomax_host(states[1].admission_loads)

    async def settle(*hosts: GatewayAdmission) -> None:
        for host in hosts:
            await host.share_loads()
            await host.release_pass()

    def running(host: GatewayAdmission) -> int:
        return sum(host.pipeline(MODEL, "dc-a").inflight.values())

    try:
        await a.join()
        await b.join()
        assert isinstance(_document(b)[1], Admitted)  # alone: its own ceiling
        await settle(b)
        first = [_document(a) for _ in range(3)]  # alone too, as far as it knows
        await settle(a, b, b, a)  # each hears of the other and claims beside it
        assert (a.replicas, b.replicas, running(a), running(b)) == (2, 2, 3, 1)
        for inbound, _ in first[:2]:
            a.finished(inbound, "dc-a")
        arriving = 3
        await settle(a)
        assert [type(w) for w in arrivals] == [Admitted, Waiting, Waiting]
        assert isinstance(_document(b)[1], Waiting)  # no slot to spare
        await settle(b)
        assert (running(a), running(b)) == (2, 2)
    finally:
        for state in states:
            await state.close()


def _slomax_host(
    loads: Callable[[str, Mapping[str, SlotClaim]], Awaitable[AdmissionLoads]],
    quotas: AdmissionQuotas | None = None,
    heard_for_s: float = 1.5,
    tick_s: float = 0.05,
    held_quotas: list[AdmissionQuotas] | None = None,
    router: Callable[[], Router] = lambda: make_router("round_robin"),
    params: SLOMaxParams | None = None,
) -> GatewayAdmission:
    """A gateway's admission host with SLOMax (``params``), in front of ``READY``, under
    ``quotas`` (or the last of ``held_quotas`` as it is when asked), sharing its load
    through ``loads``."""
    now = [quotas] if held_quotas is None else held_quotas

    async def snapshot(_model: str, _dc: str) -> FleetSnapshot:
        return READY

    return GatewayAdmission(
        lambda _model: SLOMax(params or SLOMaxParams()),
        lambda _model, _dc: router(),
        snapshot,
        Objectives(),
        GatewayMetrics(),
        loads,
        tick_s=tick_s,
        pool_now=lambda _model, _dc: (1, now[-1]),
        heard_for_s=heard_for_s,
    )


def _document(
    host: GatewayAdmission,
    quotas: AdmissionQuotas | None = None,
    snapshot: FleetSnapshot = READY,
) -> tuple[Inbound, Admitted | Waiting]:
    """A long document arriving at ``host`` now (on ``snapshot``), and where admission put
    it."""
    fleet = fleet_for(["http://127.0.0.1:9"])
    at = time.monotonic()
    body = json.dumps(chat(f"document at {at}")).encode()
    headers = {"x-tokenfleet-class": "long_document"}
    inbound = read_inbound(fleet, fleet.tenants[0], "/v1/chat/completions", body, headers)
    route = RouteRequest(inbound.request_id, inbound.input_tokens, None)
    return inbound, host.arrive(inbound, "dc-a", route, snapshot, at, quotas)

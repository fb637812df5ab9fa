"""SLOMax on gateway replicas side by side: one class ceiling and one pool order between
them, their loads shared through Redis (or a scripted exchange), slots claimed and
granted, and what a replica does when its shares fail."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import Mapping

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from control.pipeline import ClassLoad
from gateway.admission import Admitted, GatewayAdmission, Waiting
from gateway.redis_state import RedisState
from gateway.state import AdmissionLoads, SlotClaim
from schemas.base import TaskClass
from schemas.control import AdmissionQuotas, ClassQuota
from tests.admission_harness import document, slomax_host
from tests.gateway_harness import (
    MODEL,
    chat,
    chat_answer,
    fleet_for,
    gateway,
    http_server,
    until_ready,
    vllm_metrics,
)
from tests.services import Service

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

    host = slomax_host(loads)
    pipeline = host.pipeline(MODEL, "dc-a")
    await host.share_loads()
    assert pipeline.peers[TaskClass.INTERACTIVE] == ClassLoad(5, 1, 3, 0.75, None, 6.0)
    _, _, sent_per_s = host.pool_load(MODEL, "dc-a")
    assert sent_per_s == 6.0  # what the others send in, beside this replica's none


@pytest.mark.parametrize(
    ("others", "held", "served", "idle_every_s", "shares"),
    [
        (0, 0, False, 0.0, 0),  # alone: its tick (5 s) is not due again
        (1, 0, False, 0.0, 20),
        (1, 0, False, 60.0, 0),
        (1, 1, True, 60.0, 20),  # the other holds a request in a pool this one serves
        (1, 1, False, 60.0, 0),  # in a pool this one does not serve: its load moves nothing
    ],
)
async def test_a_lone_replica_shares_its_load_once_a_tick_and_one_among_others_more_often(
    others: int,
    held: int,
    served: bool,
    idle_every_s: float,
    shares: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Alone as last heard, a replica tells no one of each pass, only of each tick; beside
    another, where none holds a request, it shares before a pass every
    ``IDLE_SHARE_EVERY_S`` at most (0: before every one); while the other holds one in a
    pool this one serves, before every pass."""
    monkeypatch.setattr("gateway.admission.IDLE_SHARE_EVERY_S", idle_every_s)
    shared: list[str] = []

    async def loads(own: str, _slots: Mapping[str, SlotClaim]) -> AdmissionLoads:
        shared.append(own)
        load = json.dumps({f"{MODEL}/dc-a": {"interactive": [1, 0, held, 0.0, None]}})
        return AdmissionLoads([load] * others, {})

    host = slomax_host(loads, tick_s=5.0)
    await host.join()  # hears of the others
    if served:
        await host.open_pool(MODEL, "dc-a")
    shared.clear()
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
    assert passes == shares


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

    host = slomax_host(loads)
    assert isinstance(document(host)[1], Admitted)
    await host.share_loads()
    assert claims.pop() == SlotClaim(running=1, wanted=4, limit=4)
    peers.append(json.dumps({f"{MODEL}/dc-a": {}}))  # another replica, holding nothing
    granted = 1
    await host.share_loads()
    assert claims.pop() == SlotClaim(running=1, wanted=4, limit=4)  # as yet alone
    _, held = document(host)
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
    host = slomax_host(loads, quotas)
    await host.join()
    await host.open_pool(MODEL, "dc-a")
    assert claims == [SlotClaim(running=0, wanted=1, limit=2)]
    assert isinstance(document(host, quotas)[1], Admitted)
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

    host = slomax_host(loads, heard_for_s=0.2)
    await host.join()
    await host.open_pool(MODEL, "dc-a")
    failing = True
    await host.join()
    assert (host.replicas, host.pipeline(MODEL, "dc-a").slots) == (2, {TaskClass.LONG_DOCUMENT: 1})
    await asyncio.sleep(0.25)
    await host.join()
    assert (host.replicas, host.pipeline(MODEL, "dc-a").slots) == (1, None)


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
        arrivals.extend(document(a)[1] for _ in range(arriving))  # while the claim is away
        return await states[0].admission_loads(own, slots)

    a, b = slomax_host(loads_a), slomax_host(states[1].admission_loads)

    async def settle(*hosts: GatewayAdmission) -> None:
        for host in hosts:
            await host.share_loads()
            await host.release_pass()

    def running(host: GatewayAdmission) -> int:
        return sum(host.pipeline(MODEL, "dc-a").inflight.values())

    try:
        await a.join()
        await b.join()
        assert isinstance(document(b)[1], Admitted)  # alone: its own ceiling
        await settle(b)
        first = [document(a) for _ in range(3)]  # alone too, as far as it knows
        await settle(a, b, b, a)  # each hears of the other and claims beside it
        assert (a.replicas, b.replicas, running(a), running(b)) == (2, 2, 3, 1)
        for inbound, _ in first[:2]:
            a.finished(inbound, "dc-a")
        arriving = 3
        await settle(a)
        assert [type(w) for w in arrivals] == [Admitted, Waiting, Waiting]
        assert isinstance(document(b)[1], Waiting)  # no slot to spare
        await settle(b)
        assert (running(a), running(b)) == (2, 2)
    finally:
        for state in states:
            await state.close()

"""How the gateway, as the edge, prices each DC's load for FleetMind: its requests in
flight, held and on their way, the pace its goodput table shows, its ready instances,
the room its admission leaves a class, and where a prompt went lately."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from control.fleet.fleetmind import FleetMind, FleetMindParams
from gateway.fleet_view import TABLES_STALE_S
from schemas import Envelope
from schemas.base import TaskClass
from schemas.tables import GoodputTable
from streams.tables.goodput import GoodputCounts
from tests.dc_harness import Gate, ask, two_dcs
from tests.gateway_harness import (
    MODEL,
    Gateway,
    chat,
)


async def test_work_in_flight_at_home_sends_the_next_request_abroad() -> None:
    """At one request a second per instance, a request in flight in dc-a is a second of
    backlog there, more than dc-b's 80 ms round trip; unpriced, both would run at home."""
    served: list[str] = []
    gate = Gate()
    async with two_dcs(served, rps_per_instance=1.0, gate=gate) as front, front.client() as http:
        first = asyncio.create_task(ask(http))
        await asyncio.wait_for(gate.reached.wait(), 5)
        second = await ask(http)
        gate.opened.set()
        assert (await first).status_code == 200
    assert second.status_code == 200
    assert served == ["dc-a", "dc-b"]


async def test_a_queue_drains_at_the_pace_its_dc_s_goodput_table_shows() -> None:
    """Both DCs report a queue (each as busy as the load cap reads without the operator's
    figure): 3 requests in dc-a's, 1 in dc-b's. At the assumed request a second an
    instance, dc-a's is 3 s of backlog, more than dc-b's second and its 80 ms round trip.
    A stale table changes nothing; a fresh one where dc-a completed 100 requests of the
    model a second makes its queue 30 ms, and the next request stays home."""
    served: list[str] = []
    async with two_dcs(served, queues=(3, 1)) as front, front.client() as http:
        assert (await ask(http)).status_code == 200
        await _publish_pace(front, version=1, ended_s_ago=TABLES_STALE_S + 5)
        assert (await ask(http)).status_code == 200
        await _publish_pace(front, version=2, ended_s_ago=1.0)
        assert (await ask(http)).status_code == 200
    assert served == ["dc-b", "dc-b", "dc-a"]


async def test_a_queue_drains_at_the_assumed_pace_of_each_ready_instance() -> None:
    """Without the operator's figure or a table, each instance of both DCs reports a
    request waiting: dc-a's two are a second of backlog at the assumed request a second
    an instance, less than dc-b's one and its 80 ms round trip (counted as one instance,
    dc-a's two would be two seconds)."""
    served: list[str] = []
    async with two_dcs(served, queues=(1, 1), at_home=2) as front, front.client() as http:
        assert (await ask(http)).status_code == 200
    assert served == ["dc-a"]


async def _publish_pace(front: Gateway, version: int, ended_s_ago: float) -> None:
    """Publish dc-a's goodput table: 6,000 completions of the model, and of another, in
    the minute up to ``ended_s_ago``; wait for the gateway to hold it."""
    end = time.time() - ended_s_ago
    table = GoodputTable(
        dc="dc-a",
        version=version,
        window_start=end - 60,
        window_end=end,
        classes=(),
        tenants=(),
        models=tuple(GoodputCounts(completed=6000).row(m, 60) for m in (MODEL, "other")),
    )
    gateway = front.app.state.gateway
    await gateway.parts.bus.publish_event(Envelope.wrap(table, source="test"))
    for _ in range(100):  # held: as of its window's end, its pace reads
        if gateway.view.completed_per_s(MODEL, "dc-a", now=end) == 100:
            return
        await asyncio.sleep(0.02)
    pytest.fail("the gateway never took the table")


async def test_a_prompt_is_warm_in_the_dc_it_went_to_last(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The edge remembers where each prompt went: a long prompt that had to run in dc-b
    (its residency) is warm there, and FleetMind pricing a warm token's prefill sends the
    same prompt there again, 80 ms away, where a cold one stays home."""
    served: list[str] = []
    async with two_dcs(served) as front, front.client() as http:
        priced = FleetMindParams(prefill_s_per_token=1e-3)
        monkeypatch.setattr(front.app.state.gateway.decider, "dc_policy", FleetMind(priced))
        long = chat("the same long prompt " * 100)
        for body, headers in (
            (long, {"x-tokenfleet-residency": "us-east"}),
            (long, {}),
            (chat("another prompt " * 100), {}),
        ):
            answer = await http.post("/v1/chat/completions", json=body, headers=headers)
            assert answer.status_code == 200
    assert served == ["dc-b", "dc-b", "dc-a"]


async def test_requests_held_in_a_dc_count_as_its_work_in_flight(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Three requests held in dc-a's pools are three seconds of backlog there at one
    request a second per instance, as the simulator's edge counts them: the next one
    goes to dc-b, 80 ms away."""
    served: list[str] = []
    async with two_dcs(served, rps_per_instance=1.0) as front, front.client() as http:
        _hold_chats_in_dc_a(front, monkeypatch, 3)
        assert (await ask(http)).status_code == 200
    assert served == ["dc-b"]


async def test_a_request_its_dc_has_not_admitted_yet_counts_in_that_dc_s_backlog(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The first request's DC is chosen and its admission waits (on a gate here; live, for
    the decision lock or for Redis): at one request a second an instance, it is a second
    of backlog in dc-a for the request choosing next, which goes to dc-b."""
    served: list[str] = []
    chosen: list[str] = []
    gate = asyncio.Event()
    async with two_dcs(served, rps_per_instance=1.0) as front, front.client() as http:
        decider = front.app.state.gateway.decider
        open_pool, choose_dcs = decider.admission.open_pool, decider.choose_dcs

        async def gated(model: str, dc: str) -> None:
            await gate.wait()
            await open_pool(model, dc)

        def noted(*args: Any, **kwargs: Any) -> tuple[str, ...]:
            order: tuple[str, ...] = choose_dcs(*args, **kwargs)
            chosen.append(order[0])
            choice.set()
            return order

        monkeypatch.setattr(decider.admission, "open_pool", gated)
        monkeypatch.setattr(decider, "choose_dcs", noted)
        asked = []
        for _ in range(2):
            choice = asyncio.Event()
            asked.append(asyncio.create_task(ask(http)))
            await asyncio.wait_for(choice.wait(), 5)
        gate.set()
        assert [(await a).status_code for a in asked] == [200, 200]
        assert not decider._on_way  # each counted once there, by its DC's admission
    assert chosen == ["dc-a", "dc-b"]
    assert sorted(served) == ["dc-a", "dc-b"]


async def test_a_request_is_on_its_way_to_the_dc_it_falls_back_to_and_no_other(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """dc-a fails the request at once and it goes on to dc-b, whose admission waits:
    meanwhile it is on its way to dc-b alone."""
    served: list[str] = []
    waiting = asyncio.Event()
    gate = asyncio.Event()
    async with two_dcs(served, home_fails=0.0) as front, front.client() as http:
        decider = front.app.state.gateway.decider
        open_pool = decider.admission.open_pool

        async def gated_in_dc_b(model: str, dc: str) -> None:
            if dc == "dc-b":
                waiting.set()
                await gate.wait()
            await open_pool(model, dc)

        monkeypatch.setattr(decider.admission, "open_pool", gated_in_dc_b)
        asked = asyncio.create_task(ask(http))
        await asyncio.wait_for(waiting.wait(), 5)
        on_way = [dc for _, dc, _ in decider._on_way.values()]
        gate.set()
        assert (await asked).status_code == 200
        assert not decider._on_way
    assert on_way == ["dc-b"]


async def test_an_embedding_is_not_on_its_way_while_it_runs() -> None:
    """An embedding is sent by load, with no admission to count it: nothing counts it on
    its way once its instance is picked."""
    served: list[str] = []
    gate = Gate()
    async with two_dcs(served, gate=gate) as front, front.client() as http:
        body = {"model": MODEL, "input": "hi"}
        asked = asyncio.create_task(http.post("/v1/embeddings", json=body))
        await asyncio.wait_for(gate.reached.wait(), 5)
        on_way = dict(front.app.state.gateway.decider._on_way)
        gate.opened.set()
        assert (await asked).status_code == 200
    assert on_way == {}


async def test_chats_held_in_a_dc_take_their_class_s_room_there(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """dc-a's admission runs two chats at once, and holds two: no room for a third, as
    the simulator's edge counts its requests there, held or not (at 1,000 requests a
    second an instance, the two are 2 ms of backlog, less than dc-b's round trip)."""
    served: list[str] = []
    async with two_dcs(served, rps_per_instance=1000.0) as front, front.client() as http:
        admission = _hold_chats_in_dc_a(front, monkeypatch, 2)
        monkeypatch.setattr(admission, "concurrency_limit", lambda *_: 2)  # in every DC
        assert (await ask(http)).status_code == 200
    assert served == ["dc-b"]


def _hold_chats_in_dc_a(front: Gateway, monkeypatch: pytest.MonkeyPatch, held: int) -> Any:
    """Count ``held`` more chats held in dc-a's pools; the admission patched."""
    admission = front.app.state.gateway.decider.admission
    pool_load = admission.pool_load

    def more_held(model: str, dc: str) -> Any:
        inflight, holding, sent = pool_load(model, dc)
        holding[TaskClass.INTERACTIVE] += held * (dc == "dc-a")
        return inflight, holding, sent

    monkeypatch.setattr(admission, "pool_load", more_held)
    return admission

"""The gateway's DC choice (FleetMind on the edge's view): a request runs in its own DC
while it may, in the region its residency names, never in a DC its tenant may not use,
and where the controller's weights send it."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from control.fleet.fleetmind import FleetMind, FleetMindParams
from gateway.fleet_view import TABLES_STALE_S
from gateway.refusals import Refused
from schemas import Envelope, topic_for
from schemas.base import TaskClass
from schemas.control import AdmissionQuotas, ClassQuota, DcWeight, RoutingWeights
from schemas.fleet import FleetConfig
from schemas.lifecycle import RejectReason, RequestFailed, RequestRejected
from schemas.tables import GoodputTable
from streams.tables.goodput import GoodputCounts
from tests.conftest import read_for
from tests.gateway_harness import (
    KEY,
    MODEL,
    PROFILE,
    Gateway,
    chat,
    chat_answer,
    gateway,
    http_server,
    scraped,
    until_ready,
    vllm_metrics,
)

EU_ONLY_KEY = "sk-eu-only"
ON_DEFAULTS = "tokenfleet_gateway_control_defaults"


@dataclass
class Gate:
    """Where an instance holds its answers: ``reached`` once a request waits, answered
    once ``opened``."""

    reached: asyncio.Event = field(default_factory=asyncio.Event)
    opened: asyncio.Event = field(default_factory=asyncio.Event)


def instance(
    served: list[str],
    dc: str,
    gate: Gate | None = None,
    failing: float | None = None,
    garbles: bool = False,
    waiting: int = 0,
) -> Starlette:
    """An instance that answers at once, or once its gate opens, or fails every request
    ``failing`` seconds after it came, or (``garbles``) answers 200 with a body that is
    no JSON; its metrics show ``waiting`` requests in its queue."""

    async def metrics(_: Request) -> Response:
        return vllm_metrics(waiting=waiting, running=0)

    async def answer(_: Request) -> Response:
        served.append(dc)
        if failing is not None:
            await asyncio.sleep(failing)
            return Response("engine dead", status_code=500)
        if garbles:
            return Response("{not json", media_type="application/json")
        if gate is not None:
            gate.reached.set()
            await gate.opened.wait()
        return chat_answer()

    return Starlette(
        routes=[
            Route("/metrics", metrics),
            Route("/v1/chat/completions", answer, methods=["POST"]),
            Route("/v1/embeddings", answer, methods=["POST"]),
            Route("/tokenize", answer, methods=["POST"]),
        ]
    )


@contextlib.asynccontextmanager
async def two_dcs(
    served: list[str],
    rps_per_instance: float | None = None,
    gate: Gate | None = None,
    home_fails: float | None = None,
    chat_ttft_s: float | None = None,
    home_garbles: bool = False,
    queues: tuple[int, int] = (0, 0),
    at_home: int = 1,
    **settings: Any,
) -> AsyncIterator[Gateway]:
    """A gateway in dc-a (eu-west) before ``at_home`` instances there (``i-dc-a``, then
    ``i-dc-a-2`` ...) and one in dc-b (us-east), and a standby instance in dc-a that no
    placement started; ``gate``: dc-a's instances answer only once it opens;
    ``home_fails``: dc-a's fail that many seconds after each request came; ``queues``: the
    queue each instance of dc-a and of dc-b reports; ``chat_ttft_s``: the chats'
    objective; ``settings``: the gateway's."""
    names = [("i-dc-a", "dc-a")]
    names += [(f"i-dc-a-{n}", "dc-a") for n in range(2, at_home + 1)] + [("i-dc-b", "dc-b")]
    async with contextlib.AsyncExitStack() as stack:
        urls = {
            (name, dc): await stack.enter_async_context(
                http_server(
                    instance(
                        served,
                        dc,
                        *((gate, home_fails, home_garbles) if dc == "dc-a" else ()),
                        waiting=queues[dc == "dc-b"],
                    )
                )
            )
            for name, dc in names
        }
        fleet = FleetConfig.model_validate(
            {
                "dcs": [
                    {"name": "dc-a", "region": "eu-west"},
                    {"name": "dc-b", "region": "us-east"},
                ],
                "network": [{"regions": ["eu-west", "us-east"], "rtt_ms": 80}],
                "objectives": {"interactive": {"ttft_s": chat_ttft_s}} if chat_ttft_s else {},
                "models": [
                    {"name": MODEL, "profile": PROFILE, "rps_per_instance": rps_per_instance}
                ],
                "instances": [
                    *(
                        {"id": name, "dc": dc, "url": url, "model": MODEL}
                        for (name, dc), url in urls.items()
                    ),
                    {
                        "id": "spare-a",
                        "dc": "dc-a",
                        "url": "http://127.0.0.1:9",
                        "model": MODEL,
                        "standby": True,
                    },
                ],
                "tenants": [
                    {"name": "anyone", "api_keys": [KEY]},
                    {"name": "eu-only", "api_keys": [EU_ONLY_KEY], "dcs": ["dc-a"]},
                ],
            }
        )
        front = await stack.enter_async_context(gateway(fleet, dc="dc-a", **settings))
        await until_ready(front)
        yield front


async def ask(http: httpx.AsyncClient, **headers: str) -> httpx.Response:
    return await http.post("/v1/chat/completions", json=chat("hi"), headers=headers)


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


async def test_an_edge_in_a_region_without_gpus_sends_every_request_to_a_dc_with_some() -> None:
    """The seed's entry region A, as the fleet benchmark's edge stands in it: a gateway in
    a DC of the fleet file that runs no instance chooses among the others."""
    served: list[str] = []
    async with contextlib.AsyncExitStack() as stack:
        url = await stack.enter_async_context(http_server(instance(served, "dc-b")))
        fleet = FleetConfig.model_validate(
            {
                "dcs": [
                    {"name": "edge-a", "region": "eu-west"},
                    {"name": "dc-b", "region": "eu-central"},
                ],
                "network": [{"regions": ["eu-west", "eu-central"], "rtt_ms": 10}],
                "models": [{"name": MODEL, "profile": PROFILE}],
                "instances": [{"id": "i-dc-b", "dc": "dc-b", "url": url, "model": MODEL}],
                "tenants": [{"name": "anyone", "api_keys": [KEY]}],
            }
        )
        front = await stack.enter_async_context(gateway(fleet, dc="edge-a"))
        await until_ready(front)
        async with front.client() as http:
            assert (await ask(http)).status_code == 200
    assert served == ["dc-b"]


async def test_a_dc_that_fails_a_request_before_its_first_token_passes_it_to_the_next() -> None:
    served: list[str] = []
    async with two_dcs(served, home_fails=0.0) as front, front.client() as http:
        moved = await ask(http)
        fallbacks = await scraped(front.url, "tokenfleet_gateway_dc_fallbacks_total", dc="dc-a")
        events = await read_for(
            front.app.state.gateway.parts.bus, topic_for(RequestFailed).name, 0.5
        )
    assert moved.status_code == 200
    assert served == ["dc-a", "dc-b"]
    assert fallbacks == 1
    assert not [e for e in events if isinstance(e, RequestFailed)]  # it did not fail


async def test_the_last_dc_s_failure_is_the_answer() -> None:
    served: list[str] = []
    async with two_dcs(served, home_fails=0.0) as front, front.client() as http:
        kept = await ask(http, **{"x-tokenfleet-residency": "eu-west"})  # nowhere else to go
        events = await read_for(
            front.app.state.gateway.parts.bus, topic_for(RequestFailed).name, 0.5
        )
    assert kept.status_code == 502
    assert served == ["dc-a"]
    [failed] = [e for e in events if isinstance(e, RequestFailed)]  # reported once
    assert failed.instance_id == "i-dc-a"
    assert failed.request_id == kept.headers["x-tokenfleet-request-id"]  # errors carry it too


async def test_a_dc_with_no_instance_ready_when_it_decides_passes_the_request_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """dc-a was chosen, and its one instance failed another request before this one's
    decision (its cooldown keeps it out): admitting all (SLOMax would hold it), dc-a's
    router finds none ready, and the next DC serves it rather than a 503."""
    served: list[str] = []
    async with two_dcs(served, admission="fcfs") as front, front.client() as http:
        gateway = front.app.state.gateway
        monkeypatch.setattr(gateway.decider, "choose_dcs", lambda *_, **__: ("dc-a", "dc-b"))
        gateway.view.failed("i-dc-a")
        moved = await ask(http)
        fallbacks = await scraped(front.url, "tokenfleet_gateway_dc_fallbacks_total", dc="dc-a")
    assert moved.status_code == 200, moved.text
    assert served == ["dc-b"]
    assert fallbacks == 1


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


@pytest.mark.parametrize(("failure", "second"), [("fails", 503), ("garbles", 429)])
async def test_a_request_every_instance_failed_gives_its_quota_tokens_back(
    failure: str, second: int
) -> None:
    """Failed before its first token (502), the request got no answer: its tokens go back
    to the bucket, and its client's retry passes the quota it already paid (then dc-a's
    instance, which failed the first, cools down: 503). One whose instance generated a
    whole answer that could not be read ran, and keeps them: the retry meets the quota."""
    served: list[str] = []
    fails, garbles = (0.0 if failure == "fails" else None), failure == "garbles"
    async with (
        two_dcs(served, home_fails=fails, home_garbles=garbles) as front,
        front.client() as http,
    ):
        quota = ClassQuota(task_class=TaskClass.INTERACTIVE, tokens_per_s=0.001, burst_tokens=1)
        quotas = AdmissionQuotas(
            scope="dc-a", version=1, issued_at=time.time(), ttl_s=60, quotas=(quota,)
        )
        gateway = front.app.state.gateway
        await gateway.parts.bus.publish_event(Envelope.wrap(quotas, source="test"))
        for _ in range(250):
            if gateway.decider.quotas.current("dc-a"):
                break
            await asyncio.sleep(0.02)
        home = {"x-tokenfleet-residency": "eu-west"}  # dc-a alone, whose instance fails
        answers = [(await ask(http, **home)).status_code for _ in range(2)]
    assert answers == [502, second]


async def test_a_request_too_late_after_its_dc_failed_is_refused_as_the_fleet_s_doing() -> None:
    """dc-a fails the chat after 0.4 s, past its 0.2 s first-token objective, so dc-b
    refuses it (SLOMax's predicted TTFT); the client sees a 503 naming both, not the 429
    "retry later" that a refusal at the door gets. Failed at once, it runs in dc-b."""
    served: list[str] = []
    async with two_dcs(served, home_fails=0.0, chat_ttft_s=0.2) as front, front.client() as http:
        assert (await ask(http)).status_code == 200
    assert served == ["dc-a", "dc-b"]
    served.clear()
    async with two_dcs(served, home_fails=0.4, chat_ttft_s=0.2) as front, front.client() as http:
        late = await ask(http)
        events = await read_for(
            front.app.state.gateway.parts.bus, topic_for(RequestRejected).name, 0.5
        )
    assert late.status_code == 503
    message = late.json()["error"]["message"]
    assert "DC dc-a failed it before the first token" in message
    assert "DC dc-b then refused it" in message
    assert "(predicted_ttft)" in message
    assert served == ["dc-a"]
    [rejected] = [e for e in events if isinstance(e, RequestRejected)]
    assert rejected.reason is RejectReason.DEADLINE
    assert rejected.dc == "dc-b"  # dc-b's tables count it as a failure there


async def test_a_request_the_stopping_gateway_answers_is_sent_to_no_other_dc(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Held in dc-a when the gateway stops, it gets the stop's 503 at once: sent on to
    dc-b, it would keep the stop waiting for its answer."""
    served: list[str] = []
    async with two_dcs(served) as front, front.client() as http:
        exchange = front.app.state.gateway.exchange
        serve, asked = exchange.serve, []

        async def stopping_in_dc_a(inbound: Any, dc: str, *rest: Any) -> Any:
            asked.append(dc)
            if dc == "dc-a":  # as ``GatewayAdmission.close`` answers a held request
                stop = "The gateway is stopping; send the request again."
                raise Refused(503, stop, RejectReason.NO_CAPACITY, 1.0, stopping=True)
            return await serve(inbound, dc, *rest)

        monkeypatch.setattr(exchange, "serve", stopping_in_dc_a)
        answer = await ask(http)
        events = await read_for(
            front.app.state.gateway.parts.bus, topic_for(RequestRejected).name, 0.5
        )
    assert answer.status_code == 503
    assert answer.headers["retry-after"] == "1"
    assert (asked, served) == (["dc-a"], [])
    [rejected] = [e for e in events if isinstance(e, RequestRejected)]
    assert rejected.dc is None  # the stop's doing, not dc-a's: in no DC's table


async def test_a_request_runs_at_home_unless_its_residency_or_tenant_says_otherwise() -> None:
    served: list[str] = []
    async with two_dcs(served) as front, front.client() as http:
        assert (await ask(http)).status_code == 200
        us = await ask(http, **{"x-tokenfleet-residency": "us-east"})
        assert us.status_code == 200
        async with front.client(EU_ONLY_KEY) as eu_only:
            refused = await ask(eu_only, **{"x-tokenfleet-residency": "us-east"})
        assert served == ["dc-a", "dc-b"]
    assert refused.status_code == 503
    message = refused.json()["error"]["message"]
    assert "dc-a (residency)" in message
    assert "dc-b (permission)" in message
    events = await read_for(front.app.state.gateway.parts.bus, topic_for(RequestRejected).name, 0.5)
    [rejected] = [m for m in events if isinstance(m, RequestRejected)]
    assert rejected.reason is RejectReason.RESIDENCY
    assert rejected.dc is None  # refused before any DC took it: in no DC's table


async def test_a_tokenize_call_keeps_to_its_residency_and_its_tenant_s_dcs() -> None:
    """A call passed through to an instance carries the prompt's text too: it goes only
    where the request's residency and its tenant allow, and a residency header that names
    no region is refused rather than read as none."""
    served: list[str] = []
    text = {"model": MODEL, "prompt": "hello"}
    async with two_dcs(served) as front, front.client() as http:
        us = await http.post("/tokenize", json=text, headers={"x-tokenfleet-residency": "us-east"})
        async with front.client(EU_ONLY_KEY) as eu_only:
            refused = await eu_only.post(
                "/tokenize", json=text, headers={"x-tokenfleet-residency": "us-east"}
            )
        blank = await http.post("/tokenize", json=text, headers={"x-tokenfleet-residency": ", ,"})
        blank_chat = await ask(http, **{"x-tokenfleet-residency": ","})
    assert us.status_code == 200
    assert served == ["dc-b"]
    assert refused.status_code == 503
    assert "dc-a (residency)" in refused.json()["error"]["message"]
    assert (blank.status_code, blank_chat.status_code) == (400, 400)
    assert blank_chat.json()["error"]["param"] == "x-tokenfleet-residency"


@pytest.mark.parametrize("dc_policy", ["gcp_waterfall", "envoy_priority_failover"])
async def test_a_standby_instance_no_placement_started_is_not_a_host_the_dc_lacks(
    dc_policy: str,
) -> None:
    """dc-a runs its one instance and keeps one on standby: it is whole, so the baselines
    that judge a DC by its healthy share keep its requests home (counted as a host, the
    standby would have made dc-a half healthy: GCP's waterfall would fail it over, and
    Envoy's levels spill part of its traffic)."""
    served: list[str] = []
    async with two_dcs(served, dc_policy=dc_policy) as front, front.client() as http:
        for _ in range(8):
            assert (await ask(http)).status_code == 200
    assert served == ["dc-a"] * 8


async def test_the_controller_s_weights_hold_until_their_ttl_then_safe_defaults() -> None:
    """A controller gone quiet: its last weights hold while they live, then every DC
    counts whole again (and the gateway says it runs on defaults)."""
    served: list[str] = []
    async with two_dcs(served) as front, front.client() as http:
        await _drain_dc_a(front, ttl_s=1.5)
        assert (await ask(http)).status_code == 200
        draining = await scraped(front.url, ON_DEFAULTS, kind="weights")
        await asyncio.sleep(1.6)  # no newer weights came: they expire
        assert (await ask(http)).status_code == 200
        defaults = await scraped(front.url, ON_DEFAULTS, kind="weights")
    assert served == ["dc-b", "dc-a"]  # weight 0: dc-a counts as full; then home again
    assert (draining, defaults) == (0, 1)


async def test_weights_for_one_class_move_that_class_alone() -> None:
    """Weights per class (the controller's ``per_class``): dc-a drained for chats only."""
    served: list[str] = []
    async with two_dcs(served) as front, front.client() as http:
        await _drain_dc_a(front, ttl_s=30.0, task_class=TaskClass.INTERACTIVE)
        assert (await ask(http)).status_code == 200
        assert (await ask(http, **{"x-tokenfleet-class": "batch"})).status_code == 200
    assert served == ["dc-b", "dc-a"]


async def _drain_dc_a(front: Gateway, ttl_s: float, task_class: TaskClass | None = None) -> None:
    """Publish weights that count on none of dc-a's capacity (for ``task_class``; None:
    every class), and wait for the gateway to hold them."""
    weights = RoutingWeights(
        scope="dc-a",
        version=1,
        issued_at=time.time(),
        ttl_s=ttl_s,
        weights=tuple(
            DcWeight(model=MODEL, dc=dc, weight=w, task_class=task_class)
            for dc, w in (("dc-a", 0.0), ("dc-b", 1.0))
        ),
    )
    await front.app.state.gateway.parts.bus.publish_event(Envelope.wrap(weights, source="test"))
    for _ in range(100):
        if front.app.state.gateway.decider.weights.current("dc-a"):
            return
        await asyncio.sleep(0.02)
    pytest.fail("the gateway never took the weights")

"""The gateway's DC choice (FleetMind on the edge's view): a request runs in its own DC
while it may, in the region its residency names, never in a DC its tenant may not use,
and where the controller's weights send it."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import pytest

from gateway.refusals import Refused
from schemas import Envelope, topic_for
from schemas.base import TaskClass
from schemas.control import AdmissionQuotas, ClassQuota, DcWeight, RoutingWeights
from schemas.fleet import FleetConfig
from schemas.lifecycle import RejectReason, RequestFailed, RequestRejected
from tests.conftest import read_for
from tests.dc_harness import EU_ONLY_KEY, ask, instance, two_dcs
from tests.gateway_harness import (
    KEY,
    MODEL,
    PROFILE,
    Gateway,
    gateway,
    http_server,
    scraped,
    until_ready,
)

ON_DEFAULTS = "tokenfleet_gateway_control_defaults"


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


@pytest.mark.parametrize(("failure", "second"), [("fails", 502), ("garbles", 429)])
async def test_a_request_every_instance_failed_gives_its_quota_tokens_back(
    failure: str, second: int
) -> None:
    """Failed before its first token (502), the request got no answer: its tokens go back
    to the bucket, and its client's retry passes the quota it already paid (and fails
    again: one 500 does not leave the instance out). One whose instance generated a
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

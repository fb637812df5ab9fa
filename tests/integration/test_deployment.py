"""The whole control plane as ``tokenfleet up`` deploys it, one process per part, on a
real broker and a real Redis server: traffic through the edge closes the loop (events,
tables, controllers, gateways), survives a broker restart without losing a lifecycle
event (by ``event_id``, against what the gateways count as published), sends fewer chats
to an overloaded DC and lowers its weight, falls back when a DC goes away, and keeps a
silent controller's last controls until their TTL, then the safe defaults."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from schemas.control import ControlSnapshot, PlacementRecommendation
from schemas.fleet import load_fleet
from schemas.lifecycle import RequestArrived, RequestCompleted, RequestFailed
from schemas.openai_api import REQUEST_ID_HEADER
from schemas.topics import JOURNAL_TOPIC, topic
from streams.kafka import KafkaBus, create_topics
from tests.conftest import read_for, run_in_thread
from tests.gateway_harness import scraped
from tests.integration.test_closed_loop import _running
from tests.local_fleet import fleet_on_free_ports, parts_ports
from tests.services import Service
from tokenfleet.audit import audit_journal, journals_in
from tokenfleet.deployment import Deployment, Part, plan
from tokenfleet.loop_status import loop_checks, read_broker, verdict
from tokenfleet.services.kafka import LocalKafka

pytestmark = [pytest.mark.kafka, pytest.mark.redis]

PERIOD_S, TTL_S, LONG_CYCLE_S, WEIGHTS_MIN_OUTCOMES = 1.0, 8.0, 4.0, 5
"""The controllers' period, their snapshots' TTL (renewed every third of it), the period
of FleetMind's long cycle (placements for dc-b, which holds a standby server), and the
fewest chats ended in a DC in a window of the tables for its weight to move. With the
default, 30, dc-a would not be judged while it is overloaded: the edge sends it about 5 %
of its 8 chats a second then, some 4 a window of 10 s; FleetMind acts as the window fills
with the overload, while the chats sent at its start still count."""
TABLES = {
    "TOKENFLEET_WORKER_WINDOW_S": "10",
    "TOKENFLEET_WORKER_SLIDE_S": "1",
    "TOKENFLEET_WORKER_GRACE_S": "1",
    "TOKENFLEET_WORKER_PUBLISH_S": "1",
}
"""Tables over 10 s, published every second: the loop turns in seconds, not minutes."""
LOOP_BOUND_S = 20.0
"""From a moment on (the first request, the broker back) to every DC's tables and
controls made after it: the parts' reconnecting, a slide of the tables, a controller's
pass and the renewal of unchanged controls (a third of their TTL)."""
EVERY_S = 0.125
"""A chat every 0.125 s. At 0.1 s, before the pause below, one chat was refused (SLOMax's
predicted TTFT) in one run of two; dc-b and dc-c then serve nearly all of them while dc-a
is overloaded, against a stated capacity of 5 requests/s an instance."""
OVERLOAD_PROMPT_TOKENS, OVERLOAD_IN_FLIGHT = 30_000, 2
"""The overload: two prompts of 30,000 tokens in flight on each of dc-a's instances (each
prefilled in about 0.6 s, in chunks of 8,192 tokens a step on the emulated profile), so a
chat there waits for a prefill to end and then shares steps of about 0.18 s. With one,
between one prompt's end and the next one's start, some chats still met their objective:
in two runs of three, too few missed for FleetMind to act in the overload's 16 s. With
four (two runs, before the pause below), dc-a kept 3 to 4 % of the chats, and 6 and 11
were refused (SLOMax's predicted TTFT)."""
SETTLE_S = 5.0
"""From the overload's end to dc-a's loss: the chats still waiting there behind the long
prompts finish first. One in flight at the loss, already past its first-token objective,
would be refused by the next DC (SLOMax's early rejection): seen once in CI and, at a chat
every 150 ms, in three runs of three beside a busy loop, without this pause; with it,
three runs beside a busy loop passed."""
OVERLOAD_S = 20.0
"""How long the overload of the edge's own DC lasts; its second half is judged. dc-a's
weight fell 8.1 to 9.6 s into it in six runs (four beside a busy loop), as the tables'
window of 10 s filled with it."""
ON_DEFAULTS = "tokenfleet_gateway_control_defaults"
EVENTS_PUBLISHED = "tokenfleet_gateway_events_published_total"
LIFECYCLE_TOPICS = ("tf.requests", "tf.completions", "tf.cancellations")
LIFECYCLE_TYPES = tuple(
    message.schema_name for name in LIFECYCLE_TOPICS for message in topic(name).messages
)


Weighed = tuple[float, float, float | None, int]
"""Seconds into a phase; a DC's weight, its chats' compliance in its goodput table (None:
no row), and how many of those chats ended in the table's window."""


@dataclass
class Deployed:
    edge: str
    controller: str
    broker: LocalKafka
    deployment: Deployment
    dcs: list[str]
    instances: dict[str, list[str]]
    """The URLs of each DC's instances (those not on standby)."""
    gateways: list[str]
    """Every DC's gateway, the edge's included."""

    @property
    def bootstrap(self) -> str:
        return self.broker.bootstrap


@pytest.fixture
def deployed(own_broker: LocalKafka, redis_server: Service, tmp_path: Path) -> Iterator[Deployed]:
    fleet_file = fleet_on_free_ports(tmp_path / "fleet.toml")
    fleet = load_fleet(fleet_file)
    env = os.environ | TABLES
    env |= {
        "TOKENFLEET_KAFKA_BOOTSTRAP": own_broker.bootstrap,
        "TOKENFLEET_REDIS_URL": redis_server.address,
        "TOKENFLEET_GATEWAY_REDIS_PREFIX": f"tf-{uuid.uuid4().hex[:8]}:",
    }
    run_in_thread(create_topics(own_broker.bootstrap))
    ports = parts_ports()
    controllers = {"period_s": PERIOD_S, "ttl_s": TTL_S, "long_cycle_s": LONG_CYCLE_S}
    controllers |= {"weights_min_outcomes": WEIGHTS_MIN_OUTCOMES}
    parts = plan(fleet, str(fleet_file), **ports, **controllers)
    deployment = Deployment(tmp_path / "up")
    deployment.start(parts, env)
    try:
        urls = {p.name: p.url or "" for p in parts}
        dcs = [d.name for d in fleet.dcs]
        instances = {
            dc: [str(i.url).rstrip("/") for i in fleet.local_instances(dc) if not i.standby]
            for dc in dcs
        }
        gateways = [url for name, url in urls.items() if name.startswith("gateway-")]
        yield Deployed(
            urls["gateway-dc-a"],
            urls["controller"],
            own_broker,
            deployment,
            dcs,
            instances,
            gateways,
        )
    finally:
        _print_logs(deployment, parts)
        deployment.stop()


def _print_logs(deployment: Deployment, parts: tuple[Part, ...]) -> None:
    """Each part's log tail, for a failure's report."""
    for part in parts:
        log = deployment.home / part.name / "server.log"
        if log.exists():
            print(f"--- {part.name}\n{log.read_text(errors='replace')[-1500:]}")


@dataclass
class Traffic:
    """Chats through the edge, one every ``EVERY_S``, about every other one streamed,
    each answer recorded."""

    edge: str
    answers: list[tuple[float, int, str, str]] = field(default_factory=list)
    """(sent at, status, request id, DC that served it) per request."""
    errors: list[str] = field(default_factory=list)
    """The body of each answer that was not a 200, for a failure's report."""

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        headers = {"authorization": "Bearer sk-demo"}
        async with httpx.AsyncClient(base_url=self.edge, headers=headers, timeout=60) as http:
            sender = asyncio.create_task(self._send(http))
            try:
                yield
            finally:
                sender.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await sender
                await asyncio.sleep(3.0)  # the last answers (they are their own tasks)

    async def _send(self, http: httpx.AsyncClient) -> None:
        async with asyncio.TaskGroup() as group:
            while True:
                group.create_task(self._one(http))
                await asyncio.sleep(EVERY_S)

    async def _one(self, http: httpx.AsyncClient) -> None:
        sent = time.monotonic()
        body = {"model": "emulated", "messages": [{"role": "user", "content": "hi"}]}
        body |= {"max_tokens": 4, "stream": len(self.answers) % 2 == 0}  # whole and streamed
        response = await http.post("/v1/chat/completions", json=body)
        request_id = response.headers.get(REQUEST_ID_HEADER, "")
        dc = response.headers.get("x-tokenfleet-dc", "")
        self.answers.append((sent, response.status_code, request_id, dc))
        if response.status_code != 200:
            self.errors.append(response.text)

    def since(self, at: float) -> list[tuple[float, int, str, str]]:
        return [answer for answer in self.answers if answer[0] >= at]


async def until_closed(bootstrap: str, dcs: list[str], since: float, within_s: float) -> float:
    """Seconds from ``since`` (wall clock) until every DC has tables and controls (quotas
    and weights) made after it, the tables fresh; fails saying what is missing if that
    takes longer than ``within_s``."""
    why = ""
    every = {(f"tf.control.{kind}", dc) for kind in ("quotas", "weights") for dc in dcs}
    while (now := time.time()) - since < within_s:
        with contextlib.suppress(Exception):  # the broker may be coming back
            latest = (await read_broker(bootstrap)).latest
            checks = loop_checks(latest, now, stale_after_s=now - since, only=dcs)
            closed, why = verdict(checks)
            renewed = {
                (topic, scope)
                for topic, snapshots in latest.items()
                for scope, envelope in snapshots.items()
                if isinstance(envelope.payload, ControlSnapshot)
                and envelope.payload.issued_at >= since
            }
            if closed and every <= renewed:
                return now - since
            why = why if not closed else f"no controls since: {sorted(every - renewed)}"
        await asyncio.sleep(0.5)
    raise AssertionError(f"the loop did not close within {within_s:.0f} s: {why}")


async def defaults_applied(edge: str) -> dict[str, float]:
    return {kind: await scraped(edge, ON_DEFAULTS, kind=kind) for kind in ("quotas", "weights")}


async def until_applied(edge: str, since: float, within_s: float) -> float:
    """Seconds from ``since`` (wall clock) until the edge decides on the controllers'
    quotas and weights rather than the defaults: the gateways read the controls from the
    broker after the controller published them, and the gauge moves at a request's
    decision, so this trails ``until_closed`` by a read and a request."""
    while (applied := await defaults_applied(edge)) != {"quotas": 0.0, "weights": 0.0}:
        assert time.time() - since < within_s, f"the edge still on defaults: {applied}"
        await asyncio.sleep(0.2)
    return time.time() - since


async def test_the_deployed_loop_closes_and_survives_a_broker_restart_a_lost_dc_and_a_silent_controller(  # noqa: E501
    deployed: Deployed,
) -> None:
    traffic = Traffic(deployed.edge)
    async with traffic.running():
        first = time.time()
        closed_s = await until_closed(deployed.bootstrap, deployed.dcs, first, LOOP_BOUND_S)
        applied_s = await until_applied(deployed.edge, first, LOOP_BOUND_S)
        print(f"loop closed {closed_s:.1f} s after the first request, applied {applied_s:.1f} s")
        await _the_operators_view_shows_every_dc(deployed)

        await asyncio.to_thread(deployed.broker.stop)  # under load: the gateways buffer
        await asyncio.sleep(2.0)
        await asyncio.to_thread(deployed.broker.start)
        back = time.time()
        reclosed_s = await until_closed(deployed.bootstrap, deployed.dcs, back, LOOP_BOUND_S)
        print(f"loop closed again {reclosed_s:.1f} s after the broker's restart")

        await _an_overloaded_dc_gets_fewer_chats_and_loses_weight(deployed, traffic)
        await asyncio.sleep(SETTLE_S)

        await asyncio.to_thread(deployed.deployment.stop_parts, ["emulate-dc-a"])
        home_lost = time.monotonic()
        await asyncio.sleep(6.0)
        after_loss = traffic.since(home_lost)
        assert after_loss
        assert all(status == 200 for _, status, _, _ in after_loss), after_loss
        assert {dc for _, _, _, dc in after_loss} <= {"dc-b", "dc-c"}

        silent = time.monotonic()
        await asyncio.to_thread(deployed.deployment.stop_parts, ["controller"])
        await asyncio.sleep(max(0.0, TTL_S * 2 / 3 - 1.0 - (time.monotonic() - silent)))
        assert await defaults_applied(deployed.edge) == {"quotas": 0.0, "weights": 0.0}
        while await defaults_applied(deployed.edge) != {"quotas": 1.0, "weights": 1.0}:
            assert time.monotonic() - silent < TTL_S + 5.0, "the controls outlived their TTL"
            await asyncio.sleep(0.5)
        print(f"safe defaults {time.monotonic() - silent:.1f} s after the controller stopped")
    await _every_answer_has_its_lifecycle_events(deployed.bootstrap, traffic)
    await _every_event_published_is_on_its_topic(deployed)
    await _every_journaled_decision_is_made_again(deployed.bootstrap)
    await _placements_were_published_for_the_dc_with_a_standby_server(deployed.bootstrap)


async def _an_overloaded_dc_gets_fewer_chats_and_loses_weight(
    deployed: Deployed, traffic: Traffic
) -> None:
    """Long prompts sent straight to dc-a's instances (traffic the gateways do not carry)
    slow the chats there; the edge, pricing each DC's load by its own requests in flight
    there (more, as they slow), sends a smaller share of its chats to dc-a while every chat
    is still answered. The chats that still end there miss their objective (a token every
    0.1 s at most, against steps of about 0.18 s), the goodput table shows it, and FleetMind
    lowers dc-a's weight."""
    started = time.monotonic()
    before = _served_by(traffic.since(started - 10.0), "dc-a")
    assert before > 0.3, f"dc-a, the edge's own DC, served {before:.2f} of its chats unloaded"
    async with _overloading(deployed.instances["dc-a"]):
        weights = await _chats_weighed(deployed.controller, "dc-a", OVERLOAD_S)
    during = [a for a in traffic.since(started + OVERLOAD_S / 2) if a[0] < started + OVERLOAD_S]
    after = _served_by(during, "dc-a")
    print(f"chats served by dc-a: {before:.2f} before the overload, {after:.2f} during it")
    print(f"dc-a's (seconds, weight, chats' compliance, chats ended) in the overload: {weights}")
    assert all(status == 200 for _, status, _, _ in during), during
    assert after < before / 2
    assert min(weight for _, weight, _, _ in weights) < weights[0][1], weights


async def _chats_weighed(controller: str, dc: str, for_s: float) -> list[Weighed]:
    """``dc``'s weight and the chats its table judges it on (their compliance, how many
    ended), as the controller's view shows them, at each change over ``for_s`` seconds."""
    started = time.monotonic()
    seen: list[Weighed] = []
    async with httpx.AsyncClient(base_url=controller) as http:
        while (at := time.monotonic() - started) < for_s:
            now = _weighed((await _shown(http))[dc])
            if not seen or seen[-1][1:] != now:
                seen.append((round(at, 1), *now))
            await asyncio.sleep(0.5)
    return seen


def _weighed(shown: dict[str, Any]) -> tuple[float, float | None, int]:
    """A DC's weight, its chats' compliance and how many of them ended, from its row."""
    chats = next((c for c in shown["classes"] if c["task_class"] == "interactive"), None)
    if chats is None:
        return shown["weight"], None, 0
    ended = chats["completed"] + chats["failures"] + chats["cancellations"]
    compliance = chats["compliance"]  # None where none completed
    return shown["weight"], None if compliance is None else round(compliance, 2), ended


async def _shown(http: httpx.AsyncClient) -> dict[str, Any]:
    """Each DC's row in the controller's view (``/api/state``), by name."""
    return {dc["dc"]: dc for dc in (await http.get("/api/state")).json()["dcs"]}


def _served_by(answers: list[tuple[float, int, str, str]], dc: str) -> float:
    assert answers
    return sum(served == dc for _, _, _, served in answers) / len(answers)


@contextlib.asynccontextmanager
async def _overloading(instances: list[str]) -> AsyncIterator[None]:
    """``OVERLOAD_IN_FLIGHT`` long prompts kept in flight on each instance, each prompt
    new (no cached prefix)."""

    async def keep_one(http: httpx.AsyncClient, url: str) -> None:
        while True:
            prompt = f"{uuid.uuid4().hex} " + "x" * (4 * OVERLOAD_PROMPT_TOKENS)
            body = {"model": "emulated", "prompt": prompt, "max_tokens": 1}
            try:
                response = await http.post(f"{url}/v1/completions", json=body)
                failed = response.status_code != 200
            except httpx.HTTPError:
                failed = True
            if failed:  # not a tight loop beside the traffic's
                await asyncio.sleep(0.1)

    async with httpx.AsyncClient(timeout=120) as http:
        loops = [keep_one(http, url) for url in instances for _ in range(OVERLOAD_IN_FLIGHT)]
        async with _running(*loops):
            yield


async def _every_event_published_is_on_its_topic(deployed: Deployed) -> None:
    """The broker's restart lost none of the lifecycle events the gateways' producers say
    it took, counted by type and by ``event_id`` (a batch sent again after the restart
    may be there twice: consumers deduplicate on the id), and the gateways gave none up."""
    published: Counter[str] = Counter()
    for url in deployed.gateways:
        assert await scraped(url, "tokenfleet_gateway_events_dropped_total") == 0, url
        for name in LIFECYCLE_TYPES:
            published[name] += int(await scraped(url, EVENTS_PUBLISHED, event=name))
    ids: dict[str, set[str]] = defaultdict(set)
    bus = KafkaBus(deployed.bootstrap, source="test")
    try:
        for topic in LIFECYCLE_TOPICS:
            envelopes, undecodable = await bus.read_all(topic)
            assert undecodable == 0
            for envelope in envelopes:
                ids[envelope.payload.schema_name].add(envelope.event_id)
    finally:
        await bus.close()
    on_topics = {name: len(ids[name]) for name in published}
    print(f"lifecycle events published {dict(published)}; on the topics {on_topics}")
    assert published["tf.request.completed"] > 0
    assert all(on_topics[name] >= count for name, count in published.items()), on_topics


async def _placements_were_published_for_the_dc_with_a_standby_server(bootstrap: str) -> None:
    """FleetMind's long cycle, while the controller ran, placed dc-b's replicas: between
    its base deployment (one) and every server it has (two, its standby included)."""
    bus = KafkaBus(bootstrap, source="test")
    try:
        published = await read_for(bus, "tf.control.placement", 5.0)
    finally:
        await bus.close()
    placements = [p for p in published if isinstance(p, PlacementRecommendation)]
    print(f"{len(placements)} placements: {[(p.scope, p.actions) for p in placements][-1:]}")
    assert placements, "FleetMind's long cycle published no placement"
    assert {p.scope for p in placements} == {"dc-b"}
    assert {a.model for p in placements for a in p.actions} == {"emulated"}
    assert all(1 <= a.target_replicas <= 2 for p in placements for a in p.actions)


async def _the_operators_view_shows_every_dc(deployed: Deployed) -> None:
    """The controller's page state and gauges name every DC, its weight and its chats
    (once a table has counted the edge's first completed chats: the loop can close on
    tables made before any chat ended)."""
    shown: dict[str, Any] = {}
    started = time.monotonic()
    async with httpx.AsyncClient(base_url=deployed.controller) as http:
        while time.monotonic() - started < LOOP_BOUND_S:
            shown = await _shown(http)
            if any(row["completed"] for row in shown.get("dc-a", {}).get("classes", [])):
                break
            await asyncio.sleep(EVERY_S)
    assert sorted(shown) == deployed.dcs
    assert all(dc["weight"] == 1.0 for dc in shown.values())
    assert all(dc["capacity"]["ready"] >= 1 for dc in shown.values())
    assert any(row["completed"] for row in shown["dc-a"]["classes"])  # the edge's chats
    gauge = "tokenfleet_controller_weight"
    assert await scraped(deployed.controller, gauge, dc="dc-c") == 1.0


async def _every_journaled_decision_is_made_again(bootstrap: str) -> None:
    """``tokenfleet audit``'s check on what the gateways journaled through it all (the
    broker's restart included): every decision comes out the same from its record."""
    bus = KafkaBus(bootstrap, source="test")
    try:
        envelopes, undecodable = await bus.read_all(JOURNAL_TOPIC)
    finally:
        await bus.close()
    journals, malformed = journals_in(envelopes)
    audits = [audit_journal(name, records) for name, records in journals.items()]
    print(f"{sum(a.decisions for a in audits)} decisions in {len(audits)} journals audited")
    assert (undecodable, malformed) == (0, 0)
    edge = [a for a in audits if "/emulated@" in a.journal and a.decisions]
    assert edge, "no gateway journaled a decision"
    assert [(a.journal, a.problem, a.differences) for a in audits if not a.reproduced] == []


async def _every_answer_has_its_lifecycle_events(bootstrap: str, traffic: Traffic) -> None:
    """Each answered request's arrival and end are on Kafka, the broker's restart
    notwithstanding (the gateways' producers held them and sent them on)."""
    unanswered = [answer for answer in traffic.answers if answer[1] != 200]
    assert not unanswered, f"requests went unanswered: {unanswered}, {traffic.errors}"
    answered = {request_id for _, _, request_id, _ in traffic.answers}
    bus = KafkaBus(bootstrap, source="test")
    try:
        arrived = {
            e.request_id
            for e in await read_for(bus, "tf.requests", 8.0)
            if isinstance(e, RequestArrived)
        }
        ends = await read_for(bus, "tf.completions", 8.0)
    finally:
        await bus.close()
    # A streamed answer cut by the DC's loss after its first token has its headers (200)
    # and an error event in its stream: its end on Kafka is a failure, not a completion.
    ended = {e.request_id for e in ends if isinstance(e, RequestCompleted | RequestFailed)}
    failed = sum(isinstance(e, RequestFailed) for e in ends)
    print(f"{len(answered)} answered; {len(arrived)} arrivals, {len(ended)} ends ({failed} failed)")
    assert answered - arrived == set()
    assert answered - ended == set()

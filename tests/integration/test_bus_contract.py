"""One behaviour suite, run against the in-memory bus and against Kafka on a real broker.

Each test uses keys of its own, so the suite can share one broker (and its topics) with
other tests.
"""

from __future__ import annotations

import asyncio
import base64
import uuid
from collections.abc import AsyncIterator, Callable

import pytest

from schemas import DEADLETTER_TOPIC, Envelope
from schemas.control import AdmissionQuotas
from schemas.deadletter import DeadLetter
from schemas.lifecycle import RequestAdmitted
from streams import EventBus, InMemoryBus, Received, Subscription
from streams.bus import Unpublishable
from streams.kafka import KafkaBus, UnknownTopicError
from tests.conftest import huge_arrival
from tests.services import Service

Predicate = Callable[[Received], bool]


@pytest.fixture(params=["memory", pytest.param("kafka", marks=pytest.mark.kafka)])
async def bus(request: pytest.FixtureRequest) -> AsyncIterator[EventBus]:
    if request.param == "memory":
        implementation: EventBus = InMemoryBus(source="test")
    else:
        service = request.getfixturevalue("kafka")
        implementation = KafkaBus(service.address, source="test")
    yield implementation
    await implementation.close()


def _admitted(request_id: str, queue: str) -> Envelope:
    return Envelope.wrap(RequestAdmitted(request_id=request_id, queue=queue), source="test")


def _quotas(scope: str, version: int) -> Envelope:
    payload = AdmissionQuotas(scope=scope, version=version, issued_at=0.0, ttl_s=30, quotas=())
    return Envelope.wrap(payload, source="test")


async def _collect(events: Subscription, keep: Predicate, count: int) -> list[Received]:
    """The first ``count`` events that ``keep`` accepts; fails after 20 s."""
    found: list[Received] = []
    async with asyncio.timeout(20):
        async for event in events:
            if keep(event):
                found.append(event)
                if len(found) == count:
                    return found
    return found


def _ours(run: str) -> Predicate:
    return lambda event: (event.key or "").startswith(run)


async def test_events_of_one_key_arrive_in_publication_order(bus: EventBus) -> None:
    run = uuid.uuid4().hex
    keys = [f"{run}-{n}" for n in range(5)]
    for step in range(8):
        for key in keys:
            await bus.publish_event(_admitted(key, queue=f"q{step}"))
    async with bus.subscribe("tf.requests") as events:
        received = await _collect(events, _ours(run), 40)
    for key in keys:
        queues = [e.envelope.payload.queue for e in received if e.key == key]
        assert queues == [f"q{step}" for step in range(8)]


async def test_a_subscription_from_latest_sees_only_later_events(bus: EventBus) -> None:
    run = uuid.uuid4().hex
    await bus.publish_event(_admitted(f"{run}-before", "q"))
    async with bus.subscribe("tf.requests", start="latest") as events:
        await bus.publish_event(_admitted(f"{run}-after", "q"))
        received = await _collect(events, _ours(run), 1)
    assert [e.key for e in received] == [f"{run}-after"]


async def test_a_subscription_resumes_from_given_offsets(bus: EventBus) -> None:
    run = uuid.uuid4().hex
    key = f"{run}-k"
    for step in range(4):
        await bus.publish_event(_admitted(key, queue=f"q{step}"))
    async with bus.subscribe("tf.requests") as events:
        first = await _collect(events, _ours(run), 4)
    resume_at = {first[2].partition: first[2].offset}
    async with bus.subscribe("tf.requests", start=resume_at) as events:
        rest = await _collect(events, _ours(run), 2)
    assert [e.envelope.payload.queue for e in rest] == ["q2", "q3"]


async def test_a_compacted_topic_reads_back_the_latest_value_per_key(bus: EventBus) -> None:
    run = uuid.uuid4().hex
    for scope, version in ((f"{run}-a", 1), (f"{run}-b", 1), (f"{run}-a", 2), (f"{run}-c", 1)):
        await bus.publish_event(_quotas(scope, version))
    await bus.publish("tf.control.quotas", f"{run}-c", None)  # a tombstone deletes c
    latest = await bus.read_latest("tf.control.quotas")
    ours = {k: v.payload.version for k, v in latest.items() if k.startswith(run)}
    assert ours == {f"{run}-a": 2, f"{run}-b": 1}


async def test_read_all_gives_every_decodable_event_to_the_end_and_counts_the_rest(
    bus: EventBus,
) -> None:
    run = uuid.uuid4().hex
    await bus.publish("tf.requests", f"{run}-bad", b"{not json")
    for n in range(3):
        await bus.publish_event(_admitted(f"{run}-{n}", f"q{n}"))
    events, undecodable = await bus.read_all("tf.requests")
    ours = [e.payload.queue for e in events if e.payload.request_id.startswith(run)]
    assert sorted(ours) == ["q0", "q1", "q2"]
    assert undecodable >= 1


async def test_undecodable_records_go_to_the_dead_letter_topic(
    bus: EventBus, caplog: pytest.LogCaptureFixture
) -> None:
    """The consumer keeps going, and the operator's log names the record and why."""
    run = uuid.uuid4().hex
    key = f"{run}-k"  # one key, so the bad record is read before the good one
    garbage = b'{"schema": "tf.request.admitted/1", "payload": {"queue": 3}}'
    await bus.publish("tf.requests", key, garbage)
    await bus.publish_event(_admitted(key, "q"))
    with caplog.at_level("WARNING", logger="streams.bus"):
        async with bus.subscribe("tf.requests") as events:
            received = await _collect(events, _ours(run), 1)
    assert [e.envelope.payload.queue for e in received] == ["q"]

    def our_letter(event: Received) -> bool:
        return isinstance(event.envelope.payload, DeadLetter) and event.envelope.payload.key == key

    async with bus.subscribe(DEADLETTER_TOPIC) as letters:
        [letter] = await _collect(letters, our_letter, 1)
    payload = letter.envelope.payload
    assert payload.source_topic == "tf.requests"
    assert "payload.request_id: Field required" in payload.reason
    assert base64.b64decode(payload.raw_b64) == garbage
    assert letter.envelope.event_id == f"tf.requests/{payload.partition}/{payload.offset}"
    ours = f"undecodable record tf.requests[{payload.partition}]@{payload.offset}: "
    [logged] = [r.getMessage() for r in caplog.records if r.getMessage().startswith(ours)]
    assert "payload.request_id: Field required" in logged


async def test_an_auditor_s_read_of_the_latest_values_writes_no_dead_letter(
    bus: EventBus,
) -> None:
    """``tokenfleet recount`` read the tables this way, and wrote letters at each run."""
    run = uuid.uuid4().hex
    await bus.publish("tf.control.quotas", f"{run}-bad", b"{not json")
    await bus.publish_event(_quotas(f"{run}-good", 1))
    latest = await bus.read_latest("tf.control.quotas", auditing=True)
    assert [key for key in latest if key.startswith(run)] == [f"{run}-good"]
    letters, _ = await bus.read_all(DEADLETTER_TOPIC)
    assert not [e for e in letters if e.payload.key == f"{run}-bad"]
    await bus.read_latest("tf.control.quotas")  # a consumer's read letters it
    letters, _ = await bus.read_all(DEADLETTER_TOPIC)
    assert [e for e in letters if e.payload.key == f"{run}-bad"]


async def test_publish_event_routes_by_the_catalog(bus: EventBus) -> None:
    run = uuid.uuid4().hex
    published = _quotas(f"{run}-x", 3)
    await bus.publish_event(published)
    latest = await bus.read_latest("tf.control.quotas")
    assert latest[f"{run}-x"] == published


async def test_an_event_too_large_for_the_bus_fails_its_batch_before_any_is_published(
    bus: EventBus,
) -> None:
    run = uuid.uuid4().hex
    huge = huge_arrival(f"{run}-huge")
    with pytest.raises(Unpublishable) as refused:
        await bus.publish_events([_quotas(f"{run}-before", 1), huge])
    assert refused.value.envelope is huge
    assert f"{run}-before" not in await bus.read_latest("tf.control.quotas")


@pytest.mark.kafka
async def test_kafka_names_a_missing_topic(kafka: Service) -> None:
    bus = KafkaBus(kafka.address)
    with pytest.raises(UnknownTopicError, match=r"tf\.no-such-topic"):
        async with bus.subscribe("tf.no-such-topic"):
            pass

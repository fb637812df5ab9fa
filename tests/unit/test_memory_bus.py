"""The in-process bus lets old records go, as Kafka does, so that a process without Kafka
does not keep every event it ever sent; its readers go on across the trim."""

from __future__ import annotations

import asyncio
import base64

import pytest

import streams.bus
from schemas import Envelope
from schemas.control import AdmissionQuotas
from schemas.deadletter import DeadLetter
from schemas.lifecycle import RequestAdmitted
from streams import InMemoryBus
from streams.bus import (
    DEAD_LETTER_RAW_BYTES,
    MAX_RECORD_BYTES,
    Outgoing,
    RawRecord,
    dead_letter,
)

LIMIT = 10


def _admitted(n: int) -> Envelope:
    return Envelope.wrap(RequestAdmitted(request_id=f"r{n}", queue="q"), source="test")


def _quotas(scope: str, version: int) -> Envelope:
    payload = AdmissionQuotas(scope=scope, version=version, issued_at=0.0, ttl_s=30, quotas=())
    return Envelope.wrap(payload, source="test")


async def test_a_topic_keeps_its_newest_records_and_a_slow_reader_goes_on_after_a_trim() -> None:
    bus = InMemoryBus(retained=LIMIT)
    await bus.publish_events([_admitted(n) for n in range(4)])
    read: list[str] = []
    async with bus.subscribe("tf.requests") as events:
        async for event in events:
            read.append(event.envelope.payload.request_id)  # type: ignore[attr-defined]
            if len(read) == 2:
                break
        await bus.publish_events([_admitted(n) for n in range(4, 40)])
        async with asyncio.timeout(5):
            async for event in events:
                read.append(event.envelope.payload.request_id)  # type: ignore[attr-defined]
                if read[-1] == "r39":
                    break
    kept, _ = await bus.read_all("tf.requests")
    assert len(kept) <= LIMIT
    assert kept[-1].payload.request_id == "r39"  # type: ignore[attr-defined]
    numbers = [int(r[1:]) for r in read]
    assert numbers[:2] == [0, 1]
    assert numbers == sorted(set(numbers))  # nothing twice, nothing out of order
    assert len(numbers) < 40  # what went before the reader came back is skipped


async def test_a_compacted_topic_keeps_every_key_s_latest_record() -> None:
    bus = InMemoryBus(retained=LIMIT)
    for version in range(1, 31):
        await bus.publish_events([_quotas("dc-a", version), _quotas("dc-b", version)])
    await bus.publish_events([_quotas("dc-c", 1)])
    latest = await bus.read_latest("tf.control.quotas")
    assert {k: e.payload.version for k, e in latest.items()} == {  # type: ignore[attr-defined]
        "dc-a": 30,
        "dc-b": 30,
        "dc-c": 1,
    }
    kept, _ = await bus.read_all("tf.control.quotas")
    assert len(kept) <= LIMIT


async def test_a_compacted_topic_with_more_keys_than_it_keeps_still_keeps_each_latest() -> None:
    bus = InMemoryBus(retained=LIMIT)
    for version in (1, 2):
        await bus.publish_events([_quotas(f"dc-{n}", version) for n in range(3 * LIMIT)])
    latest = await bus.read_latest("tf.control.quotas")
    assert len(latest) == 3 * LIMIT
    assert {e.payload.version for e in latest.values()} == {2}  # type: ignore[attr-defined]
    kept, _ = await bus.read_all("tf.control.quotas")
    assert len(kept) <= 2 * 3 * LIMIT  # at most twice its keys


def test_a_bus_keeps_at_least_two_records_a_topic() -> None:
    with pytest.raises(ValueError, match="at least 2"):
        InMemoryBus(retained=1)


def test_the_dead_letter_of_a_record_too_large_for_a_letter_keeps_its_start() -> None:
    """Whole, in base64, a 760 KB record the broker took made a letter no bus takes, and
    the consumer stopped on it for good."""
    record = RawRecord("tf.kv-events", 0, 5, "i", b"x" * 760_000)
    letter = dead_letter(record, "not JSON", "worker")
    assert len(Outgoing.of(letter).value) <= MAX_RECORD_BYTES
    assert letter.payload.raw_size == 760_000
    assert base64.b64decode(letter.payload.raw_b64) == b"x" * DEAD_LETTER_RAW_BYTES
    keyed = RawRecord("tf.kv-events", 0, 7, "\u0007" * 300_000, b"\xff" * 760_000)
    assert len(Outgoing.of(dead_letter(keyed, "\u0007" * 50_000, "worker")).value) <= (
        MAX_RECORD_BYTES  # its key whole made a letter of 1.1 MB, and the worker lost a batch
    )
    small = dead_letter(RawRecord("tf.kv-events", 0, 6, "i", b"{bad"), "not JSON", "worker")
    assert (base64.b64decode(small.payload.raw_b64), small.payload.raw_size) == (b"{bad", None)


async def test_a_dead_letter_no_bus_takes_is_logged_and_the_reader_goes_on(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Raised through the subscription, it stopped every reader of the topic from the
    earliest offset for good (a controller never caught up)."""
    letter = DeadLetter(
        source_topic="tf.requests", partition=0, offset=0, key="bad", reason="", raw_b64="x" * 2**21
    )
    too_large = Envelope.wrap(letter, source="test")
    monkeypatch.setattr(streams.bus, "dead_letter", lambda *_: too_large)
    bus = InMemoryBus(retained=LIMIT)
    await bus.publish("tf.requests", "bad", b"{not json")
    await bus.publish_event(_admitted(1))
    async with bus.subscribe("tf.requests") as events, asyncio.timeout(5):
        first = await anext(aiter(events))
    assert first.envelope.payload.request_id == "r1"  # type: ignore[attr-defined]
    assert any("the dead letter of tf.requests[" in r.getMessage() for r in caplog.records)

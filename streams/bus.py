"""The event bus: publish keyed events, subscribe from a position, read a compacted topic.

Two implementations share this contract (tests/integration/test_bus_contract.py runs the
same suite against both): ``InMemoryBus`` for the embedded mode and the simulator,
``KafkaBus`` for the live system. They differ only in where raw records come from; decoding,
dead-lettering and compaction are done here, once.
"""

from __future__ import annotations

import base64
import logging
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from schemas import DEADLETTER_TOPIC, DecodeError, Envelope, decode, encode, topic_for
from schemas.deadletter import DeadLetter

log = logging.getLogger(__name__)

MAX_RECORD_BYTES = 1_000_000
"""The largest event a bus takes, encoded: under the Kafka producer's default limit on a
request (``max.request.size``, 1,048,576 bytes) with the record's key and framing. Both
buses refuse a larger one alike (``Unpublishable``)."""
DEAD_LETTER_RAW_BYTES = 600_000
"""The most of an undecodable record a dead letter keeps: 800,000 bytes in base64, with
room under ``MAX_RECORD_BYTES`` for the reason."""
REASON_CHARS = 10_000
"""The most of a decoding error's message a dead letter keeps."""
KEY_CHARS = 1_000
"""The most of a record's key a dead letter keeps (the topics' keys are ids of 256
characters at most; a key the broker took whole could fill a letter past any bus's limit)."""

StartFrom = Literal["earliest", "latest"] | Mapping[int, int]
"""Where a subscription starts: the oldest record, the next new one, or given offsets per
partition (partitions not named start from the oldest record)."""


class Unpublishable(ValueError):
    """An event larger than any bus takes (``MAX_RECORD_BYTES``): retrying cannot help."""

    def __init__(self, envelope: Envelope, size: int) -> None:
        super().__init__(
            f"event {envelope.event_id} ({type(envelope.payload).schema_ref()}) is {size:,} "
            f"bytes encoded, over the {MAX_RECORD_BYTES:,} a bus takes"
        )
        self.envelope = envelope


@dataclass(frozen=True, slots=True)
class Outgoing:
    """An event as a bus publishes it: its topic, key and encoded value."""

    topic: str
    key: str
    value: bytes
    envelope: Envelope

    @classmethod
    def of(cls, envelope: Envelope, to: str | None = None) -> Outgoing:
        """On the payload's topic (or ``to``), keyed by the topic's key field;
        Unpublishable where it is too large."""
        topic = topic_for(type(envelope.payload))
        value = encode(envelope)
        if len(value) > MAX_RECORD_BYTES:
            raise Unpublishable(envelope, len(value))
        return cls(to or topic.name, topic.key_of(envelope.payload), value, envelope)


@dataclass(frozen=True, slots=True)
class RawRecord:
    topic: str
    partition: int
    offset: int
    key: str | None
    value: bytes | None
    """None is a tombstone: on a compacted topic it deletes the key."""


@dataclass(frozen=True, slots=True)
class Received:
    """A decoded event and where it was read from."""

    topic: str
    partition: int
    offset: int
    key: str | None
    envelope: Envelope


class RecordStream(ABC):
    """Raw records of one topic from a position fixed when the stream was opened."""

    @abstractmethod
    def __aiter__(self) -> AsyncIterator[RawRecord]: ...

    @abstractmethod
    async def close(self) -> None: ...


class EventBus(ABC):
    """The shared behaviour of every bus over primitives a subclass provides.

    ``publish`` writes one record and returns once the bus holds it (for Kafka: acknowledged
    by all in-sync replicas). ``_open`` positions a record stream before it returns, so a
    subscription "from latest" sees exactly what is published after it was entered.
    ``_records_to_end`` returns the records present when it is called.
    """

    source: str = "tokenfleet"

    @abstractmethod
    async def publish(self, topic: str, key: str, value: bytes | None) -> None: ...

    @abstractmethod
    async def close(self) -> None: ...

    @abstractmethod
    async def _open(self, topic: str, start: StartFrom) -> RecordStream: ...

    @abstractmethod
    async def _records_to_end(self, topic: str) -> Iterable[RawRecord]: ...

    async def publish_event(self, envelope: Envelope) -> None:
        """Publish on the payload's topic, keyed by the topic's key field."""
        await self.publish_events([envelope])

    async def publish_events(self, envelopes: Sequence[Envelope], to: str | None = None) -> None:
        """Publish several events, in order; returns once the bus holds them all. One too
        large for the bus fails the batch (``Unpublishable``) before any of it is
        published. ``to`` sends them all to that topic instead of each to its own (a
        bench's copy)."""
        await self._publish_all([Outgoing.of(envelope, to) for envelope in envelopes])

    async def _publish_all(self, records: Sequence[Outgoing]) -> None:
        """Publish encoded events in order: one at a time, unless the bus does better."""
        for record in records:
            await self.publish(record.topic, record.key, record.value)

    def subscribe(self, topic: str, start: StartFrom = "earliest") -> Subscription:
        """Decoded events of ``topic``, in order per partition, waiting for new ones.

        Use as ``async with bus.subscribe(topic) as events: async for event in events``.
        Undecodable records go to the dead-letter topic and are skipped.
        """
        return Subscription(self, topic, start)

    async def read_latest(self, topic: str, *, auditing: bool = False) -> dict[str, Envelope]:
        """The latest decodable value per key of a (compacted) topic, as of now. An
        undecodable one is dead-lettered, but where ``auditing``: an auditor's read
        writes nothing (``tokenfleet recount`` wrote letters at each run)."""
        latest: dict[str, Envelope] = {}
        for record in await self._records_to_end(topic):
            key = record.key or ""
            if record.value is None:
                latest.pop(key, None)
                continue
            if auditing:
                envelope = _decoded_or_none(record.value)
            else:
                envelope = await self._decode_or_dead_letter(record)
            if envelope is not None:
                latest[key] = envelope
        return latest

    async def read_all(self, topic: str) -> tuple[list[Envelope], int]:
        """Every decodable event of ``topic`` from its start to its end as of now, and how
        many records were not (skipped, not dead-lettered again: an auditor's read)."""
        events, undecodable = [], 0
        for record in await self._records_to_end(topic):
            if record.value is None:
                continue
            envelope = _decoded_or_none(record.value)
            if envelope is None:
                undecodable += 1
            else:
                events.append(envelope)
        return events, undecodable

    async def _decode_or_dead_letter(self, record: RawRecord) -> Envelope | None:
        assert record.value is not None
        try:
            return decode(record.value)
        except DecodeError as exc:
            await self._dead_letter(record, str(exc))
            return None

    async def _dead_letter(self, record: RawRecord, reason: str) -> None:
        log.warning("undecodable record %s[%d]@%d: %s", *_at(record), reason)
        if record.topic == DEADLETTER_TOPIC:
            return  # never loop: a broken dead letter is logged and left where it is
        try:
            await self.publish_event(dead_letter(record, reason, self.source))
        except Unpublishable as exc:  # no retry takes it: the consumer must go on
            log.error("the dead letter of %s[%d]@%d: %s", *_at(record), exc)


def _decoded_or_none(value: bytes) -> Envelope | None:
    try:
        return decode(value)
    except DecodeError:
        return None


def _at(record: RawRecord) -> tuple[str, int, int]:
    return record.topic, record.partition, record.offset


def dead_letter(record: RawRecord, reason: str, source: str) -> Envelope:
    """The dead letter of an undecodable record. Its event id names the record, so the
    letters several consumers write for one record deduplicate. A record over
    ``DEAD_LETTER_RAW_BYTES`` keeps only its start, and its key its first ``KEY_CHARS``:
    whole, in base64, a record the broker took could make a letter no bus takes, and the
    consumer would stop on it for good."""
    raw = record.value or b""
    letter = DeadLetter(
        source_topic=record.topic,
        partition=record.partition,
        offset=record.offset,
        key=None if record.key is None else record.key[:KEY_CHARS],
        reason=reason[:REASON_CHARS],
        raw_b64=base64.b64encode(raw[:DEAD_LETTER_RAW_BYTES]).decode(),
        raw_size=len(raw) if len(raw) > DEAD_LETTER_RAW_BYTES else None,
    )
    event_id = f"{record.topic}/{record.partition}/{record.offset}"
    return Envelope.wrap(letter, source=source, event_id=event_id)


class Subscription:
    """An open subscription; see ``EventBus.subscribe``."""

    def __init__(self, bus: EventBus, topic: str, start: StartFrom) -> None:
        self._bus = bus
        self._topic = topic
        self._start = start
        self._stream: RecordStream | None = None

    async def __aenter__(self) -> Subscription:
        self._stream = await self._bus._open(self._topic, self._start)
        return self

    async def __aexit__(self, *_: object) -> None:
        if self._stream is not None:
            await self._stream.close()
            self._stream = None

    async def __aiter__(self) -> AsyncIterator[Received]:
        if self._stream is None:
            raise RuntimeError("enter the subscription with 'async with' before iterating")
        async for record in self._stream:
            if record.value is None:
                continue
            envelope = await self._bus._decode_or_dead_letter(record)
            if envelope is not None:
                yield Received(record.topic, record.partition, record.offset, record.key, envelope)

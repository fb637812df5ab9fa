"""An in-process bus: partitioned, ordered per key, replayable, gone when the process ends."""

from __future__ import annotations

import asyncio
import zlib
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass

from schemas import TOPICS, Envelope, encode, topic_for
from streams.bus import EventBus, RawRecord, RecordStream, StartFrom

_DEFAULT_PARTITIONS = {t.name: t.partitions for t in TOPICS}


class InMemoryBus(EventBus):
    """Keeps every record of every topic in one append-only list per topic.

    A record's partition comes from a stable hash of its key (like Kafka's keyed
    partitioner, though not the same function), and offsets count per partition, so
    positions mean what they mean on Kafka.
    """

    def __init__(self, source: str = "tokenfleet") -> None:
        self.source = source
        self._logs: dict[str, list[RawRecord]] = {}
        self._next_offset: dict[tuple[str, int], int] = {}
        self._changed: dict[str, asyncio.Condition] = {}
        """One per topic, so a record wakes only the readers of its own topic."""

    async def publish(self, topic: str, key: str, value: bytes | None) -> None:
        await self._append(topic, key, value, None)

    async def publish_event(self, envelope: Envelope) -> None:
        """Keep the envelope beside its bytes: subscribers in this process get it without
        decoding what was just encoded (the bytes stay, for raw readers)."""
        topic = topic_for(type(envelope.payload))
        await self._append(topic.name, topic.key_of(envelope.payload), encode(envelope), envelope)

    async def _append(
        self, topic: str, key: str, value: bytes | None, envelope: Envelope | None
    ) -> None:
        partitions = _DEFAULT_PARTITIONS.get(topic, 1)
        partition = zlib.crc32(key.encode()) % partitions
        offset = self._next_offset.get((topic, partition), 0)
        self._next_offset[(topic, partition)] = offset + 1
        record = (
            RawRecord(topic, partition, offset, key, value)
            if envelope is None
            else _HeldRecord(topic, partition, offset, key, value, envelope)
        )
        self._logs.setdefault(topic, []).append(record)
        changed = self._changed_of(topic)
        async with changed:
            changed.notify_all()

    async def _decode_or_dead_letter(self, record: RawRecord) -> Envelope | None:
        if isinstance(record, _HeldRecord):
            return record.envelope
        return await super()._decode_or_dead_letter(record)

    async def close(self) -> None:
        return None

    async def _open(self, topic: str, start: StartFrom) -> RecordStream:
        log = self._logs.setdefault(topic, [])
        first = len(log) if start == "latest" else 0
        offsets = start if isinstance(start, Mapping) else {}
        return _MemoryStream(log, first, offsets, self._changed_of(topic))

    def _changed_of(self, topic: str) -> asyncio.Condition:
        return self._changed.setdefault(topic, asyncio.Condition())

    async def _records_to_end(self, topic: str) -> list[RawRecord]:
        return list(self._logs.get(topic, []))


@dataclass(frozen=True, slots=True)
class _HeldRecord(RawRecord):
    """A record published as an envelope, which it keeps (envelopes are immutable)."""

    envelope: Envelope


class _MemoryStream(RecordStream):
    def __init__(
        self,
        log: list[RawRecord],
        first: int,
        offsets: Mapping[int, int],
        changed: asyncio.Condition,
    ) -> None:
        self._log = log
        self._index = first
        self._offsets = offsets
        self._changed = changed

    async def __aiter__(self) -> AsyncIterator[RawRecord]:
        while True:
            while self._index < len(self._log):
                record = self._log[self._index]
                self._index += 1
                if record.offset >= self._offsets.get(record.partition, 0):
                    yield record
            async with self._changed:
                await self._changed.wait_for(lambda: self._index < len(self._log))

    async def close(self) -> None:
        return None

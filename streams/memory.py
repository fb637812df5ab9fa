"""An in-process bus: partitioned, ordered per key, replayable, gone when the process ends."""

from __future__ import annotations

import asyncio
import bisect
import zlib
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field

from schemas import TOPICS, Envelope
from streams.bus import EventBus, Outgoing, RawRecord, RecordStream, StartFrom

_DEFAULT_PARTITIONS = {t.name: t.partitions for t in TOPICS}
_COMPACTED = frozenset(t.name for t in TOPICS if t.compacted)
RETAINED_RECORDS = 100_000
"""Records a topic keeps before the oldest go (Kafka keeps them by time and size; this bus
by count): an embedded gateway that runs for days must not keep every event it ever sent.
Past it, a compacted topic keeps each key's latest record, any other its newest half."""


@dataclass
class _Log:
    """One topic's records in the order they were appended, each with its place in that
    order (``seqs``), which stays when older records go. Past ``limit`` records it lets
    the oldest go (a compacted topic: all but each key's latest), and does so again only
    once it holds twice what the last trim left: a compacted topic with more keys than
    ``limit`` is not rebuilt at every append."""

    compacted: bool
    limit: int
    records: list[RawRecord] = field(default_factory=list)
    seqs: list[int] = field(default_factory=list)
    appended: int = 0
    trim_at: int = field(init=False)

    def __post_init__(self) -> None:
        self.trim_at = self.limit

    def append(self, record: RawRecord) -> None:
        self.records.append(record)
        self.seqs.append(self.appended)
        self.appended += 1
        if len(self.records) > self.trim_at:
            self._trim()
            self.trim_at = max(self.limit, 2 * len(self.records))

    def position(self, seq: int) -> int:
        """Where the first record at or after ``seq`` is now."""
        return bisect.bisect_left(self.seqs, seq)

    def _trim(self) -> None:
        if self.compacted:
            latest = {r.key: n for n, r in enumerate(self.records)}
            kept = sorted(latest.values())
        else:
            kept = list(range(len(self.records) - self.limit // 2, len(self.records)))
        self.records = [self.records[n] for n in kept]
        self.seqs = [self.seqs[n] for n in kept]


class InMemoryBus(EventBus):
    """Keeps each topic's records in one list, in the order they came, up to ``retained``
    of them (``RETAINED_RECORDS``).

    A record's partition comes from a stable hash of its key (like Kafka's keyed
    partitioner, though not the same function), and offsets count per partition, so
    positions mean what they mean on Kafka.
    """

    def __init__(self, source: str = "tokenfleet", retained: int = RETAINED_RECORDS) -> None:
        if retained < 2:
            raise ValueError(f"a topic must keep at least 2 records, not {retained}")
        self.source = source
        self.retained = retained
        self._logs: dict[str, _Log] = {}
        self._next_offset: dict[tuple[str, int], int] = {}
        self._changed: dict[str, asyncio.Condition] = {}
        """One per topic, so a record wakes only the readers of its own topic."""

    async def publish(self, topic: str, key: str, value: bytes | None) -> None:
        await self._append(topic, key, value, None)

    async def _publish_all(self, records: Sequence[Outgoing]) -> None:
        """Keep each envelope beside its bytes: subscribers in this process get it without
        decoding what was just encoded (the bytes stay, for raw readers)."""
        for record in records:
            await self._append(record.topic, record.key, record.value, record.envelope)

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
        self._log(topic).append(record)
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
        log = self._log(topic)
        first = log.appended if start == "latest" else 0
        offsets = start if isinstance(start, Mapping) else {}
        return _MemoryStream(log, first, offsets, self._changed_of(topic))

    def _log(self, topic: str) -> _Log:
        if topic not in self._logs:
            self._logs[topic] = _Log(topic in _COMPACTED, self.retained)
        return self._logs[topic]

    def _changed_of(self, topic: str) -> asyncio.Condition:
        return self._changed.setdefault(topic, asyncio.Condition())

    async def _records_to_end(self, topic: str) -> list[RawRecord]:
        return list(self._log(topic).records)


@dataclass(frozen=True, slots=True)
class _HeldRecord(RawRecord):
    """A record published as an envelope, which it keeps (envelopes are immutable)."""

    envelope: Envelope


class _MemoryStream(RecordStream):
    """Reads on from the place in its log's order it reached: a reader that fell behind
    the records the log let go goes on from the oldest still kept, as a Kafka consumer
    whose offset has gone does from the earliest."""

    def __init__(
        self,
        log: _Log,
        first: int,
        offsets: Mapping[int, int],
        changed: asyncio.Condition,
    ) -> None:
        self._log = log
        self._next = first
        self._offsets = offsets
        self._changed = changed

    async def __aiter__(self) -> AsyncIterator[RawRecord]:
        log = self._log
        while True:
            records, position = log.records, log.position(self._next)
            while position < len(records):
                if records is not log.records:  # trimmed while the reader had the record
                    records, position = log.records, log.position(self._next)
                    continue
                record = records[position]
                self._next = log.seqs[position] + 1
                position += 1
                if record.offset >= self._offsets.get(record.partition, 0):
                    yield record
            async with self._changed:
                await self._changed.wait_for(lambda: self._next < log.appended)

    async def close(self) -> None:
        return None

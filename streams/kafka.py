"""The Kafka bus (aiokafka) and idempotent topic creation from the catalog."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.client import AIOKafkaClient
from aiokafka.errors import TopicAlreadyExistsError, for_code

from schemas import TOPICS, Topic
from streams.bus import EventBus, Outgoing, RawRecord, RecordStream, StartFrom

log = logging.getLogger(__name__)


def keep_tracked(client: AIOKafkaClient, topic: str) -> None:
    """Have aiokafka's ``client`` track ``topic`` before a record is sent to it.

    aiokafka asks each metadata update for the topics it tracks, or for all while it
    tracks none, and each answer replaces what it knew. A topic first learnt from an
    update for all (Faust's, once it creates its topics) is known but not tracked: a send
    to it finds it known and tracks nothing. The first send to a topic not yet known then
    tracks that one alone, and the next update forgets the others: a record already in a
    batch for one of them waits for a leader no update asks for, until another send to
    its topic or the request timeout (Faust's: 20 minutes). Seen in the table worker: a
    fresh worker's last outcomes never reached its updates topic, its tables stayed
    short, and its commits waited on the flush (``tests/integration/test_kafka_topics.py``).
    A producer that tracks any topic learns no other from updates (Faust's after it
    creates a topic included) until it sends there, as after its first send before.
    """
    if topic not in client._topics:
        client.add_topic(topic)


class UnknownTopicError(LookupError):
    """The topic does not exist on the broker; ``tokenfleet topics create`` makes them."""


class KafkaBus(EventBus):
    """Publishes with an idempotent producer (``acks=all``) and reads without a consumer
    group: every subscription sees every partition, which is what gateways and controllers
    that keep a full view need. Stream processors with shared work use Faust instead.

    ``delivery_timeout_s`` bounds how long a publish keeps retrying while the broker is
    away; within it a restarted broker receives every event exactly once.
    """

    def __init__(
        self,
        bootstrap: str,
        *,
        source: str = "tokenfleet",
        delivery_timeout_s: float = 60.0,
    ) -> None:
        self.bootstrap = bootstrap
        self.source = source
        self._delivery_timeout_ms = int(delivery_timeout_s * 1000)
        self._producer: AIOKafkaProducer | None = None
        self._producer_starting = asyncio.Lock()
        """Publishers that start at once share one producer (each made its own, and all
        but the last leaked)."""

    async def publish(self, topic: str, key: str, value: bytes | None) -> None:
        producer = await self._started_producer()
        keep_tracked(producer.client, topic)
        await producer.send_and_wait(topic, value, key=key.encode())

    async def _publish_all(self, records: Sequence[Outgoing]) -> None:
        """Hands every event to the producer first, then waits for all acknowledgements,
        so a batch costs about one round trip. Order per key holds: the idempotent
        producer keeps each partition's records in the order they were handed over."""
        producer = await self._started_producer()
        sent = []
        for record in records:
            keep_tracked(producer.client, record.topic)
            sent.append(await producer.send(record.topic, record.value, key=record.key.encode()))
        await asyncio.gather(*sent)

    async def connect(self) -> None:
        """Connect the producer now rather than at the first publish; raises where the
        broker cannot be reached (aiokafka's ``KafkaConnectionError``)."""
        await self._started_producer()

    async def close(self) -> None:
        async with self._producer_starting:  # a producer still starting is stopped too
            if self._producer is not None:
                await self._producer.stop()
                self._producer = None

    async def _started_producer(self) -> AIOKafkaProducer:
        async with self._producer_starting:
            if self._producer is None:
                producer = AIOKafkaProducer(
                    bootstrap_servers=self.bootstrap,
                    client_id=self.source,
                    enable_idempotence=True,
                    acks="all",
                    request_timeout_ms=self._delivery_timeout_ms,
                )
                await _started(producer)
                self._producer = producer
            return self._producer

    async def _open(self, topic: str, start: StartFrom) -> RecordStream:
        consumer, partitions = await self._assigned_consumer(topic)
        try:
            await _seek(consumer, partitions, start)
        except BaseException:
            await consumer.stop()
            raise
        return _KafkaStream(consumer)

    async def _records_to_end(self, topic: str) -> Iterable[RawRecord]:
        consumer, partitions = await self._assigned_consumer(topic)
        try:
            begin = await consumer.beginning_offsets(partitions)
            end = await consumer.end_offsets(partitions)
            for tp in partitions:
                consumer.seek(tp, begin[tp])
            records: list[RawRecord] = []
            pending = {tp for tp in partitions if begin[tp] < end[tp]}
            while pending:
                batches = await consumer.getmany(*pending, timeout_ms=1000)
                for tp, messages in batches.items():
                    records.extend(_raw(m) for m in messages if m.offset < end[tp])
                    if messages and messages[-1].offset >= end[tp] - 1:
                        pending.discard(tp)
            return records
        finally:
            await consumer.stop()

    async def _assigned_consumer(self, topic: str) -> tuple[AIOKafkaConsumer, list[TopicPartition]]:
        consumer = AIOKafkaConsumer(
            bootstrap_servers=self.bootstrap,
            client_id=self.source,
            group_id=None,
            enable_auto_commit=False,
            auto_offset_reset="earliest",  # an offset compacted or expired away: go to the oldest
        )
        await _started(consumer)
        try:
            # aiokafka has no public call that refreshes a consumer's metadata for a topic
            # it is not subscribed to; fetch_all_metadata returns a fresh view instead.
            cluster = await consumer._client.fetch_all_metadata()
            numbers = cluster.partitions_for_topic(topic)
            if not numbers:
                raise UnknownTopicError(f"topic {topic!r} does not exist on {self.bootstrap}")
        except BaseException:
            await consumer.stop()
            raise
        partitions = [TopicPartition(topic, p) for p in sorted(numbers)]
        consumer.assign(partitions)
        return consumer, partitions


async def _started(client: AIOKafkaProducer | AIOKafkaConsumer) -> None:
    """Start a client; one that fails to start is stopped, so it leaks no connection."""
    try:
        await client.start()
    except BaseException:
        await client.stop()
        raise


async def _seek(
    consumer: AIOKafkaConsumer, partitions: list[TopicPartition], start: StartFrom
) -> None:
    """Seek every partition to an explicit offset, resolved now rather than at first fetch."""
    if start == "latest":
        targets = await consumer.end_offsets(partitions)
    else:
        targets = await consumer.beginning_offsets(partitions)
    if isinstance(start, Mapping):
        targets.update({tp: start[tp.partition] for tp in partitions if tp.partition in start})
    for tp, offset in targets.items():
        consumer.seek(tp, offset)


class _KafkaStream(RecordStream):
    def __init__(self, consumer: AIOKafkaConsumer) -> None:
        self._consumer = consumer

    async def __aiter__(self) -> AsyncIterator[RawRecord]:
        async for message in self._consumer:
            yield _raw(message)

    async def close(self) -> None:
        await self._consumer.stop()


def _raw(message: Any) -> RawRecord:
    """A record as aiokafka's consumer yields it (a ``ConsumerRecord``)."""
    key = message.key.decode(errors="replace") if message.key is not None else None
    return RawRecord(message.topic, message.partition, message.offset, key, message.value)


async def create_topics(
    bootstrap: str, topics: Iterable[Topic] = TOPICS, replication: int = 1
) -> list[str]:
    """Create the catalog's topics that are missing; return the names created, once the
    broker's metadata lists them. ``PartitionsMismatch`` where one exists with another
    number of partitions than the catalog's.

    Safe to run any number of times and concurrently: existing topics are left as they are.
    Waiting matters to consumer groups: a group that forms while a topic it subscribes to
    is missing from the metadata gets none of its partitions until the next metadata
    refresh, minutes later.
    """
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, client_id="tokenfleet-admin")
    await admin.start()
    try:
        existing = set(await admin.list_topics())
        await _check_partitions(bootstrap, [t for t in topics if t.name in existing])
        missing = [
            NewTopic(t.name, t.partitions, replication, topic_configs=t.broker_config())
            for t in topics
            if t.name not in existing
        ]
        if not missing:
            return []
        response = await admin.create_topics(missing)
        created = []
        for name, code, *_ in response.topic_errors:
            error = for_code(code)
            if error is TopicAlreadyExistsError:
                log.info("topic %s was created concurrently", name)
            elif code != 0:
                raise error(f"creating topic {name!r}")
            else:
                created.append(name)
    finally:
        await admin.close()
    await _listed(bootstrap, [t.name for t in missing])
    return created


class PartitionsMismatch(ValueError):
    """A topic exists with another number of partitions than the catalog gives it."""


async def _check_partitions(bootstrap: str, topics: Sequence[Topic]) -> None:
    """PartitionsMismatch for the first of ``topics`` the broker holds with another number
    of partitions: the table worker writes a request's join to its source partition's
    changelog, and joins telemetry by partition, so a topic made elsewhere with more
    partitions stopped it on its first event there, with an assertion of aiokafka's."""
    if not topics:
        return
    async with _metadata_client(bootstrap) as client:
        cluster = await client.fetch_all_metadata()
    for topic in topics:
        partitions = cluster.partitions_for_topic(topic.name)
        if partitions is None:  # listed, no leader yet: being made (by another of ours)
            continue
        held = len(partitions)
        if held != topic.partitions:
            raise PartitionsMismatch(
                f"topic {topic.name} has {held} partitions, and TokenFleet's tables need "
                f"{topic.partitions}: delete it (kafka-topics --delete) to have it made "
                "again, or point TokenFleet at another cluster"
            )


@contextlib.asynccontextmanager
async def _metadata_client(bootstrap: str) -> AsyncIterator[AIOKafkaClient]:
    client = AIOKafkaClient(bootstrap_servers=bootstrap, client_id="tokenfleet-admin")
    await client.bootstrap()
    try:
        yield client
    finally:
        await client.close()


async def _listed(bootstrap: str, names: Sequence[str], timeout_s: float = 30.0) -> None:
    async with _metadata_client(bootstrap) as client, asyncio.timeout(timeout_s):
        while True:
            cluster = await client.fetch_all_metadata()
            if all(cluster.partitions_for_topic(name) for name in names):
                return
            await asyncio.sleep(0.1)

from __future__ import annotations

import asyncio
import gc
from collections import defaultdict

import pytest
from aiokafka import AIOKafkaProducer

from schemas import Envelope
from schemas.lifecycle import RequestAdmitted
from streams.kafka import KafkaBus, create_topics
from tests.services import Service
from tokenfleet.services.kafka import LocalKafka

pytestmark = pytest.mark.kafka


def _admitted(n: int) -> Envelope:
    return Envelope.wrap(RequestAdmitted(request_id=f"r-{n % 3}", queue=f"q{n}"), source="test")


async def test_a_producer_keeps_its_events_across_a_broker_restart(own_broker: LocalKafka) -> None:
    await create_topics(own_broker.bootstrap)
    bus = KafkaBus(own_broker.bootstrap, source="test", delivery_timeout_s=120)
    try:
        for n in range(10):
            await bus.publish_event(_admitted(n))
        await asyncio.to_thread(own_broker.stop)

        pending = [asyncio.create_task(bus.publish_event(_admitted(n))) for n in range(10, 20)]
        await asyncio.sleep(1.0)
        assert not any(task.done() for task in pending), "sends should wait for the broker"
        await asyncio.to_thread(own_broker.start)
        await asyncio.wait_for(asyncio.gather(*pending), timeout=90)

        queues: dict[str, list[int]] = defaultdict(list)
        async with bus.subscribe("tf.requests") as events, asyncio.timeout(30):
            async for event in events:
                queues[event.key].append(int(event.envelope.payload.queue[1:]))
                if sum(map(len, queues.values())) == 20:
                    break
    finally:
        await bus.close()
    for key, numbers in queues.items():
        assert numbers == sorted(numbers), f"{key} out of order"
    assert sorted(n for numbers in queues.values() for n in numbers) == list(range(20))


async def test_publishers_that_start_at_once_share_one_producer(kafka: Service) -> None:
    """A controller's hosts publish their first snapshots in the same instant: each once
    made a producer of its own, and all but the last were left running, unclosed."""
    bus = KafkaBus(kafka.address, source="test")
    before = _producers()
    try:
        await asyncio.gather(*(bus.publish_event(_admitted(n)) for n in range(3)))
        assert _producers() - before == 1
    finally:
        await bus.close()


def _producers() -> int:
    return sum(isinstance(o, AIOKafkaProducer) for o in gc.get_objects())

"""aiokafka's producer, as the table worker runs it, on a real broker: a record sent to a
topic it already knew is delivered though a send to a new topic follows it."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from pathlib import Path

import pytest

from schemas.topics import DAY_MS, Topic
from streams.faust_app import build_app
from streams.kafka import create_topics
from streams.settings import WorkerSettings
from tests.services import Service

pytestmark = pytest.mark.kafka

LINGER_MS = 300
"""How long a record waits in its batch before it is sent (the worker's is 5 ms): the
window in which a metadata update may forget its topic, wide enough to hit every time."""


def _topic(name: str) -> Topic:
    return Topic(name, "key", 1, False, DAY_MS, ())


async def test_a_record_waiting_for_a_known_topic_survives_a_send_to_a_new_one(
    kafka: Service, tmp_path: Path
) -> None:
    """A fresh worker's last outcomes stayed in aiokafka's batch for good (their topic
    forgotten by the metadata update that the first send to a newer topic asked for), its
    tables stayed short of them, and its commits waited on the flush."""
    known, new = f"known-{uuid.uuid4().hex[:8]}", f"new-{uuid.uuid4().hex[:8]}"
    await create_topics(kafka.address, [_topic(known)])
    settings = WorkerSettings(app_id=f"topics-{uuid.uuid4().hex[:8]}", data_dir=tmp_path)
    producer = build_app(kafka.address, settings).producer
    producer.linger_ms = LINGER_MS
    await producer.start()
    try:
        # An update for all topics while it tracks none, as after Faust creates its own;
        # then a topic it does not know.
        await producer._ensure_producer().client.force_metadata_update()
        await create_topics(kafka.address, [_topic(new)])
        waiting = await producer.send(known, b"k", b"v", None, None, None)
        assert not waiting.done(), "the record was sent before the window opened"
        await producer.send_and_wait(new, b"k", b"v", None, None, None)
        delivered = await asyncio.wait_for(waiting, 15)
    finally:  # a stop flushes: with a record stuck, it would wait for it too
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(producer.stop(), 10)
    assert delivered.topic == known

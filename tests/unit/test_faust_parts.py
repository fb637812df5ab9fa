"""The table worker's Faust parts, where they can be checked without a broker."""

from __future__ import annotations

import asyncio
import types
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from faust.serializers.codecs import get_codec
from faust.transport.consumer import ThreadDelegateConsumer
from faust.types import TP
from faust.utils import json as faust_json
from prometheus_client import generate_latest

from schemas import DEADLETTER_TOPIC
from schemas.topics import COMPACTED_SEGMENT_MS
from streams.faust_app import _decoder, build_app
from streams.faust_parts import (
    FETCH_MAX_WAIT_MS,
    RUST_JSON,
    KeyedTable,
    RewindingConsumer,
    WorkerApp,
    _ConsumerThread,
    metrics_registry,
)
from streams.settings import WorkerSettings


@pytest.fixture
async def app() -> AsyncIterator[WorkerApp]:
    """A worker's app and its consumer, on no broker: nothing connects. The consumer's
    thread made an event loop of its own, closed here."""
    app = WorkerApp("parts", broker="kafka://127.0.0.1:1")
    consumer = app.consumer
    try:
        yield app
    finally:
        consumer._thread.thread_loop.close()


def test_a_worker_that_would_start_a_new_partition_at_its_end_is_refused() -> None:
    """Partitions without a committed offset are rewound to their first record, which is
    right only where the consumer starts them there."""
    app = WorkerApp("latest", broker="kafka://127.0.0.1:1", consumer_auto_offset_reset="latest")
    with pytest.raises(ValueError, match="earliest offset"):
        _ = app.transport


async def test_aiokafka_is_asked_for_the_partitions_active_when_faust_asks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Faust empties its set of active partitions while aiokafka answers on its thread,
    and aiokafka answers an empty set with every partition's records: aiokafka gets a
    copy, which Faust's later changes leave alone."""
    asked: list[set[TP] | None] = []

    async def answer(self: Any, active_partitions: set[TP] | None, _: float) -> dict[TP, Any]:
        asked.append(active_partitions)
        return {}

    monkeypatch.setattr(ThreadDelegateConsumer, "_getmany", answer)
    assert WorkerApp("copy", broker="kafka://127.0.0.1:1").transport.Consumer is RewindingConsumer
    consumer = RewindingConsumer.__new__(RewindingConsumer)  # no thread, no loop: only asked
    active = {TP("tf.requests", 0), TP("tf.requests", 1)}
    await consumer._getmany(active, 1.0)
    active.clear()  # as Faust's pause does, while aiokafka may still be answering
    assert asked == [{TP("tf.requests", 0), TP("tf.requests", 1)}]


async def test_the_broker_holds_a_worker_s_fetch_at_most_fetch_max_wait(
    app: WorkerApp,
) -> None:
    """Faust creates aiokafka's consumer holding fetches 1,500 ms; the worker's consumer
    thread creates it holding them ``FETCH_MAX_WAIT_MS``, which aiokafka hands its fetcher
    when it starts."""
    thread = app.consumer._thread
    assert isinstance(thread, _ConsumerThread)
    created = thread._create_worker_consumer(app.transport)
    try:
        assert created._fetch_max_wait_ms == FETCH_MAX_WAIT_MS < 1500
    finally:
        await created.stop()


def test_tables_write_their_changelogs_as_json_that_reads_back_the_same() -> None:
    """The join state's shape, infinities included, through the tables' codec; and a
    record the standard library's JSON wrote (Faust's codec, before) reads the same."""
    app = WorkerApp("codec", broker="kafka://127.0.0.1:1")
    table = KeyedTable(app, name="join", partitions=6)
    schema = table.changelog_topic.schema  # what recovery decodes the changelog with
    assert (schema.key_serializer, schema.value_serializer) == (RUST_JSON, RUST_JSON)
    codec = get_codec(RUST_JSON)
    state = {"seen": ["e1"], "arrived": None, "last_ts": float("-inf"), "held": [], "retries": 0}
    assert codec.loads(codec.dumps(state)) == state
    assert codec.loads(faust_json.dumps(state).encode()) == state  # written before
    assert faust_json.loads(codec.dumps(state)) == state  # read by a worker from before
    assert codec.dumps("req-1f2e") == faust_json.dumps("req-1f2e").encode()  # the same keys


async def test_a_delivery_that_need_not_wait_runs_at_once_and_one_that_waits_goes_on(
    app: WorkerApp,
) -> None:
    """The drain loop's wait on a delivery or a suspension of the flow: a delivery that
    finishes at once does so before the event loop runs anything else (with mode's
    ``wait_first``, a task, it does after); one that waits is resumed once what it waits
    for is done; one the suspension wins over is cancelled where it waits, as the task
    running it would be."""
    consumer = app.consumer
    steps: list[str] = []
    suspended = asyncio.Event()

    async def delivery(gate: asyncio.Future[str] | None) -> str:
        steps.append("started")
        try:
            value = "delivered" if gate is None else await gate
        except asyncio.CancelledError:
            steps.append("cancelled")
            raise
        steps.append(value)
        return value

    asyncio.get_running_loop().call_soon(steps.append, "the loop's turn")
    results = await consumer.wait_first(delivery(None), suspended.wait())
    assert results.results == ["delivered"]
    assert steps == ["started", "delivered"]  # before the loop ran anything else
    await asyncio.sleep(0)

    gate = asyncio.get_running_loop().create_future()
    waiting = asyncio.ensure_future(consumer.wait_first(delivery(gate), suspended.wait()))
    await asyncio.sleep(0.01)
    assert steps[-1] == "started"
    gate.set_result("after the wait")
    assert (await waiting).results == ["after the wait"]

    gate = asyncio.get_running_loop().create_future()
    waiting = asyncio.ensure_future(consumer.wait_first(delivery(gate), suspended.wait()))
    await asyncio.sleep(0.01)
    suspended.set()
    await waiting
    assert steps[-2:] == ["started", "cancelled"]
    assert gate.cancelled()


async def test_a_delivery_s_errors_reach_the_drain_loop_as_before(app: WorkerApp) -> None:
    """Raised in its first step, or by a future it waited on; a bare yield is resumed."""
    consumer = app.consumer
    suspended = asyncio.Event()

    async def failing_at_once() -> None:
        raise ValueError("undecodable")

    with pytest.raises(ValueError, match="undecodable"):
        await consumer.wait_first(failing_at_once(), suspended.wait())

    gate = asyncio.get_running_loop().create_future()

    async def failing_later() -> None:
        await asyncio.sleep(0)  # a bare yield first
        await gate

    waiting = asyncio.ensure_future(consumer.wait_first(failing_later(), suspended.wait()))
    await asyncio.sleep(0.01)
    gate.set_exception(RuntimeError("the queue went away"))
    with pytest.raises(RuntimeError, match="the queue went away"):
        await waiting


async def test_a_rebalance_forgets_the_keys_written_to_partitions_no_longer_held(
    app: WorkerApp, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Faust's in-memory store forgets, after a rebalance, only the keys it recovered; the
    join table also forgets those it wrote to partitions it lost, and keeps the rest."""
    table = KeyedTable(app, name="join", partitions=6)
    sent = types.SimpleNamespace(message=types.SimpleNamespace(partition=0))
    monkeypatch.setattr(table, "send_changelog", lambda *args, **kwargs: sent)  # no broker
    table.put("kept", {"seen": ["e1"]}, partition=0)
    table.put("lost", {"seen": ["e2"]}, partition=3)
    table.put("removed", {"seen": ["e3"]}, partition=3)
    table.remove("removed", partition=3)
    changelog = table.changelog_topic_name
    await table.on_recovery_completed({TP(changelog, 0)}, {TP(changelog, 3)})
    assert dict(table.data.items()) == {"kept": {"seen": ["e1"]}}
    await table.on_recovery_completed({TP(changelog, 0)}, set())  # nothing more to forget
    assert dict(table.data.items()) == {"kept": {"seen": ["e1"]}}


def test_changelogs_close_segments_as_the_project_s_compacted_topics_do() -> None:
    app = WorkerApp("segments", broker="kafka://127.0.0.1:1")
    table = KeyedTable(app, name="join", partitions=6)
    assert table.changelog_topic.config["segment.ms"] == str(COMPACTED_SEGMENT_MS)


async def test_a_tombstone_is_no_event_and_sends_no_dead_letter(app: WorkerApp) -> None:
    """A record without a value (a tombstone) raised TypeError from the decoder, which
    escaped the agent with its whole batch."""
    letters = app.topic(DEADLETTER_TOPIC)
    decoded = _decoder(app, letters, "worker")
    tombstone = types.SimpleNamespace(value=None, message=None)
    assert await decoded(tombstone) is None  # type: ignore[arg-type]
    assert not app.dead_lettered


async def test_a_dead_letter_the_producer_refuses_skips_the_record_alone(app: WorkerApp) -> None:
    """The producer's error escaped the agent, whose batch Faust acknowledged unread."""

    class Refusing:
        async def send(self, **_: object) -> None:
            raise RuntimeError("MessageSizeTooLargeError")

    decoded = _decoder(app, Refusing(), "worker")  # type: ignore[arg-type]
    message = types.SimpleNamespace(
        topic="tf.requests", partition=2, offset=9, key=b"k", value=b"{"
    )
    assert await decoded(types.SimpleNamespace(value=b"{", message=message)) is None  # type: ignore[arg-type]
    assert app.dead_letters_unsent == {"tf.requests": 1}
    assert not app.dead_lettered


def test_a_worker_s_counts_start_at_zero_for_each_topic_it_reads(tmp_path: Path) -> None:
    """A series first seen at 1 has no ``increase()``: a first dead letter would not show."""
    app = build_app("localhost:9", WorkerSettings(app_id="zeros", data_dir=tmp_path))
    try:
        text = generate_latest(metrics_registry(app)).decode()
    finally:
        app.consumer._thread.thread_loop.close()
    for topic in ("tf.requests", "tf.completions", "tf.cancellations", "tf.telemetry"):
        assert f'tokenfleet_worker_dead_letters_total{{topic="{topic}"}} 0.0' in text
        assert f'tokenfleet_worker_dead_letters_unsent_total{{topic="{topic}"}} 0.0' in text
    assert 'tokenfleet_worker_events_total{kind="lifecycle"} 0.0' in text


def test_a_worker_s_changelogs_have_the_replication_asked(tmp_path: Path) -> None:
    app = build_app("localhost:9", WorkerSettings(app_id="copies", data_dir=tmp_path), None, 3)
    try:
        assert app.conf.topic_replication_factor == 3
    finally:
        app.consumer._thread.thread_loop.close()

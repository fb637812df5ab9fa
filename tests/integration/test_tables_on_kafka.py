"""The Faust worker on a real broker: the tables it publishes equal what the pure logic
computes from the same events, through a crash and with two workers sharing the work."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from aiokafka import AIOKafkaConsumer
from aiokafka.errors import KafkaError

from schemas import DEADLETTER_TOPIC, Envelope, encode, topic_for
from schemas.base import TaskClass
from schemas.lifecycle import RequestCompleted
from schemas.objectives import ClassObjective, Objectives
from schemas.tables import CapacityTable, GoodputTable, KvTable
from schemas.telemetry import InstanceTelemetry
from sim.events import lifecycle_events
from sim.run import RunConfig, simulate_run
from streams.faust_app import build_app, updates_topic_of
from streams.kafka import KafkaBus, create_topics
from streams.settings import WorkerSettings
from streams.tables.builder import TableBuilder
from streams.tables.windows import WindowSpec
from tests.conftest import own_broker_for_module
from tests.gateway_harness import fleet_for, scraped
from tests.services import Service
from tokenfleet.services.process import free_port

pytestmark = pytest.mark.kafka


@pytest.fixture(scope="module")
def kafka(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    """A broker of this module's own: a new worker reads every input topic from its start."""
    with own_broker_for_module(tmp_path_factory.mktemp("tables")) as service:
        yield service


SPEC = WindowSpec(size_s=600.0, slide_s=60.0, grace_s=600.0)
WORKER = "tokenfleet_worker_"
"""Where the worker's Prometheus metrics' names begin."""
BAD = "tf.completions"
"""The topic a test sends an undecodable record to."""
_RECORDS = None


def _events(dc: str) -> list[Envelope]:
    """A simulated run's lifecycle events in DC ``dc``, ending about 4 minutes ago, with
    telemetry of two instances."""
    global _RECORDS
    if _RECORDS is None:
        _, _RECORDS = simulate_run(RunConfig("azure-conv", instances=4, requests=200))
    # Request ids are unique in a real fleet; make them unique per test too.
    records = [dataclasses.replace(r, dc=dc, request_id=f"{dc}-{r.request_id}") for r in _RECORDS]
    epoch = time.time() - 300
    events = lifecycle_events(records, model="m", epoch=epoch)
    for n, used in enumerate((100, 700)):
        events.append(reading(f"{dc}-i{n}", dc, waiting=n, kv_blocks_used=used, ts=epoch + 10 + n))
    return events


def reading(instance: str, dc: str, *, waiting: int, kv_blocks_used: int, ts: float) -> Envelope:
    """One telemetry reading of ``instance``, of 1,000 KV blocks, at ``ts``."""
    telemetry = InstanceTelemetry(
        instance_id=instance,
        dc=dc,
        model="m",
        model_version="1",
        ready=True,
        waiting=waiting,
        running=2,
        inflight_tokens=10,
        kv_blocks_used=kv_blocks_used,
        kv_blocks_total=1000,
    )
    return Envelope.wrap(telemetry, source="test", ts=ts)


@contextlib.contextmanager
def worker(
    kafka: Service,
    app_id: str,
    spec: WindowSpec = SPEC,
    fleet_file: Path | None = None,
    log_level: str = "WARNING",
    *,
    seek: tuple[str, Path] | None = None,
    log_path: Path | None = None,
    metrics_port: int | None = None,
) -> Iterator[subprocess.Popen[bytes]]:
    """A worker process; its log's tail is printed when it ends (shown if the test fails),
    and the whole log kept at ``log_path`` if given. At INFO the log holds Faust's
    rebalances and recoveries. ``seek`` (``late`` or ``drop``, and a file) runs it through
    ``tests.integration.seek_worker``, which changes its seek at the end of each recovery
    and reports to that file. ``metrics_port``: it serves Prometheus's ``/metrics`` there."""
    environment = os.environ | {
        "TOKENFLEET_WORKER_LOG_LEVEL": log_level,
        "TOKENFLEET_KAFKA_BOOTSTRAP": kafka.address,
        "TOKENFLEET_WORKER_APP_ID": app_id,
        "TOKENFLEET_WORKER_WINDOW_S": str(spec.size_s),
        "TOKENFLEET_WORKER_SLIDE_S": str(spec.slide_s),
        "TOKENFLEET_WORKER_GRACE_S": str(spec.grace_s),
        "TOKENFLEET_WORKER_PUBLISH_S": "1",
    }
    argv = [sys.executable, "-m", "tokenfleet.cli", "worker"]
    if seek is not None:
        argv = [sys.executable, "-m", "tests.integration.seek_worker", seek[0], str(seek[1])]
    if metrics_port is not None:
        argv += ["--metrics-port", str(metrics_port)]
    with open(log_path, "w+b") if log_path else tempfile.TemporaryFile() as log:
        process = subprocess.Popen(
            argv + (["--fleet", str(fleet_file)] if fleet_file else []),
            env=environment,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            yield process
        finally:
            if process.poll() is None:
                process.terminate()
                try:
                    process.wait(30)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
            log.seek(0)
            tail = log.read()[-4000 if log_level == "WARNING" else -80_000 :]
            print(f"worker {app_id} log tail:", tail.decode(errors="replace"))


async def _publish(kafka: Service, events: Sequence[Envelope]) -> None:
    bus = KafkaBus(kafka.address)
    try:
        await bus.publish_events(events)
    finally:
        await bus.close()


def _comparable(table: object) -> object:
    if isinstance(table, CapacityTable):  # the age depends on when it was published
        rows = tuple(r.model_copy(update={"telemetry_age_s": 0.0}) for r in table.rows)
        return table.model_copy(update={"rows": rows})
    return table


async def _published_equal_reference(
    kafka: Service,
    dc: str,
    events: Sequence[Envelope],
    objectives: Objectives | None = None,
    timeout_s: float = 120.0,
) -> tuple[list[object], list[object]]:
    """Wait until the three published tables of ``dc`` equal the pure logic's tables for
    the same window; return the last published and expected tables."""
    bus = KafkaBus(kafka.address)
    deadline = time.monotonic() + timeout_s
    published: list[object] = []
    expected: list[object] = []
    try:
        while time.monotonic() < deadline:
            published = []
            for topic in ("tf.tables.capacity", "tf.tables.kv", "tf.tables.goodput"):
                latest = (await bus.read_latest(topic)).get(dc)
                if latest is not None:
                    published.append(latest.payload)
            if len(published) == 3 and len({t.window_end for t in published}) == 1:
                expected = _reference(events, published[0].window_end, objectives)
                if _equal(published, expected):
                    return published, expected
            await asyncio.sleep(1.0)
    finally:
        await bus.close()
    return published, expected


def _reference(
    events: Sequence[Envelope], at: float, objectives: Objectives | None
) -> list[object]:
    builder = TableBuilder(SPEC, objectives)
    for event in events:
        builder.feed(event)
    return builder.tables(at)


async def _tables_appear(
    kafka: Service,
    dc: str,
    holding: Callable[[GoodputTable], bool] = lambda table: True,
    timeout_s: float = 120.0,
) -> bool:
    """Whether a goodput table of ``dc`` that is ``holding`` is published (any since the
    topic's start) within ``timeout_s``."""
    bus = KafkaBus(kafka.address)
    try:
        async with (
            asyncio.timeout(timeout_s),
            bus.subscribe("tf.tables.goodput", "earliest") as tables,
        ):
            async for table in tables:
                if table.key == dc and holding(table.envelope.payload):
                    return True
    except TimeoutError:
        return False
    finally:
        await bus.close()
    return False


def _equal(published: list[object], expected: list[object]) -> bool:
    return [_comparable(t) for t in published] == [_comparable(t) for t in expected]


def _assert_equal(published: list[object], expected: list[object]) -> None:
    assert published, "no tables were published"
    goodput = next(t for t in published if isinstance(t, GoodputTable))
    assert goodput.classes[0].completed > 0
    assert [_comparable(t) for t in published] == [_comparable(t) for t in expected]
    assert any(isinstance(t, KvTable) and t.pressure > 0 for t in published)


async def test_published_tables_equal_the_pure_logic_and_bad_records_are_dead_lettered(
    kafka: Service, tmp_path: Path
) -> None:
    """With the class objectives of a fleet file: a TTFT objective at the run's median, so
    that goodput differs from what the built-in objectives give. The bad record goes to
    the dead-letter topic, the worker's log names it and its metrics count it; so does a
    well-formed event on a topic not its own (it vanished: each agent passed over it)."""
    dc = f"dc-{uuid.uuid4().hex[:8]}"
    events = _events(dc)
    median_ttft = statistics.median(
        e.payload.ttft_s for e in events if isinstance(e.payload, RequestCompleted)
    )
    objectives = {TaskClass.INTERACTIVE: ClassObjective(ttft_s=median_ttft)}
    fleet = fleet_for(["http://127.0.0.1:1"], objectives=objectives)
    fleet_file = tmp_path / "fleet.json"
    fleet_file.write_text(fleet.model_dump_json())
    bus = KafkaBus(kafka.address)
    log = tmp_path / "worker.log"
    port = free_port()
    table = topic_for(GoodputTable).name
    app_id = f"tables-{dc}"
    try:
        await bus.publish(BAD, f"{dc}-bad", b"{not json")
        completed = next(e for e in events if isinstance(e.payload, RequestCompleted))
        await bus.publish("tf.telemetry", f"{dc}-misplaced", encode(completed))
        async with bus.subscribe(DEADLETTER_TOPIC, "latest") as letters:
            with worker(kafka, app_id, fleet_file=fleet_file, log_path=log, metrics_port=port):
                await _publish(kafka, events)
                published, expected = await _published_equal_reference(
                    kafka, dc, events, fleet.all_objectives()
                )
                awaited = {f"{dc}-bad", f"{dc}-misplaced"}
                async with asyncio.timeout(60):
                    async for letter in letters:
                        awaited.discard(letter.envelope.payload.key)
                        if not awaited:
                            break
                url = f"http://127.0.0.1:{port}"
                letters_counted = await scraped(url, f"{WORKER}dead_letters_total", topic=BAD)
                taken_in = await scraped(url, f"{WORKER}events_total", kind="lifecycle")
                goodput = await scraped(url, f"{WORKER}tables_published_total", topic=table)
                # On a broker that earlier runs used, the worker also finds their bad records.
                lettered, _ = await bus.read_all(DEADLETTER_TOPIC)
    finally:
        await bus.close()
    _assert_equal(published, expected)
    assert f"dead-lettered {BAD}[" in log.read_text(), "the worker did not log it"
    [misplaced] = [e for e in lettered if e.payload.key == f"{dc}-misplaced"]
    assert "travels on tf.completions, not tf.telemetry" in misplaced.payload.reason
    mine = [e for e in lettered if e.source == app_id and e.payload.source_topic == BAD]
    assert len(mine) >= 1
    assert letters_counted == len(mine)
    assert taken_in >= sum(not isinstance(e.payload, InstanceTelemetry) for e in events)
    assert goodput > 0
    with_defaults = _reference(events, published[0].window_end, None)  # type: ignore[attr-defined]
    assert _goodput_tokens(expected) < _goodput_tokens(with_defaults)


def _goodput_tokens(tables: list[object]) -> int:
    goodput = next(t for t in tables if isinstance(t, GoodputTable))
    return sum(row.goodput_tokens for row in goodput.classes)


async def test_a_worker_killed_mid_stream_recovers_to_the_same_totals(kafka: Service) -> None:
    dc = f"dc-{uuid.uuid4().hex[:8]}"
    events = _events(dc)
    half = len(events) // 2
    app_id = f"tables-{dc}"
    with worker(kafka, app_id, log_level="INFO") as first:
        await _publish(kafka, events[:half])
        assert await _tables_appear(kafka, dc)  # it is working: kill it, unwarned
        first.send_signal(signal.SIGKILL)
        first.wait()
    await _publish(kafka, events[half:])
    with worker(kafka, app_id, log_level="INFO") as second:
        published, expected = await _published_equal_reference(kafka, dc, events)
        if not _equal(published, expected):  # its log, printed below, shows what it waits on
            second.send_signal(signal.SIGUSR1)
            await asyncio.sleep(1.0)
    _assert_equal(published, expected)


async def test_a_flush_before_a_commit_returns_once_the_broker_has_every_write(
    kafka: Service, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The worker flushes its producer before each offset commit. Writes held up on their
    way out of the producer's buffer, here 0.3 s each (as when a new topic's metadata is
    slow to come), have all been acknowledged when the flush returns: the last one too,
    which has left the buffer but not yet reached aiokafka's batches."""
    async with _producer_with_slow_buffer(kafka, tmp_path, monkeypatch) as (producer, raw):
        sent = [raw.send_soon(key=b"k", value=b"%d" % n) for n in range(4)]
        await producer.flush()
        assert all(message.done() and not message.exception() for message in sent)
    assert [m.result().offset for m in sent] == sorted(m.result().offset for m in sent)


async def test_a_write_the_broker_refused_fails_the_flush_and_so_the_commit(
    kafka: Service, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with _producer_with_slow_buffer(kafka, tmp_path, monkeypatch) as (producer, raw):
        refused = raw.send_soon(key=b"k", value=b"refused")
        refused.set_exception(KafkaError("the broker said no"))
        raw.send_soon(key=b"k", value=b"fine")
        with pytest.raises(RuntimeError, match="not delivered"):
            await producer.flush()
        with pytest.raises(RuntimeError, match="not delivered"):  # and at every later flush,
            await producer.flush()  # the one before the commit at shutdown included


async def test_a_write_the_producer_cannot_send_fails_the_flush_instead_of_hanging_it(
    kafka: Service, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """aiokafka refuses at once a record larger than a request may be: the buffer's sender
    fails on it, and no answer will ever come for it."""
    async with _producer_with_slow_buffer(kafka, tmp_path, monkeypatch) as (producer, raw):
        raw.send_soon(key=b"k", value=b"x" * 2_000_000)
        with pytest.raises(RuntimeError, match="not delivered"):
            await asyncio.wait_for(producer.flush(), 30)


@contextlib.asynccontextmanager
async def _producer_with_slow_buffer(
    kafka: Service, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[tuple[Any, Any]]:
    """A worker's producer, started, whose buffer takes 0.3 s to hand each write on, and a
    raw topic to write to."""
    settings = WorkerSettings(app_id=f"flush-{uuid.uuid4().hex[:8]}", data_dir=tmp_path)
    topic = updates_topic_of(settings)
    await create_topics(kafka.address, [topic])
    app = build_app(kafka.address, settings)
    producer = app.producer
    send = producer.buffer._send_pending

    async def slowly(message: Any) -> None:
        await asyncio.sleep(0.3)
        if not message.done():
            await send(message)

    monkeypatch.setattr(producer.buffer, "_send_pending", slowly)
    await producer.start()
    try:
        yield producer, app.topic(topic.name, key_serializer="raw", value_serializer="raw")
    finally:
        await producer.stop()


async def test_two_workers_sharing_the_partitions_end_with_the_same_totals(
    kafka: Service,
) -> None:
    dc = f"dc-{uuid.uuid4().hex[:8]}"
    events = _events(dc)
    app_id = f"tables-{dc}"
    with worker(kafka, app_id):
        await _publish(kafka, events[: len(events) // 3])
        # The first has joined requests that end later: the second, joining now (a
        # rebalance), recovers their join states from the changelog partitions it takes.
        assert await _tables_appear(kafka, dc)
        with worker(kafka, app_id):
            await _publish(kafka, events[len(events) // 3 :])
            published, expected = await _published_equal_reference(kafka, dc, events)
    _assert_equal(published, expected)


async def test_quiet_requests_are_forgotten_and_the_worker_goes_on(kafka: Service) -> None:
    """Join states untouched for a window and its grace are deleted (tombstones on the
    changelog, each in its own partition, swept while later events flow), and the worker
    keeps serving. A completion whose request never started is then counted late."""
    dc = f"dc-{uuid.uuid4().hex[:8]}"
    app_id = f"tables-{dc}"
    short = WindowSpec(size_s=5.0, slide_s=1.0, grace_s=1.0)
    orphan = _orphan_completion(dc)
    events = [*_events(dc), orphan]
    quiet = {e.payload.request_id for e in events if hasattr(e.payload, "request_id")}
    with worker(kafka, app_id, short) as process:
        await _publish(kafka, events)
        assert await _tables_appear(kafka, dc)
        forgotten = await _forgotten_while_events_flow(kafka, f"{app_id}-join-changelog", quiet)
        assert process.poll() is None
        late = await _tables_appear(kafka, dc, lambda t: t.classes[0].late_events > 0, 30.0)
    assert quiet <= forgotten
    assert late, "no published table counted the orphan completion late"


def _orphan_completion(dc: str) -> Envelope:
    """A completion of a request no other event names: held until forgotten."""
    completed = RequestCompleted(
        request_id=f"{dc}-orphan",
        dc=dc,
        instance_id=f"{dc}-i0",
        task_class=TaskClass.INTERACTIVE,
        tenant="t",
        input_tokens=10,
        cached_tokens=0,
        output_tokens=5,
        ttft_s=0.1,
        tpot_s=0.01,
        e2e_s=0.2,
    )
    return Envelope.wrap(completed, source="test", ts=time.time() - 300)


async def _forgotten_while_events_flow(
    kafka: Service, changelog: str, keys: set[str], timeout_s: float = 90.0
) -> set[str]:
    """Keys deleted on ``changelog`` (JSON strings), read while a few new requests are
    published every second, until all of ``keys`` are or ``timeout_s`` passes."""
    consumer = AIOKafkaConsumer(
        changelog, bootstrap_servers=kafka.address, auto_offset_reset="earliest"
    )
    await consumer.start()
    deleted: set[str] = set()
    try:
        async with asyncio.timeout(timeout_s):
            while not keys <= deleted:
                await _publish(kafka, _events(f"nudge-{uuid.uuid4().hex[:8]}")[:90])
                await asyncio.sleep(1.0)
                batches = await consumer.getmany(timeout_ms=100)
                for records in batches.values():
                    deleted |= {json.loads(r.key) for r in records if r.value is None and r.key}
    except TimeoutError:
        pass
    finally:
        await consumer.stop()
    return deleted

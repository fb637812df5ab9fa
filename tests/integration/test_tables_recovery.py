"""The table worker through a recovery, on a broker of its own."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from schemas import Envelope
from tests.conftest import own_broker_for_module
from tests.integration.test_tables_on_kafka import (
    _assert_equal,
    _events,
    _publish,
    _published_equal_reference,
    _tables_appear,
    reading,
    worker,
)
from tests.services import Service

pytestmark = pytest.mark.kafka

READINGS_WHILE_DOWN = 20_000
"""Telemetry published while the worker is down: more than an agent's queue holds (4,096),
so that the recovered worker fetches some while it seeks. (60,000 until 2026-12-07: the
suite's longest test, at 81 to 106 s; at 20,000 the test found events in the queues in
three runs of three without the fix, 3,467 to 3,599 of them.)"""


@pytest.fixture(scope="module")
def kafka(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    with own_broker_for_module(tmp_path_factory.mktemp("recovery")) as service:
        yield service


async def test_records_dropped_before_a_recovery_ends_are_read_again_without_a_commit(
    kafka: Service, tmp_path: Path
) -> None:
    """Faust skips records while it recovers and counts on the seek to the committed
    offsets to read them again; a partition without one must go back to its start. A new
    group (none of its partitions has a committed offset) throws away what it fetched
    before its first recovery ends, and still publishes every event's count. (It runs
    first: the other test's 20,000 readings would only slow it.)"""
    dc = f"dc-{uuid.uuid4().hex[:8]}"
    events = _events(dc)
    await _publish(kafka, events)
    dropped = tmp_path / "dropped"
    with worker(kafka, f"tables-{dc}", log_level="INFO", seek=("drop", dropped)):
        published, expected = await _published_equal_reference(kafka, dc, events)
    assert dropped.exists(), "the worker never ended a recovery"
    counts = [int(line) for line in dropped.read_text().split()]
    assert counts[0] > 0, "it had fetched nothing to throw away: the test shows nothing"
    _assert_equal(published, expected)


async def test_events_fetched_while_a_recovered_worker_seeks_are_not_dropped(
    kafka: Service, tmp_path: Path
) -> None:
    """At the end of a recovery Faust resumes the input partitions, seeks them to their
    committed offsets and then resumes flow control, which empties every agent's queue.
    Events fetched during the seek were dropped there, and a partition with no committed
    offset (the telemetry's here, first written while the worker was down) is not read
    again. The seek starts 3 s late, and the worker counts what its queues hold when the
    seek ends. (Without the fix this found events in two runs of three with 60,000
    readings, three of three with 20,000: whether the agents drained the queues within
    the 3 s varies.)"""
    dc = f"dc-{uuid.uuid4().hex[:8]}"
    events = _events(dc)
    half = len(events) // 2
    events += _readings(dc, events[-1].ts, READINGS_WHILE_DOWN)
    app_id = f"tables-{dc}"
    with worker(kafka, app_id, log_level="INFO"):
        await _publish(kafka, events[:half])
        assert await _tables_appear(kafka, dc)  # its changelogs hold state: stop it
    await _publish(kafka, events[half:])
    queued = tmp_path / "queued"
    with worker(kafka, app_id, log_level="INFO", seek=("late", queued)):
        published, expected = await _published_equal_reference(kafka, dc, events)
    counts = [int(line) for line in queued.read_text().split()]
    assert counts, "the restarted worker never ended a recovery"
    assert sum(counts) == 0, f"events left in the agents' queues to be emptied: {counts}"
    _assert_equal(published, expected)


def _readings(dc: str, after: float, count: int) -> list[Envelope]:
    """``count`` readings of the DC's two instances, a millisecond apart after ``after``,
    each with its own queue length: the tables show the last one of each instance."""
    return [
        reading(f"{dc}-i{n % 2}", dc, waiting=n, kv_blocks_used=100, ts=after + 0.001 * (n + 1))
        for n in range(count)
    ]

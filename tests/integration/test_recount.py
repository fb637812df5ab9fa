"""``tokenfleet recount`` on a real broker: the worker's published goodput table matches
the recount of the raw events, and a table that does not is caught, figure by figure."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from schemas import Envelope
from schemas.objectives import Objectives
from schemas.tables import GoodputTable
from streams.kafka import KafkaBus
from tests.conftest import own_broker_for_module
from tests.integration.test_tables_on_kafka import (
    SPEC,
    _events,
    _publish,
    _published_equal_reference,
    worker,
)
from tests.services import Service
from tokenfleet.cli import main
from tokenfleet.recount import recount_on

pytestmark = pytest.mark.kafka


@pytest.fixture(scope="module")
def kafka(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    with own_broker_for_module(tmp_path_factory.mktemp("recount")) as service:
        yield service


async def test_the_published_table_matches_the_recount_and_a_tampered_one_does_not(
    kafka: Service, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    dc = f"dc-{uuid.uuid4().hex[:8]}"
    events = _events(dc)
    with worker(kafka, f"recount-{dc}"):
        await _publish(kafka, events)
        await _published_equal_reference(kafka, dc, events)
    bus = KafkaBus(kafka.address, source="test")
    try:
        honest = await recount_on(bus, SPEC, Objectives(), [dc])
        [(published, recounted)] = honest.tables.values()
        assert honest.differences == []
        assert sum(r.completed for r in recounted.classes) > 0
        tampered = _with_one_more_completion(published)
        await bus.publish_event(Envelope.wrap(tampered, source="test"))
        caught = await recount_on(bus, SPEC, Objectives(), [dc])
    finally:
        await bus.close()
    figures = {(d.row, d.figure) for d in caught.differences}
    assert ("class:interactive", "completed") in figures
    assert all(row == "class:interactive" for row, _ in figures)
    monkeypatch.setenv("TOKENFLEET_KAFKA_BOOTSTRAP", kafka.address)
    for name, value in (("WINDOW_S", SPEC.size_s), ("SLIDE_S", SPEC.slide_s)):
        monkeypatch.setenv(f"TOKENFLEET_WORKER_{name}", str(value))
    monkeypatch.setenv("TOKENFLEET_WORKER_GRACE_S", str(SPEC.grace_s))
    cli = ["recount", "--dc", dc, "--json", str(tmp_path / "r.json")]
    assert await asyncio.to_thread(main, cli) == 1
    assert '"figure": "completed"' in (tmp_path / "r.json").read_text()


def _with_one_more_completion(table: GoodputTable) -> GoodputTable:
    chats = next(r for r in table.classes if r.key == "interactive")
    more = chats.model_copy(update={"completed": chats.completed + 1})
    rows = tuple(more if r is chats else r for r in table.classes)
    return table.model_copy(update={"version": table.version + 1, "classes": rows})

"""The auditors' commands on a real broker: ``tokenfleet recount`` (the worker's published
goodput table matches the recount of the raw events; a table that does not is caught,
figure by figure) and ``tokenfleet whatif`` (the recorded arrivals re-simulated)."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from schemas import DEADLETTER_TOPIC, Envelope
from schemas.base import TaskClass
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
from tests.unit.test_quota_controller import row, table
from tests.unit.test_whatif import LOCAL_FLEET, simulated_events
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
    model = f"model:{published.models[0].key}"  # only classes and tenants were compared
    assert figures == {("class:interactive", "completed"), (model, "completed")}
    monkeypatch.setenv("TOKENFLEET_KAFKA_BOOTSTRAP", kafka.address)
    for name, value in (("WINDOW_S", SPEC.size_s), ("SLIDE_S", SPEC.slide_s)):
        monkeypatch.setenv(f"TOKENFLEET_WORKER_{name}", str(value))
    monkeypatch.setenv("TOKENFLEET_WORKER_GRACE_S", str(SPEC.grace_s))
    cli = ["recount", "--dc", dc, "--json", str(tmp_path / "r.json")]
    assert await asyncio.to_thread(main, cli) == 1
    assert '"figure": "completed"' in (tmp_path / "r.json").read_text()


async def test_recount_of_a_dc_without_a_table_says_so_and_writes_no_letter(
    kafka: Service, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """It blamed a worker not running, though tables of other DCs were fresh, or, asked of
    two DCs of which one had a table, said nothing of the other and exited 0; and its read
    of the tables dead-lettered every undecodable one, at each run."""
    bus = KafkaBus(kafka.address, source="test")
    bad, quiet = f"dc-{uuid.uuid4().hex[:8]}", f"dc-{uuid.uuid4().hex[:8]}"
    nothing_ended = table((0, 0), (0, 0)).model_copy(update={"dc": quiet})
    try:
        await bus.publish("tf.tables.goodput", bad, b"{not json")
        await bus.publish_event(Envelope.wrap(nothing_ended, source="test"))
    finally:
        await bus.close()
    monkeypatch.setenv("TOKENFLEET_KAFKA_BOOTSTRAP", kafka.address)
    argv = ["recount", "--dc", quiet, "--dc", "nosuch"]
    assert await asyncio.to_thread(main, argv) == 1
    printed = capsys.readouterr().out
    assert "no goodput table published for nosuch\n" in printed
    assert f"{quiet}: window " in printed  # its table recounted, and matched
    # a model row no event stands for: the recount of a DC without events kept it
    chats = row(TaskClass.INTERACTIVE, 5, 5).model_copy(update={"key": "m"})
    phantom = nothing_ended.model_copy(update={"version": 2, "models": (chats,)})
    bus = KafkaBus(kafka.address, source="test")
    try:
        await bus.publish_event(Envelope.wrap(phantom, source="test"))
    finally:
        await bus.close()
    assert await asyncio.to_thread(main, ["recount", "--dc", quiet]) == 1
    assert f"DIFFERS {quiet} model:m completed: published 5, recounted None" in (
        capsys.readouterr().out
    )
    bus = KafkaBus(kafka.address, source="test")
    try:
        letters, _ = await bus.read_all(DEADLETTER_TOPIC)
    finally:
        await bus.close()
    assert not [letter for letter in letters if letter.payload.key == bad]


async def test_whatif_reads_the_recorded_arrivals_and_simulates_both_stacks(
    kafka: Service, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    await _publish(kafka, simulated_events("round_robin", requests=50))
    monkeypatch.setenv("TOKENFLEET_KAFKA_BOOTSTRAP", kafka.address)
    out = tmp_path / "whatif.json"
    cli = ["whatif", "--fleet", str(LOCAL_FLEET), "--policy", "round_robin"]
    assert (
        await asyncio.to_thread(
            main, [*cli, "--admission", "fcfs", "--dc", "dc-a", "--json", str(out)]
        )
        == 0
    )
    figures = json.loads(out.read_text())["dc-a"]
    assert figures["measured"]["completed"] == 50
    assert figures["round_robin + fcfs"]["completed"] == 50
    assert "tokenpilot + slomax" in figures  # the fleet file's stack, beside it
    refused = ["whatif", "--fleet", str(LOCAL_FLEET), "--policy", "tokenpilot"]
    assert await asyncio.to_thread(main, refused) == 2  # the stack that runs already
    fleet_wide = ["whatif", "--fleet", str(LOCAL_FLEET), "--json", str(out), "--dc-policy"]
    assert await asyncio.to_thread(main, [*fleet_wide, "local_only"]) == 0
    by_policy = json.loads(out.read_text())
    assert sorted(by_policy) == ["fleetmind", "local_only"]  # the gateways' policy beside it
    assert by_policy["local_only"]["cross_dc_share"] == 0.0
    assert by_policy["local_only"]["arrivals"] >= 50
    assert await asyncio.to_thread(main, [*fleet_wide, "fleetmind"]) == 2  # it runs already
    mixed = [*fleet_wide, "local_only", "--policy", "round_robin"]
    assert await asyncio.to_thread(main, mixed) == 2  # the fleet what-if runs the fleet's stack


def _with_one_more_completion(table: GoodputTable) -> GoodputTable:
    """One more chat completed, in the class row and the model's."""
    chats = next(r for r in table.classes if r.key == "interactive")
    more = chats.model_copy(update={"completed": chats.completed + 1})
    classes = tuple(more if r is chats else r for r in table.classes)
    first, *others = table.models
    models = (first.model_copy(update={"completed": first.completed + 1}), *others)
    update = {"version": table.version + 1, "classes": classes, "models": models}
    return table.model_copy(update=update)

"""The services the tests use are the real thing, at the address the run reports."""

from __future__ import annotations

import asyncio
import uuid
from urllib.parse import urlsplit

import pytest
import redis.asyncio as aioredis

from tests.services import Service
from tokenfleet.services.kafka import metadata_broker_count


@pytest.mark.kafka
def test_the_broker_answers_a_metadata_request(kafka: Service) -> None:
    host, port = kafka.address.rsplit(":", 1)
    assert metadata_broker_count(host, int(port)) == 1


@pytest.mark.redis
async def test_redis_is_a_real_server_running_lua_atomically(redis_server: Service) -> None:
    client = aioredis.from_url(redis_server.address)
    try:
        info = await client.info("server")
        assert info["tcp_port"] == urlsplit(redis_server.address).port
        assert info["redis_version"]
        add = client.register_script("return redis.call('INCRBY', KEYS[1], ARGV[1])")
        await client.delete("tf-test:counter")
        await asyncio.gather(*(add(keys=["tf-test:counter"], args=[n]) for n in range(1, 101)))
        assert int(await client.get("tf-test:counter")) == 5050
    finally:
        await client.aclose()


@pytest.mark.kafka
async def test_topic_creation_is_idempotent_and_follows_the_catalog(kafka: Service) -> None:
    from aiokafka.admin import AIOKafkaAdminClient

    from schemas import TOPICS
    from streams.kafka import create_topics

    assert await create_topics(kafka.address) == []  # the fixture created them already
    admin = AIOKafkaAdminClient(bootstrap_servers=kafka.address)
    await admin.start()
    try:
        described = {t["topic"]: t for t in await admin.describe_topics([t.name for t in TOPICS])}
    finally:
        await admin.close()
    for t in TOPICS:
        assert len(described[t.name]["partitions"]) == t.partitions, t.name


async def test_status_says_whether_the_loop_is_closed_from_the_topics(
    kafka: Service, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``tokenfleet status`` reads the compacted topics as any reader would: fresh tables
    and quotas in force close the loop (exit 0); a stale table opens it (exit 1), and so
    do tables from two table workers. A record that does not decode is passed over, and
    status writes nothing: no dead letter of it. The dead letters there are said. Only
    this test's DC is asked for: the broker is shared with the other tests."""
    import time

    from schemas import Envelope
    from schemas.control import AdmissionQuotas
    from schemas.deadletter import DeadLetter
    from schemas.topics import DEADLETTER_TOPIC
    from streams.kafka import KafkaBus
    from tests.unit.test_quota_controller import capacity, table
    from tokenfleet.cli import main

    dc = f"dc-{uuid.uuid4().hex[:8]}"
    monkeypatch.setenv("TOKENFLEET_KAFKA_BOOTSTRAP", kafka.address)

    async def publish(ended: float, version: int, worker: str = "test") -> None:
        bus = KafkaBus(kafka.address, source=worker)
        try:
            for payload in (
                table((100, 96), now=ended).model_copy(update={"dc": dc, "version": version}),
                capacity(2, now=ended).model_copy(update={"dc": dc, "version": version}),
                AdmissionQuotas(
                    scope=dc, version=version, issued_at=time.time(), ttl_s=60, quotas=()
                ),
            ):
                await bus.publish_event(Envelope.wrap(payload, source=worker))
        finally:
            await bus.close()

    async def dead_letters_of_this_dc() -> int:
        bus = KafkaBus(kafka.address, source="test")
        try:
            letters, _ = await bus.read_all(DEADLETTER_TOPIC)
        except LookupError:  # none yet on this broker
            return 0
        finally:
            await bus.close()
        return sum(isinstance(e.payload, DeadLetter) and e.payload.key == dc for e in letters)

    broken = KafkaBus(kafka.address, source="test")
    await broken.publish("tf.tables.goodput", dc, b"{not a table")
    letter = DeadLetter(
        source_topic=f"tf.{dc}", partition=0, offset=7, key=None, reason=dc, raw_b64=""
    )
    for replica in ("a gateway", "another"):  # one record, dead-lettered by each reader
        await broken.publish_event(Envelope.wrap(letter, source=replica, event_id=f"{dc}/0/7"))
    await broken.close()
    await publish(time.time(), 1)
    closed = await asyncio.to_thread(main, ["status", "--dc", dc])
    out = capsys.readouterr().out
    await publish(time.time() - 120, 2)
    opened = await asyncio.to_thread(main, ["status", "--dc", dc])
    assert closed == 0, out  # a dead letter is a note: its consumer went on
    assert f"tf.tables.goodput    {dc}" in out
    assert "dead letters on tf.deadletter: " in out
    assert f"tf.{dc} 1" in out  # a letter per record, not per reader
    assert f"tf.{dc} 2" not in out
    assert f"s ago, from tf.{dc}[0]@7: {dc}\n" in out
    assert await dead_letters_of_this_dc() == 0
    assert opened == 1
    assert f"tf.tables.goodput[{dc}] 120" in capsys.readouterr().out
    await publish(time.time(), 3, worker="tables-2")  # a second worker's: fresh, but two
    assert await asyncio.to_thread(main, ["status", "--dc", dc]) == 1
    assert f"table workers[{dc}] tables-2, test: run one app id" in capsys.readouterr().out


async def test_a_plain_kafka_client_reads_the_goodput_stream(kafka: Service) -> None:
    """``examples/goodput_consumer.py``, which knows nothing of the project but aiokafka
    and JSON, reads a table the project published, past a record that is no envelope."""
    import subprocess
    import sys
    import time
    import uuid
    from pathlib import Path

    from schemas import Envelope
    from streams.kafka import KafkaBus
    from tests.unit.test_quota_controller import table

    dc = f"dc-{uuid.uuid4().hex[:8]}"
    bus = KafkaBus(kafka.address, source="test")
    try:
        await bus.publish("tf.tables.goodput", dc, b"{not an envelope")
        published = table((100, 96), now=time.time()).model_copy(update={"dc": dc})
        await bus.publish_event(Envelope.wrap(published, source="test"))
    finally:
        await bus.close()
    example = Path(__file__).parents[2] / "examples" / "goodput_consumer.py"
    argv = [sys.executable, str(example), "--bootstrap", kafka.address, "--dc", dc]
    done = await asyncio.to_thread(
        subprocess.run, [*argv, "--tables", "1"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert "skipped tf.tables.goodput[0]@" in done.stderr
    interactive = next(line for line in done.stdout.splitlines() if " interactive:" in line)
    assert interactive.startswith(f"{dc} interactive: ")
    assert "96.0% in time (100 completed" in interactive


@pytest.mark.kafka
async def test_a_topic_made_elsewhere_with_other_partitions_is_named_at_start(
    kafka: Service,
) -> None:
    """The worker started on it, and stopped on its first event in a partition its
    changelog lacks, with an assertion of aiokafka's."""
    from schemas.topics import Topic
    from streams.kafka import PartitionsMismatch, create_topics

    name = f"tf-test-{uuid.uuid4().hex}"
    await create_topics(kafka.address, [Topic(name, "request_id", 12, False, 60_000, ())])
    with pytest.raises(PartitionsMismatch, match=f"{name} has 12 partitions.*need 6"):
        await create_topics(kafka.address, [Topic(name, "request_id", 6, False, 60_000, ())])


@pytest.mark.kafka
def test_topics_are_made_with_the_replication_the_environment_sets(
    kafka: Service, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every topic had one copy, whatever the cluster: a broker lost lost its topics, and
    managed Kafka that requires more refused them. Asked for two copies, the test's one
    broker says it cannot keep them, and the command says so."""
    from schemas.topics import Topic
    from tokenfleet.commands.broker import create_topics_on
    from tokenfleet.commands.errors import CliError

    monkeypatch.setenv("TOKENFLEET_KAFKA_REPLICATION", "2")
    topic = Topic(f"tf-test-{uuid.uuid4().hex}", "request_id", 1, False, 60_000, ())
    with pytest.raises(CliError, match="InvalidReplicationFactor"):
        create_topics_on(kafka.address, [topic])
    monkeypatch.setenv("TOKENFLEET_KAFKA_REPLICATION", "1")
    assert create_topics_on(kafka.address, [topic]) == [topic.name]

"""The services the tests use are the real thing, at the address the run reports."""

from __future__ import annotations

import asyncio
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

"""The lean Redis client against a real server: pipelined calls answered in order, a
call that times out failing alone with those behind it while later calls reconnect, a
database other than 0, scripts the server has not seen yet, a reply read in many chunks,
and options in a query string refused."""

from __future__ import annotations

import asyncio
import uuid

import pytest
import uvloop
from redis.exceptions import ResponseError, TimeoutError

from gateway.resp import LeanRedis
from tests.services import Service

pytestmark = pytest.mark.redis


async def test_a_reply_larger_than_a_read_arrives_whole(redis_server: Service) -> None:
    """A reply read in many chunks, beside small ones: each whole, as ``bytes``."""
    client = LeanRedis(redis_server.address, timeout_s=5.0)
    key = f"test-{uuid.uuid4().hex}"
    value = bytes(range(256)) * (12 * 4096)  # 12 MiB, every byte value, CRLFs among them
    try:
        await client.set(key, value, px=60_000)
        replies = await asyncio.gather(client.call("PING"), client.get(key), client.call("PING"))
        assert replies == [b"PONG", value, b"PONG"]
        assert all(type(reply) is bytes for reply in replies)
    finally:
        await client.delete(key)
        await client.aclose()


def test_options_in_a_query_string_are_refused_not_ignored() -> None:
    """``?db=3`` read as database 0 would let two fleets share every key."""
    with pytest.raises(ValueError, match="query string"):
        LeanRedis("redis://127.0.0.1:6379/?db=3", timeout_s=1.0)


async def test_calls_at_once_are_answered_each_with_its_own_reply(redis_server: Service) -> None:
    client = LeanRedis(redis_server.address, timeout_s=5.0)
    key = f"test-{uuid.uuid4().hex}"
    try:
        replies = await asyncio.gather(*(client.call("INCR", key) for _ in range(500)))
        assert replies == list(range(1, 501))  # each its own, in the order sent
        with pytest.raises(ResponseError):
            await client.call("INCR", key, "too many")
        assert await client.get(key) == b"500"
    finally:
        await client.aclose()


async def test_a_call_past_its_time_fails_with_those_behind_it_and_the_next_reconnects(
    redis_server: Service,
) -> None:
    client = LeanRedis(redis_server.address, timeout_s=0.2)
    key = f"test-{uuid.uuid4().hex}"
    try:
        await client.set(key, b"v")
        blocked = asyncio.create_task(client.call("BLPOP", f"{key}-empty", "1"))
        behind = asyncio.create_task(client.get(key))
        for call in (blocked, behind):
            with pytest.raises(TimeoutError):
                await call
        assert await client.get(key) == b"v"
    finally:
        await client.aclose()


async def test_a_connection_the_server_dropped_is_opened_again(redis_server: Service) -> None:
    client = LeanRedis(redis_server.address, timeout_s=5.0)
    admin = LeanRedis(redis_server.address, timeout_s=5.0)
    try:
        await admin.call("CLIENT", "KILL", "ID", str(await client.call("CLIENT", "ID")))
        await asyncio.sleep(0.1)  # the loop has read the server's hang-up
        assert await client.call("PING") == b"PONG"
    finally:
        await client.aclose()
        await admin.aclose()


async def test_calls_to_a_server_that_never_answers_all_fail_within_their_time() -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await reader.read(-1)  # reads until the client leaves, answers nothing
        finally:
            writer.close()
            left.set()

    left = asyncio.Event()

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    client = LeanRedis(f"redis://127.0.0.1:{port}", timeout_s=0.2)
    try:
        started = asyncio.get_running_loop().time()
        calls = [client.call("PING") for _ in range(20)]
        failed = await asyncio.gather(*calls, return_exceptions=True)
        assert all(isinstance(f, TimeoutError) for f in failed)
        assert asyncio.get_running_loop().time() - started < 1.0  # together, not in turn
    finally:
        await client.aclose()
        await asyncio.wait_for(left.wait(), 5.0)
        server.close()
        await server.wait_closed()


async def test_a_database_and_a_script_new_to_the_server(redis_server: Service) -> None:
    third = LeanRedis(f"{redis_server.address.rsplit('/', 1)[0]}/3", timeout_s=5.0)
    first = LeanRedis(redis_server.address, timeout_s=5.0)
    key = f"test-{uuid.uuid4().hex}"
    script = third.register_script(f"return redis.call('SET', KEYS[1], ARGV[1]) -- {key}")
    try:
        assert await script(keys=[key], args=["in 3"]) == b"OK"  # sent whole, then by SHA1
        assert await script(keys=[key], args=["in 3"]) == b"OK"
        assert await third.get(key) == b"in 3"
        assert await first.get(key) is None
        assert await first.set(key, b"x", nx=True, px=1000)
        assert not await first.set(key, b"y", nx=True, px=1000)
    finally:
        await third.aclose()
        await first.aclose()


def test_on_uvloop_as_the_gateway_runs(redis_server: Service) -> None:
    """uvloop's transports are not asyncio's classes; the gateway runs on uvloop."""

    async def calls() -> list[object]:
        client = LeanRedis(redis_server.address, timeout_s=5.0)
        try:
            return await asyncio.gather(client.call("PING"), client.call("ECHO", "x"))
        finally:
            await client.aclose()

    assert uvloop.run(calls()) == [b"PONG", b"x"]

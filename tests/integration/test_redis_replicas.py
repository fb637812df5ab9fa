"""Gateway replicas sharing one Redis: a decision checked and charged in one round trip,
what refuses a charge made on a view (another replica's charge to the instance chosen, a
rewrite of its share, a changed match) and what does not (its charges to other instances,
its releases), releases riding on the next charge, and the replicas' admission loads and
ceiling slots."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Awaitable

import pytest

from gateway.redis_state import RedisState
from gateway.resp import LeanRedis
from gateway.state import LEAVE, SlotClaim
from tests.services import Service


@pytest.mark.redis
async def test_a_decision_is_one_round_trip_to_redis(
    redis_server: Service, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once a replica has read a pool, a speculative view costs no call and its checked
    charge one; a view checked after another replica charged the instance chosen is
    refused, and the refusal carries the fresh read, so the decision made again is charged
    in one more call. A charge to another instance only made that one busier: it refuses
    nothing."""
    async with _two_replicas(redis_server) as (one, two):
        sent = _calls_of(one, monkeypatch)

        async def calls(action: Awaitable[bool]) -> tuple[bool, int]:
            sent.clear()
            return await action, len(sent)

        async def decision(state: RedisState, instance: str, blocks: tuple[int, ...]) -> bool:
            view = await state.view(["a", "b"], blocks, speculative=True)
            return await state.routed(instance, blocks, 100, 1.0, 2.0, seen_version=view.version)

        for state in (one, two):  # each replica reads the pool once, and loads the scripts
            assert await decision(state, "a", (1,))
        await one.view(["a", "b"], ())  # and one has read what two wrote
        assert await calls(decision(one, "a", (1, 2))) == (True, 1)
        assert await calls(decision(one, "b", (3,))) == (True, 1)
        await two.routed("b", (), 100, 0.0, 2.0)  # the other replica's charge elsewhere
        assert await calls(decision(one, "a", (1, 2))) == (True, 1)
        await two.routed("a", (), 100, 0.0, 2.0)  # and to the instance chosen
        assert await calls(decision(one, "a", (1, 2))) == (False, 1)
        assert await calls(decision(one, "a", (1, 2))) == (True, 1)  # decided again
        view = await one.view(["a", "b"], (4,), speculative=True)
        await two.routed("b", (4,), 100, 0.0, 0.0)  # and to the index
        assert not await one.routed("a", (4,), 100, 1.0, 2.0, seen_version=view.version)
        view = await one.view(["a", "b"], (4,), speculative=True)
        assert view.matched_blocks.tolist() == [0, 1]  # learnt from the refusal
        assert view.inflight_tokens.tolist() == [12.0, 4.0]
        assert await calls(decision(one, "b", (4,))) == (True, 1)
        stale = one.routed("a", (5,), 100, 1.0, 2.0, seen_version=view.version)
        assert await calls(stale) == (False, 0)  # older than this replica's last route


@pytest.mark.redis
async def test_a_checked_charge_brings_back_what_the_others_wrote_for_the_next_view(
    redis_server: Service, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The charge's script read the other replicas' state for its check: the next view
    rests on that, with no call of its own. Views known for longer (50 ms by default) went
    on missing the other replica's charges, and the next decision on the instance it
    charged was refused: with two replicas, most decisions were made twice."""
    async with _two_replicas(redis_server, known_for_s=60.0) as (one, two):
        sent = _calls_of(one, monkeypatch)
        await two.routed("b", (), 100, 0.0, 0.0)  # two is live (a newcomer refuses)
        view = await one.view(["a", "b"], ())
        await two.routed("a", (), 100, 0.0, 7.0)
        assert await one.routed("b", (), 100, 0.0, 1.0, seen_version=view.version)
        sent.clear()
        view = await one.view(["a", "b"], (), speculative=True)
        assert sent == []
        assert view.inflight_tokens.tolist() == [7.0, 1.0]
        assert await one.routed("a", (), 100, 0.0, 1.0, seen_version=view.version)


@pytest.mark.redis
async def test_another_replica_s_release_refuses_no_charge_and_shows_at_the_next_read(
    redis_server: Service,
) -> None:
    """A release can only make a view's instance look busier than it is (as one that waits
    for a charge to carry it does), so it does not make a charge on that view wait for a
    fresh read; the next read shows it. A charge by the other replica to the instance
    chosen still refuses."""
    async with _two_replicas(redis_server) as (one, two):
        await two.routed("b", (), 100, 10.0, 20.0)
        view = await one.view(["a", "b"], (), speculative=True)
        assert view.inflight_tokens.tolist() == [0.0, 20.0]
        await two.adjust("b", -10.0, -20.0)
        await two.flush()
        assert await one.routed("a", (), 100, 1.0, 1.0, seen_version=view.version)
        view = await one.view(["a", "b"], ())
        assert view.inflight_tokens.tolist() == [1.0, 0.0]
        await two.routed("a", (), 100, 0.0, 5.0)
        assert not await one.routed("a", (), 100, 1.0, 1.0, seen_version=view.version)


@pytest.mark.redis
async def test_a_refused_charge_carrying_releases_refuses_no_other_replica_s_charge(
    redis_server: Service,
) -> None:
    """A refused charge still writes the releases it carries; they move no mark, so the
    other replica's charge on a view from before them goes through (it was refused in
    turn, each refusal inviting the next)."""
    async with _two_replicas(redis_server, hold_s=1.0) as (one, two):
        await one.routed("a", (), 100, 10.0, 10.0)
        stale = await one.view(["a", "b"], (), speculative=True)
        await two.routed("a", (), 100, 0.0, 1.0)  # one's view is out of date
        current = await two.view(["a", "b"], (), speculative=True)
        await one.adjust("a", -10.0, -10.0)  # held for one's next charge
        assert not await one.routed("a", (), 100, 1.0, 1.0, seen_version=stale.version)
        assert await two.routed("b", (), 100, 0.0, 1.0, seen_version=current.version)
        view = await two.view(["a", "b"], ())
        assert view.inflight_tokens.tolist() == [1.0, 1.0]  # the release was written


@pytest.mark.redis
async def test_another_replica_s_rewrite_of_its_share_refuses_a_charge(
    redis_server: Service,
) -> None:
    """A rewrite (``reconcile``) may raise the other replica's share (a change made while
    Redis was away comes back), so a view from before it is out of date."""
    async with _two_replicas(redis_server) as (one, two):
        await two.routed("b", (), 100, 0.0, 5.0)
        view = await one.view(["a", "b"], (), speculative=True)
        await two.reconcile()
        assert not await one.routed("a", (), 100, 1.0, 1.0, seen_version=view.version)


@pytest.mark.redis
async def test_a_first_token_or_an_end_rides_on_the_next_charge_in_its_pool(
    redis_server: Service, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``adjust`` makes no call of its own while charges come: the replica counts the
    change at once, the other replicas once the next charge (refused or not) carried it;
    with no charge, it goes alone ``hold_s`` after it was made."""
    async with _two_replicas(redis_server, hold_s=1.0) as (one, two):
        sent = _calls_of(one, monkeypatch)

        async def seen_by(state: RedisState) -> tuple[list[float], list[float]]:
            view = await state.view(["a", "b"], (), speculative=state is one)
            return view.pending_prefill.tolist(), view.inflight_tokens.tolist()

        await one.routed("a", (), 100, 10.0, 20.0)
        await one.adjust("a", 0.0, 0.0)
        await one.flush()
        await one.view(["a", "b"], ())  # one has read the pool, and loaded the scripts
        sent.clear()
        await one.adjust("a", -10.0, 0.0)
        view = await one.view(["a", "b"], (), speculative=True)
        assert view.pending_prefill.tolist() == [0.0, 0.0]
        assert sent == []
        assert await seen_by(two) == ([10.0, 0.0], [20.0, 0.0])
        await one.routed("b", (5, 6), 100, 1.0, 1.0)
        assert len(sent) == 1
        assert await seen_by(two) == ([0.0, 1.0], [20.0, 1.0])
        assert await seen_by(one) == ([0.0, 1.0], [20.0, 1.0])  # counted once
        assert (await two.view(["a", "b"], (5, 6))).matched_blocks.tolist() == [0, 2]

        await one.adjust("a", 0.0, -20.0)
        view = await one.view(["a", "b"], (), speculative=True)
        await two.routed("a", (), 100, 0.0, 0.0)  # another replica charged it: refused
        sent.clear()
        assert not await one.routed("a", (), 100, 1.0, 1.0, seen_version=view.version)
        assert len(sent) == 1
        assert await seen_by(two) == ([0.0, 1.0], [0.0, 1.0])

        sent.clear()
        await one.adjust("b", -1.0, -1.0)
        assert await seen_by(two) == ([0.0, 1.0], [0.0, 1.0])
        for _ in range(50):
            if await seen_by(two) == ([0.0, 0.0], [0.0, 0.0]):
                break
            await asyncio.sleep(0.1)
        assert await seen_by(two) == ([0.0, 0.0], [0.0, 0.0])
        assert len(sent) == 1


@pytest.mark.redis
async def test_what_a_speculative_view_rests_on_is_read_again_once_it_is_old(
    redis_server: Service,
) -> None:
    """Admission holds and refuses on views no charge checks: what other replicas wrote
    shows in them within ``known_for_s``."""
    async with _two_replicas(redis_server, known_for_s=0.2) as (one, two):
        await two.routed("a", (), 100, 500.0, 500.0)
        assert (await one.view(["a"], (), speculative=True)).pending_prefill.tolist() == [500.0]
        await two.adjust("a", -500.0, 0.0)
        assert (await one.view(["a"], (), speculative=True)).pending_prefill.tolist() == [500.0]
        await asyncio.sleep(0.25)
        assert (await one.view(["a"], (), speculative=True)).pending_prefill.tolist() == [0.0]


@pytest.mark.redis
async def test_of_two_charges_on_views_from_before_both_only_the_first_sent_is_written(
    redis_server: Service,
) -> None:
    state = RedisState(redis_server.address, f"test-{uuid.uuid4().hex}:")
    try:
        first = await state.view(["a", "b"], (), speculative=True)
        second = await state.view(["a", "b"], (), speculative=True)
        written = await asyncio.gather(
            state.routed("a", (1,), 100, 1.0, 1.0, seen_version=first.version),
            state.routed("b", (2,), 100, 1.0, 1.0, seen_version=second.version),
        )
        assert written == [True, False]
    finally:
        await state.close()


@pytest.mark.redis
async def test_a_view_whose_blocks_another_replica_unindexed_is_refused(
    redis_server: Service,
) -> None:
    """KV events change no replica's mark: the script compares the match itself."""
    async with _two_replicas(redis_server) as (one, two):
        await one.routed("a", (1, 2), 100, 0.0, 0.0)
        view = await one.view(["a", "b"], (1, 2), speculative=True)
        assert view.matched_blocks.tolist() == [2, 0]
        await two.evicted("a", (2,))
        assert not await one.routed("b", (1, 2), 100, 0.0, 0.0, seen_version=view.version)
        view = await one.view(["a", "b"], (1, 2), speculative=True)
        assert view.matched_blocks.tolist() == [1, 0]
        assert await one.routed("b", (1, 2), 100, 0.0, 0.0, seen_version=view.version)


@pytest.mark.redis
async def test_replicas_read_each_other_s_admission_load_until_it_expires(
    redis_server: Service,
) -> None:
    async with _two_replicas(redis_server, load_ttl_s=0.5) as (one, two):
        assert (await one.admission_loads("1")).others == []
        assert (await two.admission_loads("2")).others == ["1"]
        assert (await one.admission_loads("1 again")).others == ["2"]
        await asyncio.sleep(0.6)  # two fell silent
        assert (await one.admission_loads("1")).others == []


@pytest.mark.redis
async def test_replicas_hold_the_slots_of_a_ceiling_apart_and_a_silent_one_frees_its_own(
    redis_server: Service,
) -> None:
    """A ceiling of four: a replica gets what it asks for while the live replicas' slots
    stay within four, keeps at least what it runs; a replica that fell silent holds none,
    nor does one that left (its load still live); claims of another ceiling are counted
    apart."""

    async def granted(state: RedisState, running: int, wanted: int) -> tuple[int, int]:
        claims = {"m/dc/long_document": SlotClaim(running, wanted, 4), "other": SlotClaim(0, 1, 1)}
        loads = await state.admission_loads("{}", claims)
        return loads.granted["m/dc/long_document"], loads.granted["other"]

    async with _two_replicas(redis_server, load_ttl_s=0.5) as (one, two):
        assert await granted(one, 0, 4) == (4, 1)
        assert await granted(two, 0, 2) == (0, 0)
        assert await granted(one, 1, 1) == (1, 1)  # gives three back
        assert await granted(two, 0, 4) == (3, 0)
        assert await granted(one, 2, 4) == (2, 1)  # runs two: never fewer
        assert await granted(two, 3, 3) == (3, 0)
        await asyncio.sleep(0.6)  # two fell silent
        assert await granted(one, 0, 4) == (4, 1)
    async with _two_replicas(redis_server, load_ttl_s=30.0) as (one, two):
        assert await granted(one, 0, 4) == (4, 1)
        assert await granted(two, 0, 4) == (0, 0)
        claims = {"m/dc/long_document": SlotClaim(0, 0, 0), "other": SlotClaim(0, 0, 0)}
        await one.admission_loads(LEAVE, claims)
        assert (await two.admission_loads("{}")).others == []  # one left: not counted
        assert await granted(two, 0, 4) == (4, 1)


def _calls_of(state: RedisState, monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """The commands ``state`` sends to Redis from now on, as they go."""
    sent: list[object] = []
    send = state._redis.call

    async def counted(*args: object, **options: object) -> object:
        sent.append(args[0])
        return await send(*args, **options)

    monkeypatch.setattr(state._redis, "call", counted)
    return sent


@contextlib.asynccontextmanager
async def _two_replicas(
    redis: Service, **options: float
) -> AsyncIterator[tuple[RedisState, RedisState]]:
    """Replicas ``one`` and ``two`` sharing one prefix on ``redis``; ``options`` go to both."""
    prefix = f"test-{uuid.uuid4().hex}:"
    one = RedisState(redis.address, prefix, replica="one", **options)
    two = RedisState(redis.address, prefix, replica="two", **options)
    try:
        yield one, two
    finally:
        await one.close()
        await two.close()


@pytest.mark.redis
async def test_a_database_named_in_the_query_string_holds_the_state(redis_server: Service) -> None:
    """``?db=N`` (redis-py reads it; the lean client does not) keeps a fleet's keys in
    database N: read as 0, two fleets kept apart by it shared every key."""
    prefix = f"test-{uuid.uuid4().hex}:"
    server = redis_server.address.rsplit("/", 1)[0]
    state = RedisState(f"{server}/?db=5", prefix)
    in_5, in_0 = (LeanRedis(f"{server}/{db}", timeout_s=5.0) for db in (5, 0))
    try:
        await state.routed("a", (1,), 100, 1.0, 1.0)
        pattern = f"{prefix}*"
        assert await in_5.call("KEYS", pattern)
        assert not await in_0.call("KEYS", pattern)
    finally:
        await state.close()
        await in_5.aclose()
        await in_0.aclose()

"""One contract for the gateways' shared state, run on the in-process state, on a real
Redis server and on a Redis Cluster of three nodes; and the fallback from Redis to local
state."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Awaitable
from pathlib import Path

import numpy as np
import pytest
from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster

from gateway.fallback_state import FallbackState, RedisAway
from gateway.redis_state import RedisState
from gateway.state import (
    IN_PROGRESS,
    LEAVE,
    Accounting,
    LocalState,
    Outcome,
    SharedState,
    SlotClaim,
)
from tests.services import Service
from tokenfleet.services.process import free_port
from tokenfleet.services.redis import LocalRedis


@pytest.fixture(
    params=[
        "local",
        pytest.param("redis", marks=pytest.mark.redis),
        pytest.param("cluster", marks=pytest.mark.redis),
    ]
)
async def state(request: pytest.FixtureRequest) -> AsyncIterator[SharedState]:
    if request.param == "local":
        yield LocalState()
        return
    prefix = f"test-{uuid.uuid4().hex}:"
    if request.param == "cluster":
        cluster: Service = request.getfixturevalue("redis_cluster")
        redis = RedisState(cluster.address, prefix, cluster=True)
    else:
        server: Service = request.getfixturevalue("redis_server")
        redis = RedisState(server.address, prefix)
    try:
        yield redis
    finally:
        await redis.close()


async def test_accounting_adds_up_per_instance(state: SharedState) -> None:
    await state.routed("a", (), 100, pending_prefill=500.0, inflight_tokens=700.0)
    await state.routed("a", (), 100, pending_prefill=300.0, inflight_tokens=400.0)
    await state.adjust("a", -500.0, 0.0)
    view = await state.view(["a", "b"], ())
    np.testing.assert_allclose(view.pending_prefill, [300.0, 0.0])
    np.testing.assert_allclose(view.inflight_tokens, [1100.0, 0.0])


async def test_prefix_match_is_greedy_from_the_first_block(state: SharedState) -> None:
    await state.routed("a", (1, 2, 3, 4), 100, 0.0, 0.0)
    await state.routed("b", (1, 2), 100, 0.0, 0.0)
    await state.routed("c", (9, 3, 4), 100, 0.0, 0.0)
    view = await state.view(["a", "b", "c", "d"], (1, 2, 3, 4, 5))
    # As in the prefix-cache scorer, each holder of block k gains one while anyone holds
    # every block up to k; c gains for 3 and 4 though it lacks 1 and 2.
    assert view.matched_blocks.tolist() == [4, 2, 2, 0]
    assert (await state.view(["a"], (7, 1))).matched_blocks.tolist() == [0]


async def test_an_instance_forgets_its_least_recently_used_blocks(state: SharedState) -> None:
    await state.routed("a", (1, 2, 3), 4, 0.0, 0.0)
    await state.routed("a", (1,), 4, 0.0, 0.0)  # 1 is now the most recently used
    await state.routed("a", (7, 8), 4, 0.0, 0.0)  # five blocks in four places: 2 goes
    assert (await state.view(["a"], (1, 2))).matched_blocks.tolist() == [1]
    assert (await state.view(["a"], (7, 8))).matched_blocks.tolist() == [2]


async def test_a_route_decided_on_a_stale_view_is_refused(state: SharedState) -> None:
    seen = (await state.view(["a", "b"], ())).version
    assert await state.routed("a", (1,), 100, 10.0, 20.0, seen_version=seen)
    assert not await state.routed("b", (2,), 100, 10.0, 20.0, seen_version=seen)
    view = await state.view(["a", "b"], (2,))
    assert view.pending_prefill.tolist() == [10.0, 0.0]  # the refused one wrote nothing
    assert view.matched_blocks.tolist() == [0, 0]
    assert await state.routed("b", (2,), 100, 10.0, 20.0, seen_version=view.version)
    assert await state.routed("b", (2,), 100, 10.0, 20.0)  # without a version: always


async def test_kv_events_correct_the_index(state: SharedState) -> None:
    await state.routed("a", (1, 2, 3), 100, 0.0, 0.0)
    await state.routed("b", (1, 2, 3), 100, 0.0, 0.0)
    await state.evicted("a", (3, 99))  # 99 was never indexed there
    await state.evicted("c", (1,))  # nor was anything of c
    assert (await state.view(["a", "b"], (1, 2, 3))).matched_blocks.tolist() == [2, 3]
    await state.cleared("b")
    assert (await state.view(["a", "b"], (1, 2, 3))).matched_blocks.tolist() == [2, 0]
    await state.routed("b", (1,), 100, 0.0, 0.0)  # and it learns again afterwards
    assert (await state.view(["a", "b"], (1, 2, 3))).matched_blocks.tolist() == [2, 1]


async def test_a_token_bucket_admits_its_burst_then_says_when(state: SharedState) -> None:
    bucket = f"b-{uuid.uuid4().hex}"
    assert await state.take(bucket, 10.0, 100.0, 60.0) == 0.0
    assert await state.take(bucket, 10.0, 100.0, 40.0) == 0.0
    wait = await state.take(bucket, 10.0, 100.0, 50.0)
    assert 4.0 < wait <= 5.0  # 50 tokens at 10 a second, less what refilled meanwhile
    assert await state.take(bucket, 0.0, 10.0, 20.0) == float("inf")


async def test_an_idempotency_key_is_held_then_settled(state: SharedState) -> None:
    key = f"k-{uuid.uuid4().hex}"
    assert await state.claim(key, 60.0) is None
    assert await state.claim(key, 60.0) is IN_PROGRESS
    outcome = Outcome(200, "application/json", b'{"ok": true}')
    await state.settle(key, outcome, 60.0)
    assert await state.claim(key, 60.0) == outcome


async def test_a_released_key_runs_again(state: SharedState) -> None:
    key = f"k-{uuid.uuid4().hex}"
    assert await state.claim(key, 60.0) is None
    await state.release(key)
    assert await state.claim(key, 60.0) is None


def _without_redis(fallbacks: list[int]) -> FallbackState:
    """A fallback state in front of a port no Redis listens on, counting its fallbacks."""
    return FallbackState(
        RedisState(f"redis://127.0.0.1:{free_port()}/0", timeout_s=0.2),
        LocalState(),
        on_fallback=lambda: fallbacks.append(1),
    )


async def test_without_redis_the_fallback_answers_locally_and_counts() -> None:
    fallbacks: list[int] = []
    state = _without_redis(fallbacks)
    await state.routed("a", (1, 2), 100, 10.0, 20.0)
    view = await state.view(["a"], (1, 2))
    assert view.matched_blocks.tolist() == [2]
    assert view.pending_prefill.tolist() == [10.0]
    assert state.degraded
    assert len(fallbacks) == 2  # one failure, then local answers, without a try, until
    # the retry time: each counted
    with pytest.raises(RedisAway):  # no other replica is known locally: none is made up
        await state.admission_loads("{}")
    await state.close()


async def test_without_redis_admission_loads_fail_and_are_not_counted_as_local_answers() -> None:
    fallbacks: list[int] = []
    state = _without_redis(fallbacks)
    with pytest.raises(RedisAway):
        await state.admission_loads("{}")
    assert state.degraded
    assert fallbacks == []
    await state.close()


async def test_a_speculative_view_sees_the_replica_s_own_writes_as_a_read_does(
    state: SharedState,
) -> None:
    """Charges, ends, blocks an instance forgot for room and KV events: after each, the
    view a replica builds from what it knows equals the one it reads."""
    ids, blocks = ["a", "b"], (1, 2, 3, 4)

    # on Redis, another replica reads what this one wrote there
    peer = (
        RedisState(state.url, state.prefix, cluster=state.cluster)
        if isinstance(state, RedisState)
        else None
    )

    async def same_views() -> None:
        speculative = await state.view(ids, blocks, speculative=True)
        reads = [await state.view(ids, blocks)]
        if peer is not None:
            await state.flush()  # the end it holds for a charge to carry
            reads.append(await peer.view(ids, blocks))
        for read in reads:
            for field in ("pending_prefill", "inflight_tokens", "matched_blocks"):
                assert getattr(speculative, field).tolist() == getattr(read, field).tolist()

    await same_views()
    steps = [
        state.routed("a", (1, 2, 3), 3, 30.0, 50.0),
        state.routed("b", (1, 2), 3, 20.0, 40.0),
        state.routed("a", (9, 1), 3, 10.0, 10.0),  # a forgets 2 and 3 for room
        state.adjust("a", -30.0, -50.0),
        state.evicted("b", (2,)),
        state.routed("a", (2, 3), 3, 0.0, 0.0),
        state.cleared("a"),
    ]
    try:
        for step in steps:
            await step
            await same_views()
    finally:
        if peer is not None:
            await peer.close()


@pytest.mark.redis
async def test_a_decision_is_one_round_trip_to_redis(
    redis_server: Service, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once a replica has read a pool, a speculative view costs no call and its checked
    charge one; a view checked after another replica charged is refused, and the refusal
    carries the fresh read, so the decision made again is charged in one more call."""
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
        await two.routed("b", (), 100, 0.0, 2.0)  # the other replica's charge
        assert await calls(decision(one, "a", (1, 2))) == (False, 1)
        assert await calls(decision(one, "a", (1, 2))) == (True, 1)  # decided again
        view = await one.view(["a", "b"], (4,), speculative=True)
        await two.routed("b", (4,), 100, 0.0, 0.0)  # and to the index
        assert not await one.routed("a", (4,), 100, 1.0, 2.0, seen_version=view.version)
        view = await one.view(["a", "b"], (4,), speculative=True)
        assert view.matched_blocks.tolist() == [0, 1]  # learnt from the refusal
        assert view.inflight_tokens.tolist() == [8.0, 4.0]
        assert await calls(decision(one, "b", (4,))) == (True, 1)
        stale = one.routed("a", (5,), 100, 1.0, 2.0, seen_version=view.version)
        assert await calls(stale) == (False, 0)  # older than this replica's last route


@pytest.mark.redis
async def test_another_replica_s_release_refuses_no_charge_and_shows_at_the_next_read(
    redis_server: Service,
) -> None:
    """A release can only make a view's instance look busier than it is (as one that waits
    for a charge to carry it does), so it does not make a charge on that view wait for a
    fresh read; the next read shows it. A charge by the other replica still refuses."""
    async with _two_replicas(redis_server) as (one, two):
        await two.routed("b", (), 100, 10.0, 20.0)
        view = await one.view(["a", "b"], (), speculative=True)
        assert view.inflight_tokens.tolist() == [0.0, 20.0]
        await two.adjust("b", -10.0, -20.0)
        await two.flush()
        assert await one.routed("a", (), 100, 1.0, 1.0, seen_version=view.version)
        view = await one.view(["a", "b"], ())
        assert view.inflight_tokens.tolist() == [1.0, 0.0]
        await two.routed("b", (), 100, 0.0, 5.0)
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
        await two.routed("b", (), 100, 0.0, 1.0)  # one's view is out of date
        current = await two.view(["a", "b"], (), speculative=True)
        await one.adjust("a", -10.0, -10.0)  # held for one's next charge
        assert not await one.routed("a", (), 100, 1.0, 1.0, seen_version=stale.version)
        assert await two.routed("b", (), 100, 0.0, 1.0, seen_version=current.version)
        view = await two.view(["a", "b"], ())
        assert view.inflight_tokens.tolist() == [0.0, 2.0]  # the release was written


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
        await two.routed("b", (), 100, 0.0, 0.0)  # another replica charged: refused
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


async def test_a_replica_never_reads_its_own_admission_load_back(state: SharedState) -> None:
    """Nor does it compete with itself for slots; a state nothing shares grants none (the
    replica keeps its ceilings itself)."""
    assert (await state.admission_loads('{"m/dc": {}}')).others == []
    claims = {"m/dc/long_document": SlotClaim(running=1, wanted=3, limit=4)}
    loads = await state.admission_loads("{}", claims)
    assert loads.others == []
    assert loads.granted == ({} if isinstance(state, LocalState) else {"m/dc/long_document": 3})
    again = await state.admission_loads("{}", claims)
    assert again.granted == loads.granted


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


@pytest.mark.redis
async def test_a_replica_that_stops_rewriting_its_share_stops_counting(
    redis_server: Service,
) -> None:
    """A replica that died mid-request must not leave its tokens on the instance forever."""
    prefix = f"test-{uuid.uuid4().hex}:"
    alive = RedisState(redis_server.address, prefix, replica="alive", share_ttl_s=0.5)
    dead = RedisState(redis_server.address, prefix, replica="dead", share_ttl_s=0.5)
    try:
        await alive.routed("a", (), 100, 10.0, 20.0)
        await dead.routed("a", (), 100, 1.0, 2.0)
        assert (await alive.view(["a"], ())).inflight_tokens.tolist() == [22.0]
        for _ in range(4):  # the living one reconciles; the dead one is silent
            await asyncio.sleep(0.25)
            await alive.reconcile()
        view = await alive.view(["a"], ())
        assert view.pending_prefill.tolist() == [10.0]
        assert view.inflight_tokens.tolist() == [20.0]
    finally:
        await alive.close()
        await dead.close()


@pytest.mark.redis
async def test_reconcile_rewrites_a_share_from_the_replicas_own_record(
    redis_server: Service,
) -> None:
    """An update lost on the way (here: overwritten behind the replica's back) is mended:
    the other replicas read the replica's share; the replica itself counts its record."""
    prefix = f"test-{uuid.uuid4().hex}:"
    state = RedisState(redis_server.address, prefix, replica="r")
    peer = RedisState(redis_server.address, prefix, replica="peer")
    other = Redis.from_url(redis_server.address)
    try:
        await state.routed("a", (), 100, 10.0, 20.0)
        await state.adjust("a", -10.0, 0.0)
        await state.flush()
        await other.hset(f"{prefix}acct:r:inflight", "a", 999.0)
        assert (await peer.view(["a"], ())).inflight_tokens.tolist() == [999.0]
        assert (await state.view(["a"], ())).inflight_tokens.tolist() == [20.0]
        await state.reconcile()
        view = await peer.view(["a"], ())
        assert view.pending_prefill.tolist() == [0.0]
        assert view.inflight_tokens.tolist() == [20.0]
    finally:
        await state.close()
        await peer.close()
        await other.aclose()


@pytest.mark.redis
async def test_a_reconcile_amid_writes_loses_none_of_them(redis_server: Service) -> None:
    """A rewrite of the share from the replica's record must not run while a write is
    between Redis and that record: the record would lack it, and the rewrite erase it."""
    state = RedisState(redis_server.address, f"test-{uuid.uuid4().hex}:", replica="r")
    try:
        calls = []
        for n in range(80):  # with the rewrites, within the client's 100 connections
            calls.append(state.routed("a", (), 100, 1.0, 2.0))
            if n % 10 == 0:
                calls.append(state.reconcile())
        await asyncio.gather(*calls)
        view = await state.view(["a"], ())
        assert view.pending_prefill.tolist() == [80.0]
        assert view.inflight_tokens.tolist() == [160.0]
    finally:
        await state.close()


@pytest.mark.redis
async def test_more_calls_at_once_than_connections_wait_for_one(redis_server: Service) -> None:
    # a timeout that a loaded machine's connection set-up cannot reach: waiting is the point
    state = RedisState(
        redis_server.address, f"test-{uuid.uuid4().hex}:", timeout_s=5.0, replica="r"
    )
    try:
        await asyncio.gather(*(state.routed("a", (), 100, 1.0, 2.0) for _ in range(500)))
        view = await state.view(["a"], ())
        assert view.pending_prefill.tolist() == [500.0]
    finally:
        await state.close()


@pytest.mark.redis
async def test_changes_made_while_redis_was_away_reach_the_share_at_the_next_reconcile(
    tmp_path: Path,
) -> None:
    """Redis pauses (data kept); a request's first token is held, and the next charge,
    which carries it, times out against Redis; that request and both ends are served
    locally; once Redis is back, the share shows the requests gone."""
    server = LocalRedis(tmp_path)
    url = server.start()
    own = Accounting()
    state = FallbackState(
        RedisState(url, timeout_s=0.2, replica="r", own=own), LocalState(own), retry_s=0.1
    )
    admin = Redis.from_url(url)
    peer = RedisState(url, replica="peer")  # reads the share in Redis
    try:
        await state.routed("a", (), 100, 10.0, 20.0)
        await admin.execute_command("CLIENT", "PAUSE", 1000, "ALL")
        await state.adjust("a", -10.0, 0.0)  # held for the next charge
        await state.routed("b", (), 100, 5.0, 5.0)  # times out: local from here on
        assert state.degraded
        await state.adjust("a", 0.0, -20.0)
        await state.adjust("b", -5.0, -5.0)
        await asyncio.sleep(1.2)
        assert (await peer.view(["a"], ())).inflight_tokens.tolist() == [20.0]
        await state.reconcile()
        assert not state.degraded
        for view in (await state.view(["a", "b"], ()), await peer.view(["a", "b"], ())):
            assert view.pending_prefill.tolist() == [0.0, 0.0]
            assert view.inflight_tokens.tolist() == [0.0, 0.0]
    finally:
        await peer.close()
        await admin.aclose()
        await state.close()
        server.stop()


@pytest.mark.redis
async def test_on_a_cluster_each_pool_s_state_lives_on_its_own_node(
    redis_cluster: Service,
) -> None:
    """Pools spread over the nodes, and each keeps its own accounting, index and routes;
    reconcile rewrites each pool's share on its own node."""
    pools = {"a": "m@dc-1", "b": "m@dc-2", "c": "m@dc-3", "d": "m@dc-4"}
    prefix = f"test-{uuid.uuid4().hex}:"
    state = RedisState(redis_cluster.address, prefix, shard_of=pools.__getitem__, cluster=True)
    nodes = RedisCluster.from_url(redis_cluster.address)
    try:
        await nodes.initialize()
        for n, instance in enumerate(pools, start=1):
            await state.routed(instance, (7, n), 100, float(n), 2.0 * n)
        for instance, pool in pools.items():  # lost updates, behind the replica's back
            share = f"{prefix}{{{pool}}}:acct:{state.replica}:pending"
            await nodes.hset(share, instance, 999.0)
        await state.reconcile()
        for n, instance in enumerate(pools, start=1):
            view = await state.view([instance], (7, n))
            assert view.pending_prefill.tolist() == [float(n)]
            assert view.matched_blocks.tolist() == [2]
            # checked against its own pool, where nothing was routed since
            assert await state.routed(instance, (), 100, 0.0, 0.0, seen_version=view.version)
        node_of = nodes.get_node_from_key
        serving = {node_of(f"{{{pool}}}").name for pool in pools.values()}  # type: ignore[union-attr]
        assert len(serving) > 1
        with pytest.raises(ValueError, match="hash tags"):
            await state.view(["a", "b"], ())
    finally:
        await state.close()
        await nodes.aclose()


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

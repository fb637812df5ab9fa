"""One contract for the gateways' shared state, run on the in-process state, on a real
Redis server and on a Redis Cluster of three nodes; the fallback from Redis to local
state; and a replica's share in Redis (rewrites, connections, the cluster's layout).
Replicas sharing one Redis are in ``test_redis_replicas.py``."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import numpy as np
import pytest
from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import RedisError

from gateway.fallback_state import FallbackState, RedisAway
from gateway.redis_state import REDIS_ERRORS, RedisState, _client
from gateway.state import (
    IN_PROGRESS,
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
    # The contract is about what the calls do, not how fast: a call gets 5 s here, not
    # the gateway's 0.5 s, which a loaded 2-core machine once exceeded on the cluster.
    if request.param == "cluster":
        cluster: Service = request.getfixturevalue("redis_cluster")
        redis = RedisState(cluster.address, prefix, cluster=True, timeout_s=5.0)
    else:
        server: Service = request.getfixturevalue("redis_server")
        redis = RedisState(server.address, prefix, timeout_s=5.0)
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


async def test_a_token_bucket_never_fits_more_than_it_holds_full(state: SharedState) -> None:
    """A bucket of 0 that refills still holds 0: a wait of 2 s told the client to come back
    for a request that could never pass."""
    bucket = f"b-{uuid.uuid4().hex}"
    assert await state.take(bucket, 10.0, 0.0, 20.0) == float("inf")
    assert await state.take(bucket, 10.0, 100.0, 101.0) == float("inf")


async def test_a_token_bucket_takes_back_what_it_gave_never_past_its_burst(
    state: SharedState,
) -> None:
    """What a refused request took goes back, so that its retry is not charged twice; a
    full bucket given more holds no more than its burst."""
    bucket = f"b-{uuid.uuid4().hex}"
    assert await state.take(bucket, 0.001, 100.0, 80.0) == 0.0
    await state.give_back(bucket, 0.001, 100.0, 80.0)
    assert await state.take(bucket, 0.001, 100.0, 100.0) == 0.0  # full again
    await state.give_back(bucket, 0.001, 100.0, 100.0)
    await state.give_back(bucket, 0.001, 100.0, 50.0)  # past full: kept to the burst
    assert await state.take(bucket, 0.001, 100.0, 100.0) == 0.0
    assert await state.take(bucket, 0.001, 100.0, 1.0) > 0.0


async def test_an_idempotency_key_is_held_then_settled(state: SharedState) -> None:
    key = f"k-{uuid.uuid4().hex}"
    assert await state.claim(key, 60.0) is None
    assert await state.claim(key, 60.0) is IN_PROGRESS
    headers = {"x-request-id": "chatcmpl-1", "x-tokenfleet-dc": "dc-a"}
    outcome = Outcome(200, "application/json", b'{"ok": true}', headers)
    await state.settle(key, outcome, 60.0)
    assert await state.claim(key, 60.0) == outcome


@pytest.mark.redis
async def test_an_answer_kept_without_headers_replays_without_them(redis_server: Service) -> None:
    """Answers kept by gateways before 2026-12-07 hold no headers in Redis."""
    prefix = f"test-{uuid.uuid4().hex}:"
    state = RedisState(redis_server.address, prefix)
    other = Redis.from_url(redis_server.address)
    body = base64.b64encode(b'{"ok": true}').decode()
    kept = {"status": 200, "media_type": "application/json", "body": body}
    try:
        await other.set(f"{prefix}idem:k", json.dumps(kept))
        assert await state.claim("k", 60.0) == Outcome(200, "application/json", b'{"ok": true}')
    finally:
        await state.close()
        await other.aclose()


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
async def test_a_share_below_zero_counts_as_nothing(redis_server: Service) -> None:
    """Releases of requests charged while Redis was away reach a share that never had
    their charges, until the replica's next rewrite: no instance looks less than idle."""
    prefix = f"test-{uuid.uuid4().hex}:"
    state = RedisState(redis_server.address, prefix, replica="r")
    peer = RedisState(redis_server.address, prefix, replica="peer")
    try:
        await peer.routed("a", (), 100, 5.0, 20.0)
        await peer.adjust("a", -10.0, -50.0)  # ends of requests Redis never saw charged
        await peer.flush()
        await state.routed("a", (), 100, 1.0, 2.0)
        view = await state.view(["a"], ())
        assert (view.pending_prefill.tolist(), view.inflight_tokens.tolist()) == ([1.0], [2.0])
    finally:
        await state.close()
        await peer.close()


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
    async with outage(tmp_path) as away:
        state, peer = away.state, away.peer  # the peer reads the share in Redis
        await state.routed("a", (), 100, 10.0, 20.0)
        await away.pause()
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


_BUSY = """
redis.call('INCR', KEYS[1])
local began = redis.call('TIME')
repeat
    local now = redis.call('TIME')
until (now[1] - began[1]) * 1000000 + (now[2] - began[2]) > 500000
return 1
"""
"""A script that counts its runs, then keeps its node busy for half a second."""


@pytest.mark.redis
async def test_a_call_that_times_out_on_a_cluster_is_not_sent_again(
    redis_cluster: Service,
) -> None:
    """A script that ran but answered after the timeout must not run a second time
    (redis-py's cluster client sent it up to ten times more): the replica falls back."""
    client = _client(redis_cluster.address, 0.2, cluster=True)
    counter = f"test-{uuid.uuid4().hex}:runs"
    try:
        with pytest.raises(RedisError):
            await client.eval(_BUSY, 1, counter)
        await asyncio.sleep(0.7)  # the run the client gave up on ends
        assert int(await client.get(counter)) == 1
    finally:
        await client.aclose()


@pytest.mark.redis
async def test_a_key_settled_while_redis_was_away_reaches_redis_after_it(tmp_path: Path) -> None:
    """A key claimed on Redis whose request ended while Redis was away: left ``pending``
    there, every replica would answer its retries with 409 for the key's whole TTL."""
    answer = Outcome(200, "application/json", b"{}")
    async with outage(tmp_path) as away:
        state, peer = away.state, away.peer
        assert await state.claim("done", 600.0) is None
        assert await state.claim("failed", 600.0) is None
        await away.pause()
        await state.settle("done", answer, 600.0)  # times out: kept locally, owed
        await state.release("failed")
        assert state.degraded
        assert await state.claim("done", 600.0) == answer  # from the local state
        await asyncio.sleep(1.2)
        assert await peer.claim("done", 600.0) is IN_PROGRESS  # not there yet
        await state.reconcile()
        assert await peer.claim("done", 600.0) == answer
        assert await peer.claim("failed", 600.0) is None  # free to run again


@pytest.mark.redis
async def test_a_pool_whose_node_fails_leaves_the_others_rewritten(redis_cluster: Service) -> None:
    """On a cluster, reconcile rewrites every pool it can reach and then says that one
    failed: a failing first pool kept the others' shares from their rewrite. The node
    that fails is not the one the client found the cluster through."""
    prefix = f"test-{uuid.uuid4().hex}:"
    nodes = RedisCluster.from_url(redis_cluster.address)
    await nodes.initialize()
    node_of = nodes.get_node_from_key
    found_through = urlsplit(redis_cluster.address).port
    names = [f"m@dc-{n}" for n in range(1, 20)]
    failing = next(p for p in names if node_of(f"{{{p}}}").port != found_through)  # type: ignore[union-attr]
    reached = [p for p in names if node_of(f"{{{p}}}") != node_of(f"{{{failing}}}")][:3]
    pools = dict(zip("abcd", [failing, *reached], strict=True))  # "a", the failing, first
    state = RedisState(
        redis_cluster.address, prefix, shard_of=pools.__getitem__, cluster=True, timeout_s=0.2
    )
    share = f"{prefix}{{{{{{pool}}}}}}:acct:{state.replica}:pending".format
    try:
        for n, instance in enumerate(pools, start=1):
            await state.routed(instance, (), 100, float(n), 0.0)
            await nodes.hset(share(pool=pools[instance]), instance, 999.0)  # lost updates
        pause = ("CLIENT", "PAUSE", 1000, "ALL")
        await nodes.execute_command(*pause, target_nodes=node_of(f"{{{failing}}}"))
        with pytest.raises(REDIS_ERRORS):
            await state.reconcile()
        rewritten = [float(await nodes.hget(share(pool=pools[i]), i)) for i in "bcd"]
        # The call right after the failure may fail too: redis-py asks the nodes for the
        # slots again first, the paused one among them.
        assert rewritten[1:] == [3.0, 4.0]
        await asyncio.sleep(1.0)  # the pause ends
    finally:
        await state.close()
        await nodes.aclose()


@pytest.mark.redis
async def test_an_end_owed_for_an_earlier_claim_does_not_free_a_newer_one(tmp_path: Path) -> None:
    """The first request's release is owed; its client's retry claims the key again (here
    locally) and runs: paying the old release would free the key for a third run."""
    answer = Outcome(200, "application/json", b"{}")
    async with outage(tmp_path) as away:
        state, peer = away.state, away.peer
        assert await state.claim("key", 600.0) is None
        await away.pause()
        await state.release("key")  # times out: owed
        assert await state.claim("key", 600.0) is None  # the retry, while Redis is away
        await asyncio.sleep(1.2)
        await state.reconcile()
        assert await peer.claim("key", 600.0) is IN_PROGRESS  # the retry still runs
        await state.settle("key", answer, 600.0)
        assert await peer.claim("key", 600.0) == answer


@pytest.mark.redis
async def test_a_replica_stopped_while_redis_counts_away_pays_its_keys_ends(
    tmp_path: Path,
) -> None:
    """A key settled within ``retry_s`` of a failure is owed; the replica stopped before
    its next reconcile left it ``pending`` in Redis: 409 from every replica for the key's
    whole TTL (10 minutes by default)."""
    answer = Outcome(200, "application/json", b"{}")
    async with outage(tmp_path, retry_s=30.0) as away:
        state, peer = away.state, away.peer
        assert await state.claim("key", 600.0) is None
        await away.pause()
        await state.settle("key", answer, 600.0)  # times out: owed
        await asyncio.sleep(1.2)  # Redis answers again; the replica counts it away
        assert state.degraded
        await state.close()
        assert await peer.claim("key", 600.0) == answer


@pytest.mark.redis
async def test_an_outage_is_warned_of_once_whichever_call_meets_it_and_its_end_too(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Admission's shares, which have no local answer, met most failures and warned of
    none: the warning came only when a call with one took a retry (12 s late in a probe),
    and nothing said Redis was back."""
    async with outage(tmp_path) as away:
        await away.pause()
        with pytest.raises(RedisAway):
            await away.state.admission_loads("r")
        await away.state.view(["a"], ())  # local while Redis counts as away
        await asyncio.sleep(1.2)  # the pause is over
        await away.state.view(["a"], ())
    said = [r.getMessage() for r in caplog.records if r.name == "gateway.fallback_state"]
    assert len(said) == 2, said
    assert said[0].startswith("Redis at redis://")
    assert said[0].endswith("; using local state")
    assert said[1].endswith("answers again")


@dataclass
class Outage:
    """A replica's state on a Redis of its own that ``pause`` stops answering for a second
    (its data kept), and a peer reading that Redis."""

    state: FallbackState
    peer: RedisState
    admin: Redis

    async def pause(self) -> None:
        await self.admin.execute_command("CLIENT", "PAUSE", 1000, "ALL")


@contextlib.asynccontextmanager
async def outage(home: Path, retry_s: float = 0.1) -> AsyncIterator[Outage]:
    server = LocalRedis(home)
    url = server.start()
    own = Accounting()
    state = FallbackState(
        RedisState(url, timeout_s=0.2, replica="r", own=own), LocalState(own), retry_s=retry_s
    )
    admin = Redis.from_url(url)
    peer = RedisState(url, replica="peer")
    try:
        yield Outage(state, peer, admin)
    finally:
        await peer.close()
        await admin.aclose()
        await state.close()
        server.stop()


@pytest.mark.redis
@pytest.mark.parametrize(
    "wrong",
    [
        "redis://:s3cret@{address}/0",  # a password the server does not have
        "redis://{address}/99",  # a database the server lacks (16 by default)
        "redis://{address}/?db=99",  # the same through redis-py, which reads the query
    ],
)
async def test_a_redis_that_refuses_the_gateway_stops_it_at_start(
    redis_server: Service,
    wrong: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Left to the fallback, such a URL kept the gateway on its own state for its whole
    life, ready all along, its class ceilings and idempotency keys its own."""
    from tokenfleet.cli import main

    url = wrong.format(address=urlsplit(redis_server.address).netloc)
    monkeypatch.setenv("TOKENFLEET_REDIS_URL", url)
    fleet = Path(__file__).parents[2] / "examples" / "fleet.toml"
    assert await asyncio.to_thread(main, ["gateway", "--fleet", str(fleet), "--port", "0"]) == 2
    error = capsys.readouterr().err
    assert "the gateway cannot start: Redis at redis://" in error
    assert "refuses this gateway: " in error
    assert "s3cret" not in error


async def test_a_redis_that_does_not_answer_at_start_is_waited_for_on_local_state(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from gateway.settings import GatewaySettings
    from schemas.fleet import load_fleet
    from tokenfleet.gateway_wiring import running_gateway
    from tokenfleet.settings import Settings

    away = f"redis://127.0.0.1:{free_port()}"
    fleet = load_fleet(Path(__file__).parents[2] / "examples" / "fleet.toml")
    services = Settings(redis_url=away)
    async with running_gateway(fleet, GatewaySettings(), services, "127.0.0.1", 0) as app:
        assert app.state.address
    assert f"Redis at {away} failed" in caplog.text


@pytest.mark.redis
async def test_a_claim_lasts_while_its_replica_renews_it_and_a_dead_one_s_lapses(
    redis_server: Service,
) -> None:
    """A replica killed mid-request left its key ``pending`` for the key's whole TTL (600 s
    by default): every retry got 409 on every replica. A claim is a lease (here 1 s) that
    a live replica renews at each reconcile while the request runs."""
    prefix = f"test-{uuid.uuid4().hex}:"

    def replica() -> RedisState:
        return RedisState(redis_server.address, prefix, share_ttl_s=1.0, timeout_s=5.0)

    killed, other = replica(), replica()
    live = FallbackState(replica(), LocalState())
    outcome = Outcome(200, "application/json", b"{}")
    raw = Redis.from_url(redis_server.address)
    try:
        assert await killed.claim("crashed", 600.0) is None  # its replica never renews it
        assert await live.claim("running", 600.0) is None
        for _ in range(6):  # 1.8 s of reconciles, every 0.3 s
            await asyncio.sleep(0.3)
            await live.reconcile()
        assert await other.claim("crashed", 600.0) is None  # its lease ended: free
        assert await other.claim("running", 600.0) is IN_PROGRESS
        await live.settle("running", outcome, 600.0)
        assert await live.primary.renew(["running"]) == []  # an answer is no lease
        assert await raw.pttl(f"{prefix}idem:running") > 500_000  # it keeps the key's TTL
        assert await other.claim("running", 600.0) == outcome
        assert await live.claim("lapsed", 600.0) is None
        await asyncio.sleep(1.2)  # no reconcile (its replica cut off from Redis): it lapses
        assert await other.claim("lapsed", 600.0) is None  # the client's retry, elsewhere
        await live.reconcile()  # renews no lease that ended
        await live.release("lapsed")  # the first request failed: the retry's claim stays
        assert await killed.claim("lapsed", 600.0) is IN_PROGRESS
    finally:
        await raw.aclose()
        for state in (killed, other, live):
            await state.close()

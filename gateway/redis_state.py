"""Shared state in Redis: each operation is one round trip, atomic by a Lua script, but
``adjust``, whose change (a first token, an end) rides on the next charge in its pool.

Keys, all under a prefix (default ``tf:``); on a Redis Cluster the routing state of each
pool goes under a hash tag of its own (``{model@dc}``, from ``shard_of``) and the admission
loads under ``{loads}``, so that a script touches one hash slot and the pools spread over
the nodes (on one server the keys carry no tag, as with earlier versions):

- ``{pool}:acct:<replica>:pending`` and ``{pool}:acct:<replica>:inflight``: each
  replica's share of the accounting, hashes of instance id -> tokens; ``{pool}:replicas``:
  a sorted set of replicas scored by when their share expires. A view sums the shares of
  live replicas. Each replica rewrites its share from its own record every few seconds
  (``reconcile``), so a replica that died, or an update lost while Redis was away, is gone
  within a TTL;
- ``{pool}:px:<block>``: the set of the pool's instances holding a prefix block;
- ``{pool}:lru:<instance>``: that instance's blocks, scored by a sequence number, so the
  lowest scores are the least recently used;
- ``{pool}:charges``: requests charged to each instance, a hash of instance id -> count;
  ``{pool}:charged-by:<replica>``: those the replica charged; ``{pool}:changes``: each
  replica's rewrites of its share, counted. A charge is refused where another replica
  charged the chosen instance, or rewrote its share, since the view (the view carries
  both counts); a charge to another instance only made that one busier, and releases
  move nothing: they can only make a view's instances look busier than they are;
- ``bucket:<name>``: a token bucket's level and last refill (Redis server time, so every
  gateway refills on the same clock);
- ``idem:<key>``: ``pending``, for a lease its replica renews while the request runs, or
  a JSON outcome, with the key's time to live;
- ``{loads}:load:<replica>``: the replica's admission load (JSON) with a short time to
  live, and ``{loads}:loads``, a sorted set of replicas scored by when theirs expires;
  ``{loads}:slots:<claim>``: the slots of a class ceiling each live replica holds, a
  hash of replica -> slots.

The scripts are in ``gateway.redis_scripts``. A script is given its slot's first key
(``KEYS[1]``), which a cluster client routes by, and derives the others from the tagged
prefix; Redis serves keys a script did not declare when they are in the slot of those it
did (tested on a cluster of three nodes).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import re
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import numpy as np
from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import (
    AuthenticationError,
    RedisClusterException,
    RedisError,
    ResponseError,
)

from gateway import redis_scripts as scripts
from gateway.resp import LeanRedis
from gateway.state import (
    IN_PROGRESS,
    Accounting,
    AdmissionLoads,
    InProgress,
    Outcome,
    SharedView,
    SlotClaim,
)

log = logging.getLogger(__name__)


class _ShareGate:
    """Writes to a replica's share run together; a rewrite of the share runs alone.

    A write reaches the record (``own``) only once its call to Redis has ended; a rewrite
    in that interval would copy a record without it and erase it from Redis. In a test of 80
    concurrent writes and 8 rewrites without the gate, the share kept 5 to 9 of them.
    """

    def __init__(self) -> None:
        self._rewriting = asyncio.Lock()
        self._writes = 0
        self._no_writes = asyncio.Event()
        self._no_writes.set()

    @contextlib.asynccontextmanager
    async def write(self) -> AsyncIterator[None]:
        async with self._rewriting:  # waits only while a rewrite runs
            self._writes += 1
            self._no_writes.clear()
        try:
            yield
        finally:
            self._writes -= 1
            if self._writes == 0:
                self._no_writes.set()

    @contextlib.asynccontextmanager
    async def rewrite(self) -> AsyncIterator[None]:
        async with self._rewriting:
            await self._no_writes.wait()
            yield


class _Known:
    """What this replica knows of one pool's state in Redis between round trips: the other
    live replicas' accounting and the mark of their writes, as last read, and which of the
    pool's instances hold which prefix blocks (from its own writes and what reads showed).

    A view built from it, with this replica's own record, is what a read would return if
    no other replica wrote meanwhile; ``routed`` sends it to be checked, so that the check
    and the charge are one round trip. What no charge checks (an admission that holds or
    refuses on it) rests on a read at most ``RedisState.known_for_s`` old."""

    def __init__(self, ids: Sequence[str]) -> None:
        self.ids = tuple(ids)
        self.mark: str | None = None
        self.read_at = -float("inf")
        self.pending: dict[str, float] = {}
        self.inflight: dict[str, float] = {}
        self.charged: dict[str, int] = {}
        """Requests the other replicas charged to each instance, ever."""
        self.holders: dict[str, set[str]] = {}

    def read(self, sums: list[bytes], mark: bytes, *, whole: bool = True) -> None:
        """What Redis answered of the others' accounting and charges; ``whole``: with the
        holders of the view's blocks (a view, a refusal), so the pool counts as read now.
        A charge's check answers the accounting alone, which leaves the read as old as
        it was: the holders of other blocks are read again within ``known_for_s``."""
        values = [float(v) for v in sums]
        n = len(self.ids)
        self.pending = dict(zip(self.ids, values[:n], strict=True))
        self.inflight = dict(zip(self.ids, values[n : 2 * n], strict=True))
        self.charged = {i: int(v) for i, v in zip(self.ids, values[2 * n :], strict=True)}
        self.mark = mark.decode()
        if whole:
            self.read_at = time.monotonic()

    def fresh(self, known_for_s: float) -> bool:
        return self.mark is not None and time.monotonic() - self.read_at <= known_for_s

    def saw(self, blocks: Sequence[str], found: list[list[bytes]]) -> None:
        """The holders Redis listed for ``blocks``, up to the first none held."""
        for block, held in zip(blocks, found, strict=False):
            if held:
                self.holders[block] = {h.decode() for h in held}
            else:
                self.holders.pop(block, None)
        self._bounded()

    def indexed(self, instance_id: str, blocks: Sequence[str], forgotten: list[bytes]) -> None:
        for block in blocks:
            self.holders.setdefault(block, set()).add(instance_id)
        self.unindexed(instance_id, [b.decode() for b in forgotten])
        self._bounded()

    def unindexed(self, instance_id: str, blocks: Sequence[str]) -> None:
        for block in blocks:
            held = self.holders.get(block)
            if held is not None:
                held.discard(instance_id)
                if not held:
                    del self.holders[block]

    def cleared(self, instance_id: str) -> None:
        self.unindexed(instance_id, [b for b, held in self.holders.items() if instance_id in held])

    def _bounded(self) -> None:
        """Blocks other replicas' charges pushed out of an instance stay here until a read
        shows them gone; past ``MIRRORED_BLOCKS`` the mirror starts again from nothing (a
        block it lacks only costs a refused charge, whose answer lists its holders)."""
        if len(self.holders) > MIRRORED_BLOCKS:
            self.holders.clear()

    def matched(self, ids: Sequence[str], blocks: Sequence[str]) -> list[int]:
        """Leading blocks each instance holds, counted greedily as Redis counts them."""
        credit: dict[str, int] = {}
        for block in blocks:
            held = self.holders.get(block)
            if not held:
                break
            for holder in held:
                credit[holder] = credit.get(holder, 0) + 1
        return [credit.get(i, 0) for i in ids]


@dataclass(frozen=True)
class _Viewed:
    """A view handed out, as ``routed`` checks it: its pool (what is known of it, its
    instances among that), blocks and match, the other replicas' mark and charges to each
    instance, and this replica's routes under the prefix then."""

    prefix: str
    known: _Known
    blocks: tuple[str, ...]
    matched: tuple[int, ...]
    mark: str
    charged: Mapping[str, int]
    routes: int


VIEWS_KEPT = 1024
"""Views a replica remembers for ``routed`` to check; a decision charges within
milliseconds of its view, and an older one is refused as stale."""
MAX_CONNECTIONS = 32
"""Connections redis-py opens to one server at most, where the gateway uses it: 500 calls
at once took 83 ms on 32 connections and 122 ms on 100 (its default) on this project's
2-core machine, and a burst that opens 100 at once can time out connecting."""
MIRRORED_BLOCKS = 100_000
"""Prefix blocks a replica mirrors per pool at most (``_Known``)."""
REDIS_ERRORS = (RedisError, RedisClusterException, OSError)
"""How a call to Redis fails (the lean client raises ``OSError`` and its timeouts)."""


class RedisState:
    """``SharedState`` on a Redis server; one client, shared by all requests.

    ``replica`` names this process's share of the accounting. ``own`` is this process's
    record of that share, updated once the call carrying a change has ended (a
    ``LocalState`` standing in while Redis is away updates it otherwise; a change
    ``adjust`` held goes there even if its call failed, as the local state would have
    counted it); ``reconcile`` rewrites the share from it, never while a change is on its
    way (``_ShareGate``).
    """

    def __init__(
        self,
        url: str,
        prefix: str = "tf:",
        timeout_s: float = 0.5,
        replica: str | None = None,
        share_ttl_s: float = 10.0,
        own: Accounting | None = None,
        load_ttl_s: float = 2.0,
        known_for_s: float = 0.05,
        hold_s: float = 0.01,
        shard_of: Callable[[str], str] = lambda instance_id: "fleet",
        cluster: bool = False,
    ) -> None:
        """``load_ttl_s``: how long a replica's admission load counts after it last
        published it. Replicas publish theirs every admission tick (50 ms), so two seconds
        ride out a stalled event loop, and a replica that died stops holding the others'
        pools back within them. ``known_for_s``: how long after reading a pool a replica
        builds speculative views from what it read (50 ms, an admission tick: how stale
        the other replicas' admission load may be too). ``hold_s``: how long a change
        made by ``adjust`` (a first token, an end) may wait for a charge in its pool to
        carry it before it is sent alone; the other replicas' reads see it that much
        later, and their decisions, which rest on their last read, up to ``known_for_s``
        after that (a release refuses no charge: ``SharedState.routed``).

        ``shard_of``: the hash tag an instance's routing keys go under, the same for every
        instance of a pool (a view reads a pool in one script); ``cluster``: ``url`` names
        a node of a Redis Cluster."""
        self.url = without_password(url)
        """The address, for messages and logs: without the password a URL may carry."""
        self.prefix = prefix
        self.shard_of = shard_of
        self.cluster = cluster
        self.replica = replica or uuid.uuid4().hex
        self.share_ttl_s = share_ttl_s
        self.load_ttl_s = load_ttl_s
        self.known_for_s = known_for_s
        self.hold_s = hold_s
        self._own = own or Accounting()
        self._on_the_way = Accounting()
        """Changes Redis has not taken yet (held, or sent and not answered): a view counts
        them already."""
        self._held: dict[str, Accounting] = {}
        """Per pool prefix, changes ``adjust`` holds for the next charge in the pool."""
        self._flush_timers: dict[str, asyncio.TimerHandle] = {}
        self._flushing: set[asyncio.Task[None]] = set()
        self._known: dict[tuple[str, tuple[str, ...]], _Known] = {}
        self._routes: dict[str, int] = {}
        """Charges this replica sent under each prefix: a view from before one is stale."""
        self._viewed: OrderedDict[int, _Viewed] = OrderedDict()
        self._views = 0
        """Views are numbered downwards from -1, apart from a local state's versions (0
        and up), so that neither checks the other's as its own."""
        self._gate = _ShareGate()
        self._redis = _client(url, timeout_s, cluster)
        self._view = self._redis.register_script(scripts.VIEW)
        self._routed = self._redis.register_script(scripts.ROUTED)
        self._adjust = self._redis.register_script(scripts.ADJUST)
        self._sync = self._redis.register_script(scripts.SYNC)
        self._evicted = self._redis.register_script(scripts.EVICTED)
        self._cleared = self._redis.register_script(scripts.CLEARED)
        self._take = self._redis.register_script(scripts.TAKE)
        self._loads = self._redis.register_script(scripts.LOADS)
        self._renew = self._redis.register_script(scripts.RENEW)

    def _pool(self, instance_ids: Sequence[str]) -> tuple[str, str]:
        """The first key and the key prefix of a script on these instances' pool: on a
        cluster, under the pool's hash tag (ValueError for instances of several pools);
        on one server, the plain prefix, the layout replicas of earlier versions use."""
        prefix = self.prefix
        if self.cluster:
            shards = {self.shard_of(i) for i in instance_ids}
            if len(shards) != 1:
                raise ValueError(f"one call spans hash tags {sorted(shards)}: {list(instance_ids)}")
            prefix = f"{self.prefix}{{{shards.pop()}}}:"
        return prefix + "charges", prefix

    async def view(
        self, instance_ids: Sequence[str], blocks: Sequence[int], *, speculative: bool = False
    ) -> SharedView:
        key, prefix = self._pool(instance_ids)
        pool = (prefix, tuple(instance_ids))
        known = self._known.get(pool) or self._known.setdefault(pool, _Known(instance_ids))
        names = [str(b) for b in blocks]
        if not (speculative and known.fresh(self.known_for_s)):
            sums, mark, found = await self._view(
                keys=[key], args=[prefix, self.replica, len(instance_ids), *instance_ids, *names]
            )
            known.read(sums, mark)
            known.saw(names, found)
        return self._view_of(prefix, known, names)

    def _view_of(self, prefix: str, known: _Known, blocks: list[str]) -> SharedView:
        """The other replicas' accounting as known, plus this replica's own (what Redis
        took and what is on its way there)."""
        own, sent, ids = self._own, self._on_the_way, known.ids
        pending = [
            known.pending[i] + own.pending.get(i, 0.0) + sent.pending.get(i, 0.0) for i in ids
        ]
        inflight = [
            known.inflight[i] + own.inflight.get(i, 0.0) + sent.inflight.get(i, 0.0) for i in ids
        ]
        matched = known.matched(ids, blocks)
        assert known.mark is not None  # read before any view of the pool
        self._views -= 1
        routes = self._routes.get(prefix, 0)
        self._viewed[self._views] = _Viewed(
            prefix, known, tuple(blocks), tuple(matched), known.mark, known.charged, routes
        )
        if len(self._viewed) > VIEWS_KEPT:
            self._viewed.popitem(last=False)
        return SharedView(
            np.array(pending), np.array(inflight), np.array(matched, dtype=np.int64), self._views
        )

    async def routed(
        self,
        instance_id: str,
        blocks: Sequence[int],
        capacity_blocks: int,
        pending_prefill: float,
        inflight_tokens: float,
        seen_version: int | None = None,
    ) -> bool:
        """With ``seen_version``, refused at once when the view is no longer remembered
        or this replica sent a charge under its prefix since; else checked and charged in
        one script."""
        key, prefix = self._pool([instance_id])
        names = [str(b) for b in blocks]
        check: list[Any] = ["", 0, 0, 0]
        seen = self._viewed.get(seen_version) if seen_version is not None else None
        if seen_version is not None:
            if seen is None or seen.prefix != prefix or seen.routes != self._routes.get(prefix, 0):
                return False
            ids = seen.known.ids
            check = [seen.mark, seen.charged[instance_id], len(ids), *ids, *seen.matched]
            check += [len(seen.blocks), *seen.blocks]
        self._routes[prefix] = self._routes.get(prefix, 0) + 1
        async with (
            self._gate.write(),
            self._sending(instance_id, pending_prefill, inflight_tokens),
            self._carrying(prefix) as held,
        ):
            reply = await self._routed(
                keys=[key],
                args=[
                    *self._share(prefix),
                    *held,
                    instance_id,
                    capacity_blocks,
                    pending_prefill,
                    inflight_tokens,
                    *check,
                    *names,
                ],
            )
            if not reply[0]:
                assert seen is not None  # only a checked charge is refused
                sums, mark, found = reply[1:]
                seen.known.read(sums, mark)
                seen.known.saw(seen.blocks, found)
                return False
            self._own.add(instance_id, pending_prefill, inflight_tokens)
            if seen is not None:  # what the check read of the others' accounting
                seen.known.read(*reply[2:4], whole=False)
        for known in self._knowing(prefix, instance_id):
            known.indexed(instance_id, names, reply[1])
        return True

    def _knowing(self, prefix: str, instance_id: str) -> list[_Known]:
        """What this replica knows of the pools under ``prefix`` that hold the instance."""
        return [k for (p, ids), k in self._known.items() if p == prefix and instance_id in ids]

    async def adjust(self, instance_id: str, pending_prefill: float, inflight: float) -> None:
        """Held: this replica's views count the change at once, and the next charge in the
        instance's pool (on one server, where pools share the key prefix: any charge)
        carries it to Redis, or a call of its own ``hold_s`` after the first change held
        there. Under load a request's first token and end then cost no
        call of their own. Only releases come here (``SharedState.adjust``): the other
        replicas' checks do not look for them."""
        assert max(pending_prefill, inflight) <= 0, "a charge goes through routed"
        _, prefix = self._pool([instance_id])
        self._on_the_way.add(instance_id, pending_prefill, inflight)
        held = self._held.get(prefix)
        if held is None:
            held = self._held[prefix] = Accounting()
            loop = asyncio.get_running_loop()
            self._flush_timers[prefix] = loop.call_later(self.hold_s, self._flush_soon, prefix)
        held.add(instance_id, pending_prefill, inflight)

    def _flush_soon(self, prefix: str) -> None:
        task = asyncio.get_running_loop().create_task(self._flush(prefix))
        self._flushing.add(task)
        task.add_done_callback(self._flushing.discard)

    async def _flush(self, prefix: str) -> None:
        """Send what is held for ``prefix`` alone (no charge came to carry it). A failure
        is logged: the change is in this replica's record, and the next reconcile writes
        it (the gateway learns of Redis away at its next call)."""
        async with self._gate.write(), self._carrying(prefix) as held:
            if not held[0]:  # a charge carried it while this waited for the gate
                return
            try:
                await self._adjust(keys=[prefix + "charges"], args=[*self._share(prefix), *held])
            except REDIS_ERRORS as exc:
                log.warning("Redis at %s failed to take held changes (%s)", self.url, exc)

    @contextlib.asynccontextmanager
    async def _carrying(self, prefix: str) -> AsyncIterator[list[Any]]:
        """What is held for ``prefix`` as a script's arguments (a count, then the ids, their
        pending prefill and their in-flight tokens). Afterwards it is in this replica's
        record, Redis took it or not: where the call failed, the local state standing in
        would have counted it there too, and the next reconcile writes it to Redis."""
        timer = self._flush_timers.pop(prefix, None)
        if timer is not None:
            timer.cancel()
        held = self._held.pop(prefix, None) or Accounting()
        ids = list(held.pending)
        try:
            yield [len(ids), *ids, *held.pending.values(), *held.inflight.values()]
        finally:
            for i in ids:
                self._on_the_way.add(i, -held.pending[i], -held.inflight[i])
                self._own.add(i, held.pending[i], held.inflight[i])

    @contextlib.asynccontextmanager
    async def _sending(
        self, instance_id: str, pending_prefill: float, inflight: float
    ) -> AsyncIterator[None]:
        """Counts a change in views while it is on its way to Redis."""
        self._on_the_way.add(instance_id, pending_prefill, inflight)
        try:
            yield
        finally:
            self._on_the_way.add(instance_id, -pending_prefill, -inflight)

    async def evicted(self, instance_id: str, blocks: Sequence[int]) -> None:
        key, prefix = self._pool([instance_id])
        await self._evicted(keys=[key], args=[prefix, instance_id, *blocks])
        for known in self._knowing(prefix, instance_id):
            known.unindexed(instance_id, [str(b) for b in blocks])

    async def cleared(self, instance_id: str) -> None:
        key, prefix = self._pool([instance_id])
        await self._cleared(keys=[key], args=[prefix, instance_id])
        for known in self._knowing(prefix, instance_id):
            known.cleared(instance_id)

    async def reconcile(self) -> None:
        """One script per pool this replica has counted in, the pools at once. On a
        cluster a pool whose node fails does not keep the others' shares from their
        rewrite (without it they expire, and the other replicas stop counting this one's
        work there), nor holds the replica's charges, which wait for the rewrite, for a
        timeout per pool; the first failure is raised once every pool was tried."""
        async with self._gate.rewrite():
            pending, inflight = self._own.pending, self._own.inflight
            by_pool: dict[str, list[str]] = {}
            for i in sorted(pending.keys() | inflight.keys()):
                by_pool.setdefault(self.shard_of(i) if self.cluster else "", []).append(i)
            rewrites = (self._rewrite(ids, pending, inflight) for ids in by_pool.values())
            done = await asyncio.gather(*rewrites, return_exceptions=True)
            if failures := [outcome for outcome in done if isinstance(outcome, BaseException)]:
                raise failures[0]

    async def _rewrite(
        self, ids: list[str], pending: Mapping[str, float], inflight: Mapping[str, float]
    ) -> None:
        key, prefix = self._pool(ids)
        await self._sync(
            keys=[key],
            args=[
                *self._share(prefix),
                len(ids),
                *ids,
                *(pending.get(i, 0.0) for i in ids),
                *(inflight.get(i, 0.0) for i in ids),
            ],
        )

    def _share(self, prefix: str) -> list[Any]:
        return [prefix, self.replica, self.share_ttl_s]

    async def take(self, bucket: str, rate_per_s: float, burst: float, amount: float) -> float:
        wait = float(
            await self._take(
                keys=[f"{self.prefix}bucket:{bucket}"], args=[rate_per_s, burst, amount]
            )
        )
        return float("inf") if wait < 0 else wait

    async def give_back(self, bucket: str, rate_per_s: float, burst: float, amount: float) -> None:
        await self.take(bucket, rate_per_s, burst, -amount)

    async def claim(self, key: str, ttl_s: float) -> Outcome | InProgress | None:
        """Held ``pending`` for a lease of ``share_ttl_s`` (or ``ttl_s`` if shorter), which
        the replica renews while the request runs (``renew``): the claim of a replica
        that died frees its key within the lease. Held for the key's whole TTL, such a
        key answered every retry with 409 on every replica for 10 minutes."""
        name = f"{self.prefix}idem:{key}"
        lease_ms = int(min(ttl_s, self.share_ttl_s) * 1000)
        if await self._redis.set(name, b"pending", nx=True, px=lease_ms):
            return None
        held = await self._redis.get(name)
        if held is None:  # expired between the two calls: try once more
            return await self.claim(key, ttl_s)
        if held == b"pending":
            return IN_PROGRESS
        stored = json.loads(held)
        body = base64.b64decode(stored["body"])
        # "headers" since 2026-12-07: answers kept before carry none
        return Outcome(stored["status"], stored["media_type"], body, stored.get("headers", {}))

    async def settle(self, key: str, outcome: Outcome, ttl_s: float) -> None:
        stored = {
            "status": outcome.status,
            "media_type": outcome.media_type,
            "body": base64.b64encode(outcome.body).decode(),
            "headers": dict(outcome.headers),
        }
        await self._redis.set(f"{self.prefix}idem:{key}", json.dumps(stored), px=int(ttl_s * 1000))

    async def release(self, key: str) -> None:
        await self._redis.delete(f"{self.prefix}idem:{key}")

    async def renew(self, keys: Sequence[str]) -> list[str]:
        """Renew the lease of each claim of ``keys`` still pending (``claim``); the keys
        renewed."""
        lease_ms = int(self.share_ttl_s * 1000)
        renewed = await asyncio.gather(
            *(self._renew(keys=[f"{self.prefix}idem:{key}"], args=[lease_ms]) for key in keys)
        )
        return [key for key, done in zip(keys, renewed, strict=True) if done]

    async def admission_loads(
        self, own: str, slots: Mapping[str, SlotClaim] | None = None
    ) -> AdmissionLoads:
        prefix = f"{self.prefix}{{loads}}:" if self.cluster else self.prefix
        claims = slots or {}
        claimed = [arg for n, c in claims.items() for arg in (n, c.running, c.wanted, c.limit)]
        others, granted = await self._loads(
            keys=[prefix + "loads"], args=[prefix, self.replica, self.load_ttl_s, own, *claimed]
        )
        return AdmissionLoads([o.decode() for o in others], dict(zip(claims, granted, strict=True)))

    async def flush(self) -> None:
        """Send every change ``adjust`` holds now, and wait for those already on their way."""
        await asyncio.gather(*self._flushing, *(self._flush(p) for p in list(self._held)))

    async def check(self) -> None:
        """One call at start. ValueError where the server refuses this gateway for good: a
        wrong password, none where one is needed, a database the server lacks (left to
        the fallback, such a URL kept the replica on its own state for its whole life,
        ready all along, its ceilings and idempotency keys its own). A server that does
        not answer is only away: the caller starts, on its own state until it answers."""
        try:
            await self._redis.ping()
        except (ResponseError, AuthenticationError) as exc:
            if refuses_for_good(exc):
                raise ValueError(f"Redis at {self.url} refuses this gateway: {exc}") from None
            raise  # LOADING, BUSY, MASTERDOWN...: a server that will answer

    async def close(self) -> None:
        try:
            await self.flush()
        finally:
            await self._redis.aclose()


def refuses_for_good(error: RedisError) -> bool:
    """Whether an answer to a connection's AUTH, SELECT or first call is one that no wait
    changes: a wrong password, none where one is needed (``NOAUTH``), a database the
    server lacks; not a server loading its data, busy, or without its master."""
    return isinstance(error, AuthenticationError) or bool(_REFUSAL.search(str(error)))


_REFUSAL = re.compile(r"WRONGPASS|NOAUTH|password|DB index")


def without_password(url: str) -> str:
    """``url`` fit for a log: its password masked, in the address or in the query string
    (``?password=``, which redis-py reads)."""
    parts = urlsplit(url)
    if parts.password is not None:
        netloc = parts.netloc.rpartition("@")[2]
        user = f"{parts.username}:***@" if parts.username else ":***@"
        parts = parts._replace(netloc=user + netloc)
    query = re.sub(r"(?i)((?:^|&)password=)[^&]*", r"\1***", parts.query)
    return urlunsplit(parts._replace(query=query))


def _client(url: str, timeout_s: float, cluster: bool) -> LeanRedis | Redis | RedisCluster:
    """The gateway's own client on one server at a ``redis://`` address; redis-py for a
    cluster and for the addresses it alone speaks (``rediss://``, ``unix://``, options in
    the query string: ``?db=3``, ``?password=...``)."""
    if cluster:
        # No blocking pool here: past its connections per node (100) the cluster client
        # raises, and the replica answers locally until ``retry_s`` has passed.
        return RedisCluster.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, retry=_ONCE
        )
    if url.startswith("redis://") and not urlsplit(url).query:
        return LeanRedis(url, timeout_s)
    # More calls at once than connections wait for one (up to the timeout): the default
    # pool raises instead, which sent a burst of 500 to the local fallback.
    pool = BlockingConnectionPool.from_url(
        url,
        max_connections=MAX_CONNECTIONS,
        timeout=timeout_s,
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
        retry=_ONCE,
    )
    return Redis.from_pool(pool)  # closing the client closes its pool


_ONCE = Retry(NoBackoff(), 0)
"""redis-py sends a call again after a timeout or a lost connection (3 times by default,
10 on a cluster, with backoff): a script that ran but whose answer came late would run
twice (a rate bucket taken twice, a charge counted twice), and a call could take seconds
before ``FallbackState`` heard of the failure, with every decision waiting behind it. As
the gateway's own client (``gateway/resp.py``), each call is sent once; a failure falls
back. A cluster's redirections (MOVED, ASK) are followed apart from this."""

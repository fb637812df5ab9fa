"""A replica's shared state that stays up when Redis does not: Redis while it answers,
this process's own state while it is away (``FallbackState``)."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from operator import itemgetter
from typing import Any, cast

from gateway.redis_state import REDIS_ERRORS, RedisState
from gateway.state import (
    AdmissionLoads,
    Expiring,
    InProgress,
    LocalState,
    Outcome,
    SharedView,
    SlotClaim,
)

log = logging.getLogger(__name__)


class RedisAway(ConnectionError):
    """Redis failed, or is away since a failure less than ``FallbackState.retry_s`` ago."""


class FallbackState:
    """Redis while it answers; this process's own state, with a warning, while it does not.

    After a failure Redis is tried again every ``retry_s``. Counts kept locally during an
    outage are not merged back: they describe requests that finish within seconds. An
    idempotency key's end is sent to Redis once it answers again (``_keyed``).
    """

    def __init__(
        self,
        primary: RedisState,
        fallback: LocalState,
        retry_s: float = 1.0,
        on_fallback: Callable[[], None] = lambda: None,
    ) -> None:
        self.primary = primary
        self.fallback = fallback
        self.retry_s = retry_s
        self.on_fallback = on_fallback
        """Called on every call answered locally (the gateway counts them)."""
        self._down_until = 0.0
        self._failed_at: float | None = None
        """When the call that began the outage warned of was sent; None while Redis
        answers."""
        self._claimed: Expiring[float] = Expiring(float)
        """Idempotency keys this replica holds, and when their claim's lease ends."""
        self._owed: Expiring[tuple[str, tuple[Any, ...], float]] = Expiring(itemgetter(2))
        """Idempotency keys whose settle or release Redis did not take: the call, its
        arguments, and until when it is owed (a claim that expired in Redis may have
        been claimed again by another request, which a late release would free)."""

    async def check(self) -> None:
        """Redis's ``check``: ValueError where it refuses this gateway for good; where it
        does not answer, it is away as after any failed call (warned of, tried again
        after ``retry_s``), and the replica starts on its own state."""
        with contextlib.suppress(RedisAway):
            await self._on_redis("check")

    @property
    def degraded(self) -> bool:
        return time.monotonic() < self._down_until

    async def _run(self, method: str, *args: Any, **options: Any) -> Any:
        try:
            return await self._on_redis(method, *args, **options)
        except RedisAway:
            self.on_fallback()
            return await getattr(self.fallback, method)(*args, **options)

    async def _on_redis(self, method: str, *args: Any, **options: Any) -> Any:
        """``method`` on Redis; RedisAway when it fails, and without a try while it is
        away (it is tried again after ``retry_s``). An outage is warned of once, at its
        first failure, whichever call met it, and its end once: a call without a local
        answer (admission's shares, every 50 ms) met most failures and warned of none, so
        the warning came only when a call with one took a retry, 12 s late."""
        if self.degraded:
            raise RedisAway(f"Redis at {self.primary.url} is away")
        sent_at = time.monotonic()
        try:
            answer = await getattr(self.primary, method)(*args, **options)
        except REDIS_ERRORS as exc:
            if self._failed_at is None:
                log.warning("Redis at %s failed (%s); using local state", self.primary.url, exc)
            self._failed_at = self._failed_at or sent_at
            self._down_until = time.monotonic() + self.retry_s
            raise RedisAway(f"Redis at {self.primary.url} failed: {exc}") from exc
        # a call sent before the failure, answered after it, says nothing of Redis now
        if self._failed_at is not None and sent_at > self._failed_at:
            self._failed_at = None
            log.warning("Redis at %s answers again", self.primary.url)
        return answer

    async def view(
        self, instance_ids: Sequence[str], blocks: Sequence[int], *, speculative: bool = False
    ) -> SharedView:
        view = await self._run("view", instance_ids, blocks, speculative=speculative)
        return cast(SharedView, view)

    async def routed(
        self,
        instance_id: str,
        blocks: Sequence[int],
        capacity_blocks: int,
        pending_prefill: float,
        inflight_tokens: float,
        seen_version: int | None = None,
    ) -> bool:
        changed = await self._run(
            "routed",
            instance_id,
            blocks,
            capacity_blocks,
            pending_prefill,
            inflight_tokens,
            seen_version,
        )
        return cast(bool, changed)

    async def adjust(self, instance_id: str, pending_prefill: float, inflight: float) -> None:
        await self._run("adjust", instance_id, pending_prefill, inflight)

    async def evicted(self, instance_id: str, blocks: Sequence[int]) -> None:
        await self._run("evicted", instance_id, blocks)

    async def cleared(self, instance_id: str) -> None:
        await self._run("cleared", instance_id)

    async def reconcile(self) -> None:
        await self._run("reconcile")
        if not self.degraded:
            await self._pay_owed()
            await self._renew_claims()

    async def _renew_claims(self) -> None:
        """Renew the leases of the keys this replica holds in Redis while their requests
        run (``RedisState.claim``); a failed renewal is tried at the next reconcile,
        within the lease. A key's entry lasts its lease from the last renewal: an end
        owed for it is sent only while Redis may still hold the claim (past it, another
        replica may have claimed the key again, which the end would free)."""
        now = time.monotonic()
        held = [key for key, until in self._claimed.items() if until > now]
        if not held:
            return
        try:
            renewed = await self.primary.renew(held)
        except REDIS_ERRORS:
            return
        for key in renewed:
            if key in self._claimed:  # not ended meanwhile
                self._claimed[key] = now + self.primary.share_ttl_s

    async def take(self, bucket: str, rate_per_s: float, burst: float, amount: float) -> float:
        return cast(float, await self._run("take", bucket, rate_per_s, burst, amount))

    async def give_back(self, bucket: str, rate_per_s: float, burst: float, amount: float) -> None:
        """Into Redis's bucket, or this process's while Redis is away: a draw that Redis
        took before it went away then stays taken."""
        await self._run("give_back", bucket, rate_per_s, burst, amount)

    async def claim(self, key: str, ttl_s: float) -> Outcome | InProgress | None:
        held = cast(Outcome | InProgress | None, await self._run("claim", key, ttl_s))
        if held is None:
            now = time.monotonic()
            self._claimed.sweep(now)
            self._claimed[key] = now + min(ttl_s, self.primary.share_ttl_s)
            self._owed.pop(key, None)  # an end owed for an earlier claim must not free this one
        return held

    async def settle(self, key: str, outcome: Outcome, ttl_s: float) -> None:
        await self._keyed("settle", key, outcome, ttl_s)

    async def release(self, key: str) -> None:
        await self._keyed("release", key)

    async def _keyed(self, method: str, key: str, *args: Any) -> None:
        """An idempotency key's settle or release must reach Redis: the key may be held
        there (claimed before an outage, or by a claim Redis applied but whose answer was
        lost), and left ``pending`` it would answer the client's retries with 409 on
        every replica for the key's whole TTL. Where Redis is away or fails, it is done
        locally and owed: sent after each reconcile until Redis takes it (never while
        the response waits: a settle ends a whole answer)."""
        now = time.monotonic()
        claimed_until = self._claimed.pop(key, now)
        self._owed.pop(key, None)
        if method == "release" and claimed_until <= now:
            # The lease ended unrenewed: another replica may hold the key now.
            await self.fallback.release(key)
            return
        try:
            await self._on_redis(method, key, *args)
            return
        except RedisAway:
            pass
        until = now + args[-1] if method == "settle" else claimed_until
        self._owed.sweep(now)
        self._owed[key] = (method, args, until)
        self.on_fallback()
        await getattr(self.fallback, method)(key, *args)

    async def _pay_owed(self) -> None:
        for key, owed in list(self._owed.items()):
            method, args, until = owed
            if time.monotonic() < until:
                try:
                    await getattr(self.primary, method)(key, *args)
                except REDIS_ERRORS:
                    return  # the next reconcile tries again
            if self._owed.get(key) is owed:  # not claimed or ended again meanwhile
                del self._owed[key]

    async def admission_loads(
        self, own: str, slots: Mapping[str, SlotClaim] | None = None
    ) -> AdmissionLoads:
        """Redis's answer only (RedisAway while it is away): this process's own state
        knows no other replica, and would tell the replica it is alone."""
        loads = await self._on_redis("admission_loads", own, slots)
        return cast(AdmissionLoads, loads)

    async def close(self) -> None:
        """Pay what is owed, once, even while Redis counts as away (it may be back): a key
        left ``pending`` there would answer every replica's retries with 409 for its TTL,
        and nothing else would pay it."""
        try:
            if self._owed:
                await self._pay_owed()
        finally:
            await self.primary.close()

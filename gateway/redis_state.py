"""Shared state in Redis: each operation is one round trip, atomic by a Lua script.

Keys, all under a prefix (default ``tf:``):

- ``pending`` and ``inflight``: hashes of instance id -> tokens;
- ``px:<block>``: the set of instances holding a prefix block;
- ``lru:<instance>``: that instance's blocks, scored by a global sequence number, so the
  lowest scores are the least recently used;
- ``bucket:<name>``: a token bucket's level and last refill (Redis server time, so every
  gateway refills on the same clock);
- ``idem:<key>``: ``pending`` or a JSON outcome, with the key's time to live.

Block hashes travel as decimal strings; Lua never does arithmetic on them.
"""

from __future__ import annotations

import base64
import json
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from redis.asyncio import Redis
from redis.exceptions import RedisError

from gateway.state import IN_PROGRESS, InProgress, LocalState, Outcome, SharedView

log = logging.getLogger(__name__)

_VIEW = """
local p, n = ARGV[1], tonumber(ARGV[2])
local ids = {}
for i = 1, n do ids[i] = ARGV[2 + i] end
local pending = redis.call('HMGET', p .. 'pending', unpack(ids))
local inflight = redis.call('HMGET', p .. 'inflight', unpack(ids))
local credit = {}
for k = 3 + n, #ARGV do
  local holders = redis.call('SMEMBERS', p .. 'px:' .. ARGV[k])
  if #holders == 0 then break end
  for _, holder in ipairs(holders) do credit[holder] = (credit[holder] or 0) + 1 end
end
local matched = {}
for i = 1, n do matched[i] = credit[ids[i]] or 0 end
return {pending, inflight, matched}
"""

_ROUTED = """
local p, id, capacity = ARGV[1], ARGV[2], tonumber(ARGV[3])
redis.call('HINCRBYFLOAT', p .. 'pending', id, ARGV[4])
redis.call('HINCRBYFLOAT', p .. 'inflight', id, ARGV[5])
local lru = p .. 'lru:' .. id
for k = 6, #ARGV do
  local order = redis.call('INCR', p .. 'lru-seq')
  redis.call('ZADD', lru, order, ARGV[k])
  redis.call('SADD', p .. 'px:' .. ARGV[k], id)
end
local excess = redis.call('ZCARD', lru) - capacity
if excess > 0 then
  local gone = redis.call('ZPOPMIN', lru, excess)
  for k = 1, #gone, 2 do redis.call('SREM', p .. 'px:' .. gone[k], id) end
end
return 0
"""

_TAKE = """
local key, rate, burst, amount = KEYS[1], tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local clock = redis.call('TIME')
local now = tonumber(clock[1]) + tonumber(clock[2]) / 1e6
local state = redis.call('HMGET', key, 'level', 'at')
local level = tonumber(state[1]) or burst
local at = tonumber(state[2]) or now
level = math.min(burst, level + math.max(0, now - at) * rate)
local wait = 0
if level >= amount then level = level - amount
elseif rate > 0 then wait = (amount - level) / rate
else wait = -1 end
redis.call('HSET', key, 'level', tostring(level), 'at', tostring(now))
if rate > 0 then redis.call('EXPIRE', key, math.ceil(burst / rate) + 60) end
return tostring(wait)
"""


class RedisState:
    """``SharedState`` on a Redis server; one client, shared by all requests."""

    def __init__(self, url: str, prefix: str = "tf:", timeout_s: float = 0.5) -> None:
        self.url = url
        self.prefix = prefix
        self._redis = Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s
        )
        self._view = self._redis.register_script(_VIEW)
        self._routed = self._redis.register_script(_ROUTED)
        self._take = self._redis.register_script(_TAKE)

    async def view(self, instance_ids: Sequence[str], blocks: Sequence[int]) -> SharedView:
        pending, inflight, matched = await self._view(
            args=[self.prefix, len(instance_ids), *instance_ids, *blocks]
        )
        return SharedView(
            np.array([float(v or 0.0) for v in pending]),
            np.array([float(v or 0.0) for v in inflight]),
            np.array(matched, dtype=np.int64),
        )

    async def routed(
        self,
        instance_id: str,
        blocks: Sequence[int],
        capacity_blocks: int,
        pending_prefill: float,
        inflight_tokens: float,
    ) -> None:
        await self._routed(
            args=[
                self.prefix,
                instance_id,
                capacity_blocks,
                pending_prefill,
                inflight_tokens,
                *blocks,
            ]
        )

    async def adjust(self, instance_id: str, pending_prefill: float, inflight: float) -> None:
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.hincrbyfloat(f"{self.prefix}pending", instance_id, pending_prefill)
            pipe.hincrbyfloat(f"{self.prefix}inflight", instance_id, inflight)
            await pipe.execute()

    async def take(self, bucket: str, rate_per_s: float, burst: float, amount: float) -> float:
        wait = float(
            await self._take(
                keys=[f"{self.prefix}bucket:{bucket}"], args=[rate_per_s, burst, amount]
            )
        )
        return float("inf") if wait < 0 else wait

    async def claim(self, key: str, ttl_s: float) -> Outcome | InProgress | None:
        name = f"{self.prefix}idem:{key}"
        if await self._redis.set(name, b"pending", nx=True, px=int(ttl_s * 1000)):
            return None
        held = await self._redis.get(name)
        if held is None:  # expired between the two calls: try once more
            return await self.claim(key, ttl_s)
        if held == b"pending":
            return IN_PROGRESS
        stored = json.loads(held)
        return Outcome(stored["status"], stored["media_type"], base64.b64decode(stored["body"]))

    async def settle(self, key: str, outcome: Outcome, ttl_s: float) -> None:
        stored = {
            "status": outcome.status,
            "media_type": outcome.media_type,
            "body": base64.b64encode(outcome.body).decode(),
        }
        await self._redis.set(f"{self.prefix}idem:{key}", json.dumps(stored), px=int(ttl_s * 1000))

    async def release(self, key: str) -> None:
        await self._redis.delete(f"{self.prefix}idem:{key}")

    async def close(self) -> None:
        await self._redis.aclose()


class FallbackState:
    """Redis while it answers; this process's own state, with a warning, while it does not.

    After a failure Redis is tried again every ``retry_s``. Counts kept locally during an
    outage are not merged back: they describe requests that finish within seconds.
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

    @property
    def degraded(self) -> bool:
        return time.monotonic() < self._down_until

    async def _run(self, method: str, *args: Any) -> Any:
        if not self.degraded:
            try:
                return await getattr(self.primary, method)(*args)
            except (RedisError, OSError) as exc:
                if self._down_until == 0.0 or not self.degraded:
                    log.warning("Redis at %s failed (%s); using local state", self.primary.url, exc)
                self._down_until = time.monotonic() + self.retry_s
                self.on_fallback()
        return await getattr(self.fallback, method)(*args)

    async def view(self, instance_ids: Sequence[str], blocks: Sequence[int]) -> SharedView:
        return await self._run("view", instance_ids, blocks)

    async def routed(
        self,
        instance_id: str,
        blocks: Sequence[int],
        capacity_blocks: int,
        pending_prefill: float,
        inflight_tokens: float,
    ) -> None:
        await self._run(
            "routed", instance_id, blocks, capacity_blocks, pending_prefill, inflight_tokens
        )

    async def adjust(self, instance_id: str, pending_prefill: float, inflight: float) -> None:
        await self._run("adjust", instance_id, pending_prefill, inflight)

    async def take(self, bucket: str, rate_per_s: float, burst: float, amount: float) -> float:
        return await self._run("take", bucket, rate_per_s, burst, amount)

    async def claim(self, key: str, ttl_s: float) -> Outcome | InProgress | None:
        return await self._run("claim", key, ttl_s)

    async def settle(self, key: str, outcome: Outcome, ttl_s: float) -> None:
        await self._run("settle", key, outcome, ttl_s)

    async def release(self, key: str) -> None:
        await self._run("release", key)

    async def close(self) -> None:
        await self.primary.close()

"""The hot state gateway replicas share, behind one interface.

``LocalState`` keeps it in this process (the embedded mode, and the fallback while Redis is
away); ``gateway.redis_state.RedisState`` keeps it in Redis so that every replica behind
one address sees the same counts. Both pass ``tests/integration/test_shared_state.py``.

What is shared:

- **accounting** per instance: prefill tokens routed whose first token has not come back
  (``pending``) and prompt-plus-budget tokens of requests not finished (``inflight``);
- **the approximate prefix index**: which instance was sent which prefix blocks, each
  instance's entries forgotten least-recently-used first beyond its KV capacity;
- **admission token buckets**, one per quota;
- **idempotency keys**: a client's ``Idempotency-Key`` and the outcome it got;
- **admission load**: each replica's requests in flight and held per class pool, so that
  pool order holds across replicas, and the slots of each class ceiling each replica
  holds, so that together they never run more than the ceiling (``gateway.admission``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from operator import itemgetter
from typing import Protocol, TypeVar

import numpy as np

from control.routing.prefix_index import ApproximatePrefixIndex
from control.routing.snapshot import FloatArray, IntArray


@dataclass(frozen=True)
class SharedView:
    """Arrays aligned with the instance ids asked for."""

    pending_prefill: FloatArray
    inflight_tokens: FloatArray
    matched_blocks: IntArray
    """Leading prefix entries (as passed) each instance holds, counted greedily."""
    version: int = 0
    """Which view this is, for ``routed`` to check that it is still current."""


@dataclass(frozen=True)
class Outcome:
    """A finished response, kept under an idempotency key, with the headers that said
    which request it was and where it ran (a retry that gets it is told the original's
    request id, instance and DC, as the first answer was)."""

    status: int
    media_type: str
    body: bytes
    headers: Mapping[str, str] = field(default_factory=dict, hash=False)


@dataclass(frozen=True)
class SlotClaim:
    """What a replica asks of a class ceiling that replicas side by side share: ``wanted``
    slots, as far as ``limit`` less the slots the other live replicas hold allows, and
    never fewer than its ``running`` requests (running requests are never preempted). It
    holds what it is granted until its next claim."""

    running: int
    wanted: int
    limit: int


@dataclass(frozen=True)
class AdmissionLoads:
    """What ``SharedState.admission_loads`` tells a replica."""

    others: list[str]
    """The other live replicas' published loads."""
    granted: dict[str, int]
    """The slots this replica now holds, per claim; none where nothing is shared (a
    replica alone keeps its ceilings itself)."""


LEAVE = ""
"""The load a replica publishes as it stops (``SharedState.admission_loads``): the others
stop counting it at once, and its slots free."""


class InProgress:
    """An idempotency key whose first request has not finished."""


IN_PROGRESS = InProgress()


class SharedState(Protocol):
    async def view(
        self, instance_ids: Sequence[str], blocks: Sequence[int], *, speculative: bool = False
    ) -> SharedView:
        """Accounting of ``instance_ids`` and their match of ``blocks``, in one read.
        ``speculative``: the caller charges what it decides on this view through
        ``routed`` with its version, which refuses a view that was not current (one that
        misses only other replicas' releases counts as current), so the view may come from
        what this replica knows already, without a read."""
        ...

    async def routed(
        self,
        instance_id: str,
        blocks: Sequence[int],
        capacity_blocks: int,
        pending_prefill: float,
        inflight_tokens: float,
        seen_version: int | None = None,
    ) -> bool:
        """A request went to ``instance_id``: index its blocks, count its tokens. With
        ``seen_version`` (the version of the view the decision was made on, whose blocks
        were these), only if that view is still current: no request routed since, and (in
        Redis) no other replica's charge to ``instance_id`` or rewrite of its share and the
        same match of the blocks; False, and nothing written, otherwise. Another
        replica's release (a first token, an end) refuses nothing: it can only make the
        view's instances look busier than they are, as a release that ``adjust`` holds
        does."""
        ...

    async def adjust(self, instance_id: str, pending_prefill: float, inflight: float) -> None:
        """Subtract these amounts (never positive: a charge goes through ``routed``), at
        a first token or an end. This
        replica's views count them at once; other replicas' (in Redis) may a few
        milliseconds later, where the change waits for a charge to carry it, and their
        speculative views at their next read."""
        ...

    async def evicted(self, instance_id: str, blocks: Sequence[int]) -> None:
        """The instance's engine reports these blocks gone (a KV event): unindex them."""
        ...

    async def cleared(self, instance_id: str) -> None:
        """The instance's engine reports its whole cache cleared: unindex all of it."""
        ...

    async def reconcile(self) -> None:
        """Rewrite this replica's share of the accounting from its own record (the
        gateway calls it every few seconds; where nothing is shared it does nothing)."""
        ...

    async def take(self, bucket: str, rate_per_s: float, burst: float, amount: float) -> float:
        """Take ``amount`` from a token bucket; 0.0 if taken, else seconds until it could be."""
        ...

    async def give_back(self, bucket: str, rate_per_s: float, burst: float, amount: float) -> None:
        """Put ``amount`` taken from a token bucket back (never past ``burst``): the
        request that took it was refused, and its client's retry takes it again."""
        ...

    async def claim(self, key: str, ttl_s: float) -> Outcome | InProgress | None:
        """Claim an idempotency key: None if it is new (and now held), else what it holds."""
        ...

    async def settle(self, key: str, outcome: Outcome, ttl_s: float) -> None: ...

    async def release(self, key: str) -> None:
        """Give a claimed key up (the request failed), so that a retry runs."""
        ...

    async def admission_loads(
        self, own: str, slots: Mapping[str, SlotClaim] | None = None
    ) -> AdmissionLoads:
        """Publish this replica's admission load (JSON, ``gateway.admission``; ``LEAVE``:
        it stops), read the other live replicas', and take the ceiling slots it claims, by
        name: all in one step, so that two replicas never both take the same free slot."""
        ...

    async def close(self) -> None: ...


class Accounting:
    """Pending prefill and in-flight tokens per instance, as one process counted them."""

    def __init__(self) -> None:
        self.pending: dict[str, float] = {}
        self.inflight: dict[str, float] = {}

    def add(self, instance_id: str, pending_prefill: float, inflight: float) -> None:
        self.pending[instance_id] = self.pending.get(instance_id, 0.0) + pending_prefill
        self.inflight[instance_id] = self.inflight.get(instance_id, 0.0) + inflight


SWEEP_AT = 10_000
"""Past this many idempotency keys, expired ones are dropped."""

V = TypeVar("V")


class Expiring(dict[str, V]):
    """Entries that expire (``until`` says when), dropped once the dict has doubled since
    it was last swept (at first ``SWEEP_AT``): a sweep on every addition past a fixed
    count rebuilt 30,000 live idempotency keys for each claim (1 ms a claim)."""

    def __init__(self, until: Callable[[V], float]) -> None:
        super().__init__()
        self._until = until
        self._sweep_at = SWEEP_AT

    def sweep(self, now: float) -> None:
        if len(self) > self._sweep_at:
            for key in [key for key, entry in self.items() if self._until(entry) <= now]:
                del self[key]
            self._sweep_at = max(SWEEP_AT, 2 * len(self))


class LocalState:
    """Shared state of one process. Not thread-safe; one event loop uses it.

    ``accounting`` may be shared with a ``RedisState`` that this state stands in for, so
    that the replica's own record sees every request, whichever state served it.
    """

    def __init__(self, accounting: Accounting | None = None) -> None:
        self._index = ApproximatePrefixIndex()
        self._rows: dict[str, int] = {}
        self._accounting = accounting or Accounting()
        self._buckets: dict[str, tuple[float, float]] = {}  # level, at
        self._keys: Expiring[tuple[Outcome | InProgress, float]] = Expiring(itemgetter(1))
        """Per idempotency key, what it holds and until when."""
        self._version = 0

    async def view(
        self, instance_ids: Sequence[str], blocks: Sequence[int], *, speculative: bool = False
    ) -> SharedView:
        matched = self._index.match(blocks, len(self._rows))
        return SharedView(
            np.array([self._accounting.pending.get(i, 0.0) for i in instance_ids]),
            np.array([self._accounting.inflight.get(i, 0.0) for i in instance_ids]),
            np.array(
                [matched[self._rows[i]] if i in self._rows else 0 for i in instance_ids],
                dtype=np.int64,
            ),
            self._version,
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
        if seen_version is not None and seen_version != self._version:
            return False
        self._version += 1
        row = self._rows.setdefault(instance_id, len(self._rows))
        self._index.add(row, blocks, capacity_blocks)
        await self.adjust(instance_id, pending_prefill, inflight_tokens)
        return True

    async def adjust(self, instance_id: str, pending_prefill: float, inflight: float) -> None:
        self._accounting.add(instance_id, pending_prefill, inflight)

    async def evicted(self, instance_id: str, blocks: Sequence[int]) -> None:
        if instance_id in self._rows:
            self._index.evicted(self._rows[instance_id], blocks)

    async def cleared(self, instance_id: str) -> None:
        if instance_id in self._rows:
            self._index.remove_instance(self._rows[instance_id])

    async def reconcile(self) -> None:
        return None

    async def take(self, bucket: str, rate_per_s: float, burst: float, amount: float) -> float:
        now = time.monotonic()
        level, at = self._buckets.get(bucket, (burst, now))
        level = min(burst, level + (now - at) * rate_per_s)
        wait = token_bucket_wait(level, rate_per_s, amount, burst)
        self._buckets[bucket] = (min(burst, level - amount) if wait == 0.0 else level, now)
        return wait

    async def give_back(self, bucket: str, rate_per_s: float, burst: float, amount: float) -> None:
        await self.take(bucket, rate_per_s, burst, -amount)

    async def claim(self, key: str, ttl_s: float) -> Outcome | InProgress | None:
        now = time.monotonic()
        self._keys.sweep(now)
        held = self._keys.get(key)
        if held is not None and held[1] > now:
            return held[0]
        self._keys[key] = (IN_PROGRESS, now + ttl_s)
        return None

    async def settle(self, key: str, outcome: Outcome, ttl_s: float) -> None:
        self._keys[key] = (outcome, time.monotonic() + ttl_s)

    async def release(self, key: str) -> None:
        self._keys.pop(key, None)

    async def admission_loads(
        self, own: str, slots: Mapping[str, SlotClaim] | None = None
    ) -> AdmissionLoads:
        return AdmissionLoads([], {})

    async def close(self) -> None:
        return None


def token_bucket_wait(level: float, rate_per_s: float, amount: float, burst: float) -> float:
    """Seconds until a bucket at ``level`` holds ``amount``; inf if it never will: it does
    not refill, or ``amount`` is more than it holds full (``burst``); 0.0 for a negative
    ``amount``, given back. ``TAKE`` in ``gateway.redis_scripts`` is the same rule in
    Redis."""
    if level >= amount:
        return 0.0
    if rate_per_s <= 0 or amount > burst:
        return float("inf")
    return (amount - level) / rate_per_s

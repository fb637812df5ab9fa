"""The controllers on an event bus: SLOMax's quotas and FleetMind's weights, in
``tokenfleet controller`` on Kafka and in the embedded mode's in-process loop.

``QuotaHost``: every ``period_s`` it reconciles each DC whose goodput and capacity tables it
has read (``control.controllers.slomax``) and publishes the quotas a change calls for on
``tf.control.quotas``. Gateways drop quotas older than their TTL, so unchanged quotas are
published again (a new version, the same limits) every ``renew_s``; the controller still
times its next move from the last change, not from a renewal. It reads
``tf.control.quotas`` back from the start, and reconciles nothing until it has read what
was there when it started, so that a restarted controller continues the versions and the
limits where they stand (its first move after a restart is timed from the last change)
instead of publishing versions the gateways drop as old.

Tables older than ``stale_after_s`` (a stream processor that stopped publishing) move
nothing and renew nothing: the quotas run out at their TTL and the gateways fall back to
the admission policy's defaults, as they do when no controller runs.
"""

from __future__ import annotations

import asyncio
import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

from control.controllers.fleetmind import WeightController, weights_of
from control.controllers.slomax import QuotaController
from schemas import Envelope
from schemas.control import AdmissionQuotas, ControlSnapshot, RoutingWeights
from schemas.tables import CapacityTable, GoodputTable
from streams.bus import EventBus
from streams.feeds import follow

log = logging.getLogger(__name__)

QUOTAS_TOPIC = "tf.control.quotas"
WEIGHTS_TOPIC = "tf.control.weights"
TABLE_TOPICS = ("tf.tables.goodput", "tf.tables.capacity")
SnapshotT = TypeVar("SnapshotT", bound=ControlSnapshot)
STALE_AFTER_S = 30.0
"""Six slides of the tables' default window (5 s): the worker has stopped publishing."""


class _ControlHost(ABC, Generic[SnapshotT]):
    """What both controllers' hosts share: follow their inputs and their own topic from
    the start, read back what they published before deciding anything, then reconcile
    every ``period_s``; publish a pass's snapshots and take them in as if read back."""

    control_topic: str
    input_topics: tuple[str, ...]

    def __init__(
        self,
        bus: EventBus,
        ttl_s: float,
        period_s: float,
        renew_s: float | None,
        clock: Callable[[], float],
        source: str,
        stale_after_s: float,
    ) -> None:
        """``renew_s`` None: a third of the snapshots' TTL."""
        self.bus = bus
        self.period_s = period_s
        self.renew_s = ttl_s / 3 if renew_s is None else renew_s
        self.clock = clock
        self.source = source
        self.stale_after_s = stale_after_s
        self._published: dict[str, SnapshotT] = {}
        """The newest snapshot on the topic per scope (a change or a renewal)."""
        self._read = asyncio.Event()
        """Set whenever a snapshot of this host's topic is taken in."""

    async def run(self) -> None:
        """Read and reconcile until cancelled."""
        readers = [
            asyncio.create_task(follow(self.bus, topic, self.apply, "earliest"))
            for topic in (*self.input_topics, self.control_topic)
        ]
        try:
            await self.caught_up()
            while True:
                await asyncio.sleep(self.period_s)
                await self.reconcile()
        finally:
            for reader in readers:
                reader.cancel()
            await asyncio.gather(*readers, return_exceptions=True)

    async def caught_up(self, retry_s: float = 1.0) -> None:
        """Until the snapshots on the topic now have been read (and applied) by the reader:
        a restarted controller continues their versions instead of publishing versions
        the gateways drop as old."""
        while True:
            try:
                newest = await self.bus.read_latest(self.control_topic)
                break
            except LookupError:  # no such topic yet: nothing was ever published
                return
            except Exception as exc:  # the bus is away: read again, decide nothing yet
                log.warning("reading %s failed (%s); retrying", self.control_topic, exc)
                await asyncio.sleep(retry_s)
        waiting = [e.payload for e in newest.values() if isinstance(e.payload, ControlSnapshot)]
        while True:
            self._read.clear()
            if not any(s.supersedes(self._published.get(s.scope)) for s in waiting):
                return
            await self._read.wait()

    @abstractmethod
    async def reconcile(self) -> list[SnapshotT]:
        """One pass: the snapshots the inputs call for, published."""

    @abstractmethod
    def apply(self, message: object) -> None:
        """Take in an input or a snapshot of this host's topic read from the bus."""

    async def _publish(self, snapshots: list[SnapshotT]) -> list[SnapshotT]:
        if snapshots:
            await self.bus.publish_events([Envelope.wrap(s, source=self.source) for s in snapshots])
            for snapshot in snapshots:
                self.apply(snapshot)
        return snapshots

    def _taken_in(self, snapshot: SnapshotT) -> bool:
        """Hold ``snapshot`` if it is newer than the one held for its scope."""
        if not snapshot.supersedes(self._published.get(snapshot.scope)):
            return False
        self._published[snapshot.scope] = snapshot
        self._read.set()
        return True


class QuotaHost(_ControlHost[AdmissionQuotas]):
    control_topic = QUOTAS_TOPIC
    input_topics = TABLE_TOPICS

    def __init__(
        self,
        bus: EventBus,
        controller: QuotaController | None = None,
        period_s: float = 5.0,
        renew_s: float | None = None,
        clock: Callable[[], float] = time.time,
        source: str = "controller",
        stale_after_s: float = STALE_AFTER_S,
    ) -> None:
        """``renew_s`` None: a third of the quotas' TTL."""
        self.controller = controller or QuotaController()
        ttl_s = self.controller.params.ttl_s
        super().__init__(bus, ttl_s, period_s, renew_s, clock, source, stale_after_s)
        self._goodput: dict[str, GoodputTable] = {}
        self._capacity: dict[str, CapacityTable] = {}
        self._changed: dict[str, AdmissionQuotas] = {}
        """The quotas of the last change per DC: when and to what the limits last moved."""

    async def reconcile(self) -> list[AdmissionQuotas]:
        """One pass over every DC with both tables; what it published."""
        now = self.clock()
        return await self._publish(
            [
                quotas
                for dc, goodput in self._goodput.items()
                if dc in self._capacity
                and (quotas := self._next(dc, goodput, self._capacity[dc], now)) is not None
            ]
        )

    def apply(self, message: object) -> None:
        """Take in a table or a quota snapshot read from the bus (newer versions only)."""
        if isinstance(message, GoodputTable) and message.supersedes(self._goodput.get(message.dc)):
            self._goodput[message.dc] = message
        elif isinstance(message, CapacityTable) and message.supersedes(
            self._capacity.get(message.dc)
        ):
            self._capacity[message.dc] = message
        elif isinstance(message, AdmissionQuotas) and self._taken_in(message):
            changed = self._changed.get(message.scope)
            if changed is None or changed.quotas != message.quotas:  # a change, not a renewal
                self._changed[message.scope] = message

    def _next(
        self, dc: str, goodput: GoodputTable, capacity: CapacityTable, now: float
    ) -> AdmissionQuotas | None:
        """The change the tables call for, else a renewal that is due, else None (also
        when a table is stale)."""
        if now - min(goodput.window_end, capacity.window_end) > self.stale_after_s:
            return None
        published = self._published.get(dc)
        changed = self._changed.get(dc)
        current = (
            None
            if published is None or changed is None
            else changed.model_copy(update={"version": published.version})
        )
        desired = self.controller.reconcile(goodput, capacity, current, now)
        if desired is not None:
            self._changed[dc] = desired
            return desired
        if published is not None and now - published.issued_at >= self.renew_s:
            return published.model_copy(update={"version": published.version + 1, "issued_at": now})
        return None


class WeightHost(_ControlHost[RoutingWeights]):
    """FleetMind's weights controller on a bus: every ``period_s`` it reconciles the DCs'
    weights from their goodput tables (``control.controllers.fleetmind``) and publishes
    one snapshot per edge (``edges``: the DCs whose gateways choose DCs) on
    ``tf.control.weights``, for every one of ``models``: the first as soon as tables are
    fresh, every DC whole, so that gateways and ``tokenfleet status`` see the controller
    at work before anything moves. Like ``QuotaHost``, it renews unchanged weights before
    their TTL runs out, reads the topic back before deciding anything, and lets stale
    tables move nothing."""

    control_topic = WEIGHTS_TOPIC
    input_topics = TABLE_TOPICS[:1]

    def __init__(
        self,
        bus: EventBus,
        models: Sequence[str],
        edges: Sequence[str],
        controller: WeightController | None = None,
        period_s: float = 5.0,
        renew_s: float | None = None,
        clock: Callable[[], float] = time.time,
        source: str = "controller",
        stale_after_s: float = STALE_AFTER_S,
    ) -> None:
        """``renew_s`` None: a third of the weights' TTL."""
        self.models = tuple(models)
        self.edges = tuple(edges)
        self.controller = controller or WeightController()
        ttl_s = self.controller.params.ttl_s
        super().__init__(bus, ttl_s, period_s, renew_s, clock, source, stale_after_s)
        self._goodput: dict[str, GoodputTable] = {}
        self._weights: dict[str, float] = {}
        """Each DC's weight as last published."""
        self._changed_at: dict[str, float] = {}

    async def reconcile(self) -> list[RoutingWeights]:
        """One pass over every DC with a fresh goodput table; what it published."""
        now = self.clock()
        fresh = {
            dc: table
            for dc, table in self._goodput.items()
            if now - table.window_end <= self.stale_after_s
        }
        changed = self.controller.reconcile(fresh, self._weights, self._changed_at, now)
        if changed is not None:
            due = list(self.edges)
        else:  # the first snapshot (every DC whole), or a renewal: only on fresh tables
            due = [e for e in self.edges if fresh and self._renewal_due(e, now)]
        weights = dict.fromkeys(fresh, 1.0) | (self._weights if changed is None else changed)
        return await self._publish(
            [
                self.controller.snapshot(weights, self.models, edge, self._version(edge), now)
                for edge in due
            ]
        )

    def _renewal_due(self, edge: str, now: float) -> bool:
        published = self._published.get(edge)
        return published is None or now - published.issued_at >= self.renew_s

    def _version(self, edge: str) -> int:
        published = self._published.get(edge)
        return 1 if published is None else published.version + 1

    def apply(self, message: object) -> None:
        """Take in a goodput table or a weights snapshot read from the bus (newer only)."""
        if isinstance(message, GoodputTable) and message.supersedes(self._goodput.get(message.dc)):
            self._goodput[message.dc] = message
        elif isinstance(message, RoutingWeights) and self._taken_in(message):
            for dc, weight in weights_of(message).items():
                if self._weights.get(dc, 1.0) != weight:
                    self._changed_at[dc] = message.issued_at
                self._weights[dc] = weight

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
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

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
STALE_AFTER_S = 30.0
"""Six slides of the tables' default window (5 s): the worker has stopped publishing."""


class QuotaHost:
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
        self.bus = bus
        self.controller = controller or QuotaController()
        self.period_s = period_s
        self.renew_s = self.controller.params.ttl_s / 3 if renew_s is None else renew_s
        self.clock = clock
        self.source = source
        self.stale_after_s = stale_after_s
        self._goodput: dict[str, GoodputTable] = {}
        self._capacity: dict[str, CapacityTable] = {}
        self._published: dict[str, AdmissionQuotas] = {}
        """The newest quotas on the topic per DC (a change or a renewal)."""
        self._changed: dict[str, AdmissionQuotas] = {}
        """The quotas of the last change per DC: when and to what the limits last moved."""
        self._quotas_read = asyncio.Event()

    async def run(self) -> None:
        """Read and reconcile until cancelled."""
        await _reconcile_loop(self, (*TABLE_TOPICS, QUOTAS_TOPIC))

    async def caught_up(self) -> None:
        """Until the quotas on the topic now have been read (and applied) by the reader."""
        await read_back(self.bus, QUOTAS_TOPIC, self._published, self._quotas_read)

    async def reconcile(self) -> list[AdmissionQuotas]:
        """One pass over every DC with both tables; what it published."""
        now = self.clock()
        out = [
            quotas
            for dc, goodput in self._goodput.items()
            if dc in self._capacity
            and (quotas := self._next(dc, goodput, self._capacity[dc], now)) is not None
        ]
        if out:
            await self.bus.publish_events([Envelope.wrap(q, source=self.source) for q in out])
            for quotas in out:
                self.apply(quotas)
        return out

    def apply(self, message: object) -> None:
        """Take in a table or a quota snapshot read from the bus (newer versions only)."""
        if isinstance(message, GoodputTable) and message.supersedes(self._goodput.get(message.dc)):
            self._goodput[message.dc] = message
        elif isinstance(message, CapacityTable) and message.supersedes(
            self._capacity.get(message.dc)
        ):
            self._capacity[message.dc] = message
        elif isinstance(message, AdmissionQuotas) and message.supersedes(
            self._published.get(message.scope)
        ):
            self._published[message.scope] = message
            self._quotas_read.set()
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


class WeightHost:
    """FleetMind's weights controller on a bus: every ``period_s`` it reconciles the DCs'
    weights from their goodput tables (``control.controllers.fleetmind``) and publishes
    one snapshot per edge (``edges``: the DCs whose gateways choose DCs) on
    ``tf.control.weights``, for every one of ``models``. Like ``QuotaHost``, it renews
    unchanged weights before their TTL runs out, reads the topic back before deciding
    anything, and lets stale tables move nothing."""

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
        self.bus = bus
        self.models = tuple(models)
        self.edges = tuple(edges)
        self.controller = controller or WeightController()
        self.period_s = period_s
        self.renew_s = self.controller.params.ttl_s / 3 if renew_s is None else renew_s
        self.clock = clock
        self.source = source
        self.stale_after_s = stale_after_s
        self._goodput: dict[str, GoodputTable] = {}
        self._published: dict[str, RoutingWeights] = {}
        """The newest weights on the topic per edge."""
        self._weights: dict[str, float] = {}
        """Each DC's weight as last published."""
        self._changed_at: dict[str, float] = {}
        self._read = asyncio.Event()

    async def run(self) -> None:
        """Read and reconcile until cancelled."""
        await _reconcile_loop(self, (TABLE_TOPICS[0], WEIGHTS_TOPIC))

    async def caught_up(self) -> None:
        await read_back(self.bus, WEIGHTS_TOPIC, self._published, self._read)

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
        elif self._weights:
            due = [e for e in self.edges if self._renewal_due(e, now) and fresh]
        else:
            due = []
        weights = self._weights if changed is None else changed
        out = [
            self.controller.snapshot(weights, self.models, edge, self._version(edge), now)
            for edge in due
        ]
        if out:
            await self.bus.publish_events([Envelope.wrap(w, source=self.source) for w in out])
            for snapshot in out:
                self.apply(snapshot)
        return out

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
        elif isinstance(message, RoutingWeights) and message.supersedes(
            self._published.get(message.scope)
        ):
            self._published[message.scope] = message
            self._read.set()
            for dc, weight in weights_of(message).items():
                if self._weights.get(dc, 1.0) != weight:
                    self._changed_at[dc] = message.issued_at
                self._weights[dc] = weight


class _Host(Protocol):
    bus: EventBus
    period_s: float

    def apply(self, message: object) -> None: ...

    async def caught_up(self) -> None: ...

    async def reconcile(self) -> Sequence[ControlSnapshot]: ...


async def _reconcile_loop(host: _Host, topics: Sequence[str]) -> None:
    """Follow ``topics`` from the start, and once the host has read back what it published
    before, reconcile every ``period_s`` until cancelled."""
    readers = [
        asyncio.create_task(follow(host.bus, topic, host.apply, "earliest")) for topic in topics
    ]
    try:
        await host.caught_up()
        while True:
            await asyncio.sleep(host.period_s)
            await host.reconcile()
    finally:
        for reader in readers:
            reader.cancel()
        await asyncio.gather(*readers, return_exceptions=True)


async def read_back(
    bus: EventBus,
    topic: str,
    published: Mapping[str, ControlSnapshot],
    read: asyncio.Event,
    retry_s: float = 1.0,
) -> None:
    """Until the snapshots on ``topic`` now are in ``published``, which the reader that
    follows the topic fills (setting ``read`` each time): a restarted controller continues
    their versions instead of publishing versions the gateways drop as old."""
    while True:
        try:
            newest = await bus.read_latest(topic)
            break
        except LookupError:  # no such topic yet: nothing was ever published
            return
        except Exception as exc:  # the bus is away: read again, decide nothing yet
            log.warning("reading %s failed (%s); retrying", topic, exc)
            await asyncio.sleep(retry_s)
    waiting = [e.payload for e in newest.values() if isinstance(e.payload, ControlSnapshot)]
    while True:
        read.clear()
        if not any(s.supersedes(published.get(s.scope)) for s in waiting):
            return
        await read.wait()

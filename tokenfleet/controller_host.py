"""SLOMax's quota controller on an event bus: ``tokenfleet controller`` on Kafka, and the
embedded mode's in-process loop.

Every ``period_s`` it reconciles each DC whose goodput and capacity tables it has read
(``control.controllers.slomax``) and publishes the quotas a change calls for on
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
from collections.abc import Callable

from control.controllers.slomax import QuotaController
from schemas import Envelope
from schemas.control import AdmissionQuotas
from schemas.tables import CapacityTable, GoodputTable
from streams.bus import EventBus
from streams.feeds import follow

log = logging.getLogger(__name__)

QUOTAS_TOPIC = "tf.control.quotas"
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
        readers = [
            asyncio.create_task(follow(self.bus, topic, self.apply, "earliest"))
            for topic in (*TABLE_TOPICS, QUOTAS_TOPIC)
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
        """Until the quotas on the topic now have been read (and applied) by the reader."""
        while True:
            try:
                newest = await self.bus.read_latest(QUOTAS_TOPIC)
                break
            except LookupError:  # no such topic yet: nothing was ever published
                return
            except Exception as exc:  # the bus is away: read again, decide nothing yet
                log.warning("reading %s failed (%s); retrying", QUOTAS_TOPIC, exc)
                await asyncio.sleep(retry_s)
        waiting = [e.payload for e in newest.values() if isinstance(e.payload, AdmissionQuotas)]
        while True:
            self._quotas_read.clear()
            if not any(q.supersedes(self._published.get(q.scope)) for q in waiting):
                return
            await self._quotas_read.wait()

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

"""Lifecycle events leave the request path through a bounded buffer.

``emit`` never waits: it puts the event in a queue, or, when the queue is full, counts it
as dropped. One sender task publishes what is queued in batches, in order, each gathered
for ``LINGER_S`` after its first event unless the queue already fills it. While the bus is
away (Kafka down) the sender keeps retrying its batch, the queue fills, and later events
are dropped and counted; serving goes on. An event too large for any bus (a prompt
of about 800,000 tokens lists over a megabyte of prefix blocks) is dropped and counted at
once: retried, it would hold every event behind it. At shutdown the batch in hand is
published before the queue, or counted as dropped with it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from gateway.metrics import DropReason
from schemas import Envelope, Message
from streams.bus import EventBus, Unpublishable

log = logging.getLogger(__name__)

LINGER_S = 0.005
"""How long the sender gathers a batch after its first event, as Kafka's producer waits
(``linger.ms``, 5 ms by default since Kafka 4.0, KIP-1030). Without it the sender took
whatever was queued whenever it ran: a gateway waiting on Redis for each decision gave it
the loop between decisions, so it published batches of an event or two, and every batch
also wakes the tables reading the bus in process. 5 ms delays a table's rows by that
much against a publish period of seconds."""


class EventSink:
    def __init__(
        self,
        bus: EventBus,
        source: str,
        capacity: int = 10_000,
        batch: int = 512,
        retry_s: float = 0.5,
        linger_s: float = LINGER_S,
        on_drop: Callable[[DropReason, int], None] = lambda reason, count: None,
        on_published: Callable[[list[Envelope]], None] = lambda batch: None,
    ) -> None:
        """``on_drop``: told the reason and count of events given up; ``on_published``:
        told each batch the bus has taken, so the events a gateway published can be
        checked against what is on the topics."""
        self.bus = bus
        self.source = source
        self.batch = batch
        self.retry_s = retry_s
        self.linger_s = linger_s
        self._on_drop = on_drop
        self._on_published = on_published
        self._queue: asyncio.Queue[Envelope] = asyncio.Queue(capacity)
        self._in_hand: list[Envelope] = []
        """The batch being published (it left the queue): ``flush`` sends it first."""

    @property
    def queued(self) -> int:
        return self._queue.qsize()

    def emit(self, payload: Message) -> None:
        try:
            self._queue.put_nowait(Envelope.wrap(payload, source=self.source))
        except asyncio.QueueFull:
            self._on_drop("buffer_full", 1)

    async def run(self) -> None:
        """Publish until cancelled; a failed batch is retried until it goes through."""
        while True:
            self._in_hand = [await self._queue.get()]
            if self.linger_s > 0 and self._queue.qsize() < self.batch - 1:
                await asyncio.sleep(self.linger_s)
            while len(self._in_hand) < self.batch and not self._queue.empty():
                self._in_hand.append(self._queue.get_nowait())
            await self._publish()

    async def flush(self, timeout_s: float) -> None:
        """Publish the batch in hand (the sender was stopped) and what is queued, for at
        most ``timeout_s``; what is left is dropped. The batch may have reached the bus
        in part: consumers take events once, by their id."""
        while not self._queue.empty():
            self._in_hand.append(self._queue.get_nowait())
        try:
            await asyncio.wait_for(self._publish_in_hand(), timeout_s)
        except Exception as exc:  # shutting down: count, never raise
            log.warning("dropping %d events at shutdown: %s", len(self._in_hand), exc)
            self._on_drop("shutdown", len(self._in_hand))
            self._in_hand = []

    async def _publish(self) -> None:
        """Publish the batch in hand, retrying until it goes through."""
        while True:
            try:
                await self._publish_in_hand()
                return
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # any bus failure: keep serving, retry
                log.warning("event bus failed (%s); retrying %d events", exc, len(self._in_hand))
                await asyncio.sleep(self.retry_s)

    async def _publish_in_hand(self) -> None:
        """Publish the batch in hand, less any event no bus takes (dropped and counted at
        once); a failure of the bus is raised, the batch kept in hand."""
        while self._in_hand:
            batch = self._in_hand
            try:
                await self.bus.publish_events(batch)
            except Unpublishable as exc:
                log.warning("dropping an event no bus takes: %s", exc)
                self._on_drop("too_large", 1)
                self._in_hand = [e for e in batch if e is not exc.envelope]
                continue
            self._on_published(batch)
            self._in_hand = []

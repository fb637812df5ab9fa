"""The table logic on any event bus, in one process: the embedded mode's worker.

It reads every input topic from the start, feeds one ``TableBuilder`` and publishes the
tables every ``publish_s``. It does not share work or keep changelogs; on Kafka, run
``tokenfleet worker`` (Faust) instead.
"""

from __future__ import annotations

import asyncio
import logging
import time

from schemas import Envelope
from streams.bus import EventBus, Unpublishable
from streams.tables.builder import TableBuilder

log = logging.getLogger(__name__)

INPUT_TOPICS = ("tf.requests", "tf.completions", "tf.cancellations", "tf.telemetry", "tf.kv-events")


class TableHost:
    def __init__(self, bus: EventBus, builder: TableBuilder, publish_s: float = 2.0) -> None:
        self.bus = bus
        self.builder = builder
        self.publish_s = publish_s

    async def run(self) -> None:
        """Feed and publish until cancelled. A table no bus takes (``Unpublishable``: a
        goodput table with thousands of tenants' rows passes the size a record may have)
        is logged and left out; the others go on being published."""
        readers = [asyncio.create_task(self._read(topic)) for topic in INPUT_TOPICS]
        try:
            while True:
                await asyncio.sleep(self.publish_s)
                for table in self.builder.tables(time.time()):
                    try:
                        await self.bus.publish_event(Envelope.wrap(table, source="tables"))
                    except Unpublishable as exc:
                        log.error("%s: not published: %s", type(table).__name__, exc)
        finally:
            for reader in readers:
                reader.cancel()
            await asyncio.gather(*readers, return_exceptions=True)

    async def _read(self, topic: str) -> None:
        async with self.bus.subscribe(topic, "earliest") as events:
            async for event in events:
                self.builder.feed(event.envelope)

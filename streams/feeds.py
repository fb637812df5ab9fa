"""Background readers that keep a process's last-known state fresh from the bus (the
gateway's telemetry and control, the controller's tables).

Each feed resubscribes after any failure (Kafka down, a topic not yet created) and keeps
what it had meanwhile; a feed never stops its process.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from schemas import Envelope, Message
from streams.bus import EventBus, StartFrom

log = logging.getLogger(__name__)


async def follow(
    bus: EventBus,
    topic: str,
    apply: Callable[[Message], object],
    start: StartFrom = "latest",
    retry_s: float = 1.0,
) -> None:
    """Apply every event of ``topic`` from ``start`` until cancelled; after a failure,
    subscribe again from ``start`` (the appliers ignore what they already have)."""
    await follow_envelopes(bus, topic, lambda envelope: apply(envelope.payload), start, retry_s)


async def follow_envelopes(
    bus: EventBus,
    topic: str,
    apply: Callable[[Envelope], object],
    start: StartFrom = "latest",
    retry_s: float = 1.0,
) -> None:
    """``follow``, for appliers that read the envelope too (who sent it, and when)."""
    while True:
        try:
            async with bus.subscribe(topic, start) as events:
                async for event in events:
                    apply(event.envelope)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # any bus failure: keep last-known, retry
            log.warning("feed %s failed (%s); retrying in %.1f s", topic, exc, retry_s)
        await asyncio.sleep(retry_s)

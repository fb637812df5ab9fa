"""Background readers that keep a process's last-known state fresh from the bus (the
gateway's telemetry and control, the controller's tables).

Each feed resubscribes after any failure (Kafka down, a topic not yet created) and keeps
what it had meanwhile; a feed never stops its process.
"""

from __future__ import annotations

import asyncio
import logging
import time
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
    """``follow``, for appliers that read the envelope too (who sent it, and when). A run
    of failures is warned of at its first and then every ``WARN_EVERY`` tries: a gateway
    started on an address with no broker wrote a line a second per feed, five feeds, for
    as long as it ran. The run ends at an event applied past the point where the last try
    failed (a retry from the earliest offset replays the events before a bad one), or
    when a subscription lasted ``STEADY_S`` (its topic may be quiet)."""
    failures, reached = 0, 0
    while True:
        opened, applied = time.monotonic(), 0
        try:
            async with bus.subscribe(topic, start) as events:
                async for event in events:
                    apply(event.envelope)
                    applied += 1
                    if failures and applied > reached:
                        log.warning("feed %s reads again after %d failed tries", topic, failures)
                        failures = 0
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # any bus failure: keep last-known, retry
            if time.monotonic() - opened >= STEADY_S:
                failures = 0
            failures, reached = failures + 1, applied
            if failures % WARN_EVERY == 1:
                log.warning(
                    "feed %s failed (%s: %s); retrying every %.1f s, keeping what it had "
                    "(%d tries so far)",
                    topic,
                    type(exc).__name__,
                    exc,
                    retry_s,
                    failures,
                )
        await asyncio.sleep(retry_s)


WARN_EVERY = 60
"""Failed tries of a feed between two warnings: a minute at the default retry."""
STEADY_S = 60.0
"""How long a subscription must last for its failure to start a new run of them."""

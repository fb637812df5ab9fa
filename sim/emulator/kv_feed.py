"""An emulated instance's KV events, numbered, for the collector to read over HTTP.

vLLM publishes its KV events (``--kv-events-config``: BlockStored, BlockRemoved) on a ZMQ
socket. An emulated instance keeps them instead, numbered from 1 in the order the engine
made them, and answers ``GET /kv-events?after=N&epoch=E`` with those numbered past ``N``::

    {"epoch": "3f2a...", "next": 120, "complete": true, "events": [[hash, true], ...]}

``true`` marks a stored block, ``false`` an evicted one. Only the newest ``capacity`` events
are kept: ``complete`` is false when some past ``N`` were dropped (or ``N`` is not one of
this run's). ``epoch`` names this run of the instance; a restarted one starts a new epoch,
with an empty cache. A reader that names the epoch it last read gets a restarted
instance's events from the first: its ``N`` counted another run's, and past it it would
miss what the new run stored first.
"""

from __future__ import annotations

import itertools
import uuid
from collections import deque
from dataclasses import dataclass

from control.routing import KvEvent
from sim.kv_cache import KvBlockPool


@dataclass(frozen=True)
class KvEventPage:
    epoch: str
    next: int
    """The number of the last event given; the ``after`` of the next read."""
    complete: bool
    events: tuple[KvEvent, ...]

    def body(self) -> dict[str, object]:
        return {
            "epoch": self.epoch,
            "next": self.next,
            "complete": self.complete,
            "events": [list(event) for event in self.events],
        }


class KvEventFeed:
    def __init__(self, pool: KvBlockPool, capacity: int = 100_000) -> None:
        self.epoch = uuid.uuid4().hex
        self._pool = pool
        self._events: deque[KvEvent] = deque(maxlen=capacity)
        self._last = 0
        """The number of the newest event."""

    def collect(self) -> None:
        """Number the pool's events since the last call (the driver calls this after each
        step, so the pool's own log never holds more than a step's)."""
        events = self._pool.take_events()
        self._events.extend(events)
        self._last += len(events)

    def page(self, after: int, limit: int, epoch: str | None = None) -> KvEventPage:
        """At most ``limit`` events numbered past ``after`` (from the first, when ``epoch``
        names another run), oldest first."""
        self.collect()
        if epoch is not None and epoch != self.epoch:
            after = 0
        oldest = self._last - len(self._events)
        complete = oldest <= after <= self._last
        start = after if complete else oldest
        skip = start - oldest
        events = tuple(itertools.islice(self._events, skip, skip + limit))
        return KvEventPage(self.epoch, start + len(events), complete, events)

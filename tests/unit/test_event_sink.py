"""The gateway's event sink: a bounded buffer between the request path and the bus."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable, Sequence

import pytest

from gateway.events import EventSink
from schemas import Envelope
from schemas.lifecycle import RequestAdmitted
from streams.memory import InMemoryBus
from tests.conftest import huge_arrival, read_for


def admitted(n: int) -> RequestAdmitted:
    return RequestAdmitted(request_id=f"r{n}", queue="interactive")


@pytest.mark.parametrize("sent_by", ["the sender", "the flush at shutdown"])
async def test_an_event_no_bus_takes_is_dropped_and_counted_and_the_rest_go_through(
    sent_by: str,
) -> None:
    bus, dropped = InMemoryBus(), Counter[str]()
    sink = EventSink(bus, "test", on_drop=lambda reason, n: dropped.update({reason: n}))
    sink.emit(admitted(1))
    sink.emit(huge_arrival("r-huge").payload)
    sink.emit(admitted(2))
    if sent_by == "the sender":
        sending = asyncio.create_task(sink.run())
        await asyncio.sleep(0.05)
        sending.cancel()
    else:
        await sink.flush(timeout_s=1.0)
    events = await read_for(bus, "tf.requests", 0.2)
    assert [e.request_id for e in events] == ["r1", "r2"]
    assert dropped == {"too_large": 1}


class Stalled(InMemoryBus):
    """A bus that takes nothing until ``back`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.back = asyncio.Event()

    async def publish_events(self, envelopes: Sequence[Envelope], to: str | None = None) -> None:
        await self.back.wait()
        await super().publish_events(envelopes, to)


async def test_the_batch_in_hand_at_shutdown_is_published_before_the_queue() -> None:
    bus = Stalled()
    sink = EventSink(bus, "test", batch=2, retry_s=0.01)
    for n in range(3):
        sink.emit(admitted(n))
    sending = asyncio.create_task(sink.run())
    await asyncio.sleep(0.05)  # r0 and r1 in hand, r2 queued
    sending.cancel()
    await asyncio.gather(sending, return_exceptions=True)
    bus.back.set()
    await sink.flush(timeout_s=1.0)
    events = await read_for(bus, "tf.requests", 0.2)
    assert [e.request_id for e in events] == ["r0", "r1", "r2"]


async def test_events_emitted_while_the_sender_lingers_go_out_in_one_batch() -> None:
    """Without the linger the sender published each event it woke for alone: a gateway
    waiting on Redis for each decision published batches of 1.1 events."""
    batches: list[int] = []
    sink = EventSink(InMemoryBus(), "test", linger_s=0.2, on_published=_sizes(batches))
    sending = asyncio.create_task(sink.run())
    sink.emit(admitted(0))
    for _ in range(3):
        await asyncio.sleep(0)  # the sender takes r0 and lingers
    assert sink.queued == 0
    sink.emit(admitted(1))
    sink.emit(admitted(2))
    await asyncio.sleep(0.3)
    sending.cancel()
    assert batches == [3]


async def test_a_sender_stopped_while_it_lingers_leaves_its_event_to_the_flush() -> None:
    bus, batches = InMemoryBus(), list[int]()
    sink = EventSink(bus, "test", linger_s=10.0, on_published=_sizes(batches))
    sending = asyncio.create_task(sink.run())
    sink.emit(admitted(0))
    await asyncio.sleep(0.01)  # r0 in hand, the sender lingering
    sink.emit(admitted(1))
    assert batches == []
    sending.cancel()
    await asyncio.gather(sending, return_exceptions=True)
    await sink.flush(timeout_s=1.0)
    events = await read_for(bus, "tf.requests", 0.2)
    assert [e.request_id for e in events] == ["r0", "r1"]


def _sizes(batches: list[int]) -> Callable[[list[Envelope]], None]:
    return lambda batch: batches.append(len(batch))

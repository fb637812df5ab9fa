"""A feed that cannot subscribe keeps trying, warning of it now and then, not each time."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest

from schemas import Envelope, Message
from schemas.fleet import load_fleet
from streams import feeds
from streams.bus import StartFrom, Subscription
from streams.collector import telemetry_of
from streams.feeds import follow
from streams.memory import InMemoryBus

EXAMPLE = Path(__file__).parents[2] / "examples" / "fleet.toml"


class AwayAtFirst(InMemoryBus):
    """A bus whose first ``away`` subscriptions fail, as Kafka's do with no broker."""

    def __init__(self, away: int) -> None:
        super().__init__()
        self.away = away

    def subscribe(self, topic: str, start: StartFrom = "earliest") -> Subscription:
        if self.away:
            self.away -= 1
            raise ConnectionError("no broker at that address")
        return super().subscribe(topic, start)


async def test_a_run_of_failures_is_warned_of_at_its_start_every_so_often_and_its_end(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(feeds, "WARN_EVERY", 10)
    bus, applied = AwayAtFirst(away=25), list[Message]()
    instance = load_fleet(EXAMPLE).instances[0]
    await bus.publish_event(Envelope.wrap(telemetry_of(instance, None), source="test"))
    caplog.set_level(logging.WARNING, logger="streams.feeds")
    reader = asyncio.create_task(
        follow(bus, "tf.telemetry", applied.append, start="earliest", retry_s=0.0)
    )
    try:
        for _ in range(500):
            if applied:
                break
            await asyncio.sleep(0.001)
    finally:
        reader.cancel()
    said = [r.getMessage() for r in caplog.records]
    assert [w.split("(")[-1] for w in said[:3]] == [
        "1 tries so far)",
        "11 tries so far)",
        "21 tries so far)",
    ]
    assert said[3:] == ["feed tf.telemetry reads again after 25 failed tries"]


async def test_a_bad_event_replayed_after_good_ones_is_one_run_of_failures(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bad event after good ones on a topic read from the earliest: each try replays the
    good ones; ended there, the run said "again" and warned anew at each try."""
    monkeypatch.setattr(feeds, "WARN_EVERY", 10)
    bus = InMemoryBus()
    good, bad = (telemetry_of(i, None) for i in load_fleet(EXAMPLE).instances[:2])
    for telemetry in (good, good, bad):  # replayed from the earliest at each try
        await bus.publish_event(Envelope.wrap(telemetry, source="test"))
    tries, tried_enough = 0, asyncio.Event()

    def broken(telemetry: Message) -> None:
        nonlocal tries
        if telemetry != bad:
            return
        tries += 1
        if tries == 25:
            tried_enough.set()
        raise ValueError("an applier that fails")

    caplog.set_level(logging.WARNING, logger="streams.feeds")
    reader = asyncio.create_task(follow(bus, "tf.telemetry", broken, "earliest", retry_s=0.0))
    try:
        await asyncio.wait_for(tried_enough.wait(), 5)
    finally:
        reader.cancel()
    assert len(caplog.records) == 3  # tries 1, 11 and 21

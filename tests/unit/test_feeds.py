"""A feed that cannot subscribe keeps trying, warning of it now and then, not each time."""

from __future__ import annotations

import asyncio
import logging

import pytest

from schemas import Message
from streams import feeds
from streams.bus import StartFrom, Subscription
from streams.feeds import follow
from streams.memory import InMemoryBus


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
    caplog.set_level(logging.WARNING, logger="streams.feeds")
    reader = asyncio.create_task(follow(bus, "tf.control.quotas", applied.append, retry_s=0.0))
    try:
        for _ in range(500):
            if bus.away == 0 and any("again" in r.message for r in caplog.records):
                break
            await asyncio.sleep(0.001)
    finally:
        reader.cancel()
    warned = [r.getMessage() for r in caplog.records]
    assert [w.split("(")[-1] for w in warned[:3]] == [
        "1 tries so far)",
        "11 tries so far)",
        "21 tries so far)",
    ]
    assert warned[3] == "feed tf.control.quotas subscribed again after 25 failed tries"
    assert len(warned) == 4

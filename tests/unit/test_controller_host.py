"""The controllers on a bus: tables in, quotas and weights out, renewed before they
expire, continued after a restart."""

from __future__ import annotations

import asyncio
import itertools

from control.controllers.fleetmind import weights_of
from control.controllers.slomax import QuotaController, long_documents
from schemas.base import TaskClass
from schemas.control import AdmissionQuotas
from schemas.tables import GoodputTable
from streams.feeds import follow
from streams.memory import InMemoryBus
from tests.conftest import read_for
from tests.unit.test_quota_controller import capacity, row
from tokenfleet.controller_host import QUOTAS_TOPIC, WEIGHTS_TOPIC, QuotaHost, WeightHost


class Clock:
    def __init__(self) -> None:
        self.now = 60.0

    def __call__(self) -> float:
        return self.now


def feed(host: QuotaHost, chats_met: int, documents_refused: int, now: float) -> None:
    """The tables of the window ending ``now`` (100 chats, ``chats_met`` in time; 10
    documents completed, ``documents_refused`` more turned away), as the stream
    processors publish them, each a newer version."""
    classes = (
        row(TaskClass.INTERACTIVE, 100, chats_met),
        row(TaskClass.LONG_DOCUMENT, 10, 10, failures=documents_refused),
        row(TaskClass.BATCH, 0, 0),
    )
    version = int(now * 10)
    host.apply(
        GoodputTable(
            dc="dc",
            version=version,
            window_start=now - 60,
            window_end=now,
            classes=classes,
            tenants=(),
        )
    )
    host.apply(capacity(2, now=now).model_copy(update={"version": version}))


async def published(bus: InMemoryBus) -> list[AdmissionQuotas]:
    """Every quota snapshot on the topic so far."""
    return [q for q in await read_for(bus, QUOTAS_TOPIC, 0.05) if isinstance(q, AdmissionQuotas)]


async def test_the_controller_renews_unchanged_quotas_and_times_its_moves_from_the_change() -> None:
    bus, clock = InMemoryBus(), Clock()
    host = QuotaHost(bus, QuotaController(), renew_s=25.0, clock=clock)
    feed(host, chats_met=96, documents_refused=0, now=clock.now)
    [first] = await host.reconcile()
    assert (first.version, long_documents(first)) == (1, 8)  # four per ready instance
    clock.now = 80.0  # within the band: nothing to change, no renewal due
    feed(host, chats_met=96, documents_refused=0, now=clock.now)
    assert await host.reconcile() == []
    clock.now = 90.0  # due: the same limits, a new version
    [renewed] = await host.reconcile()
    assert (renewed.version, long_documents(renewed), renewed.issued_at) == (2, 8, 90.0)
    # chats with room while documents were turned away: 61 s after the change (a rise
    # waits a whole window), though only 31 s after the renewal
    clock.now = 121.0
    feed(host, chats_met=100, documents_refused=5, now=clock.now)
    [raised] = await host.reconcile()
    assert raised.version == 3
    assert long_documents(raised) == 10
    assert [q.version for q in await published(bus)] == [1, 2, 3]


async def test_a_restarted_controller_continues_from_the_published_quotas() -> None:
    bus, clock = InMemoryBus(), Clock()
    first_host = QuotaHost(bus, clock=clock)
    feed(first_host, chats_met=50, documents_refused=0, now=clock.now)
    [first] = await first_host.reconcile()
    restarted = QuotaHost(bus, clock=clock)
    reader = asyncio.create_task(follow(bus, QUOTAS_TOPIC, restarted.apply, "earliest"))
    try:
        await asyncio.wait_for(restarted.caught_up(), 5.0)  # what its run waits for first
    finally:
        reader.cancel()
    clock.now = 100.0
    feed(restarted, chats_met=50, documents_refused=0, now=clock.now)
    [lowered] = await restarted.reconcile()
    assert lowered.version == first.version + 1
    assert long_documents(lowered) < long_documents(first)  # from where it stood


async def test_a_restart_after_renewals_continues_from_the_last_change_not_the_first() -> None:
    bus, clock = InMemoryBus(), Clock()
    host = QuotaHost(bus, renew_s=20.0, clock=clock)
    feed(host, chats_met=96, documents_refused=0, now=60.0)
    [first] = await host.reconcile()  # 8
    clock.now = 75.0
    feed(host, chats_met=50, documents_refused=0, now=75.0)
    [lowered] = await host.reconcile()  # 6
    clock.now = 100.0
    feed(host, chats_met=96, documents_refused=0, now=100.0)
    [renewed] = await host.reconcile()
    assert (long_documents(first), long_documents(lowered), long_documents(renewed)) == (8, 6, 6)
    restarted = QuotaHost(bus, clock=clock)
    for quotas in await published(bus):
        restarted.apply(quotas)
    clock.now = 105.0  # 30 s after the change: a fall may come, from 6
    feed(restarted, chats_met=50, documents_refused=0, now=105.0)
    [next_] = await restarted.reconcile()
    assert (next_.version, long_documents(next_)) == (4, 4)


async def test_stale_tables_move_nothing_and_renew_nothing() -> None:
    bus, clock = InMemoryBus(), Clock()
    host = QuotaHost(bus, renew_s=20.0, clock=clock, stale_after_s=30.0)
    feed(host, chats_met=96, documents_refused=0, now=60.0)
    [first] = await host.reconcile()
    clock.now = 96.0  # a renewal is due, and chats miss; but the tables are 31 s old
    feed(host, chats_met=50, documents_refused=0, now=65.0)
    assert await host.reconcile() == []
    feed(host, chats_met=50, documents_refused=0, now=96.0)  # the worker is back
    [lowered] = await host.reconcile()
    assert long_documents(lowered) < long_documents(first)


TABLE_VERSIONS = itertools.count(1)


def feed_goodput(host: WeightHost, dc: str, met: int, now: float) -> None:
    """The DC's goodput table of the window ending ``now`` (a newer version each time):
    100 requests, ``met`` in time."""
    host.apply(
        GoodputTable(
            dc=dc,
            version=next(TABLE_VERSIONS),
            window_start=now - 60,
            window_end=now,
            classes=(row(TaskClass.INTERACTIVE, 100, met),),
            tenants=(),
        )
    )


async def test_the_weights_follow_goodput_for_every_edge_and_model_and_are_renewed() -> None:
    bus, clock = InMemoryBus(), Clock()
    host = WeightHost(bus, ["m1", "m2"], ["dc-a", "dc-b"], renew_s=20.0, clock=clock)
    feed_goodput(host, "dc-a", 99, clock.now)
    feed_goodput(host, "dc-b", 99, clock.now)
    first = await host.reconcile()  # every DC in time: each whole, for every edge
    assert [(w.scope, w.version, weights_of(w, "m1")) for w in first] == [
        ("dc-a", 1, {"dc-a": 1.0, "dc-b": 1.0}),
        ("dc-b", 1, {"dc-a": 1.0, "dc-b": 1.0}),
    ]
    assert await host.reconcile() == []  # unchanged, and no renewal due yet
    feed_goodput(host, "dc-b", 60, clock.now)
    published = await host.reconcile()
    assert sorted(w.scope for w in published) == ["dc-a", "dc-b"]
    for snapshot in published:
        assert weights_of(snapshot, "m2") == {"dc-a": 1.0, "dc-b": 0.8}
    clock.now = 85.0  # no change (settled, within the band), and a renewal due
    feed_goodput(host, "dc-b", 88, clock.now)
    renewed = await host.reconcile()
    assert [w.version for w in renewed] == [3, 3]
    assert weights_of(renewed[0]) == {"dc-a": 1.0, "dc-b": 0.8}
    clock.now = 120.0  # the tables stopped 35 s ago: nothing moves, nothing is renewed
    assert await host.reconcile() == []


async def test_a_restarted_weights_controller_continues_versions_and_weights() -> None:
    bus, clock = InMemoryBus(), Clock()
    first = WeightHost(bus, ["m"], ["dc-a"], clock=clock)
    feed_goodput(first, "dc-b", 50, clock.now)
    [lowered] = await first.reconcile()
    restarted = WeightHost(bus, ["m"], ["dc-a"], clock=clock)
    reader = asyncio.create_task(follow(bus, WEIGHTS_TOPIC, restarted.apply, "earliest"))
    try:
        await asyncio.wait_for(restarted.caught_up(), 5.0)
    finally:
        reader.cancel()
    clock.now = 75.0
    feed_goodput(restarted, "dc-b", 50, clock.now)
    [again] = await restarted.reconcile()
    assert again.version == lowered.version + 1
    assert weights_of(again) == {"dc-b": 0.64}  # a step down from where it stood

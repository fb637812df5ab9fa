"""The controllers on a bus: tables in, quotas, weights and placements out, renewed
before they expire, continued after a restart."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Sequence

import pytest

from control.controllers.fleetmind import WeightController, WeightParams, weights_of
from control.controllers.slomax import QuotaController, long_documents
from schemas import Envelope
from schemas.base import TaskClass
from schemas.control import AdmissionQuotas, PlacementRecommendation
from schemas.fleet import FleetConfig
from schemas.tables import CapacityTable, GoodputRow, GoodputTable
from streams.feeds import follow
from streams.memory import InMemoryBus
from tests.conftest import read_for
from tests.unit.test_quota_controller import capacity, row
from tests.unit.test_weight_controller import region_row
from tokenfleet.controller_host import (
    PLACEMENT_TOPIC,
    QUOTAS_TOPIC,
    WEIGHTS_TOPIC,
    PlacementHost,
    QuotaHost,
    WeightHost,
)

SETTLED_S = WeightParams().settle_s + 5.0
"""Long enough after a weight's change for it to move again."""


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


class BrokerAway(InMemoryBus):
    """A bus whose next ``away`` publishes fail, as Kafka's do past their retries."""

    away = 0

    async def publish_events(self, envelopes: Sequence[Envelope]) -> None:
        if self.away:
            self.away -= 1
            raise ConnectionError("the broker is away")
        await super().publish_events(envelopes)


async def test_a_change_whose_publish_failed_goes_out_at_the_next_pass() -> None:
    bus, clock = BrokerAway(), Clock()
    host = QuotaHost(bus, QuotaController(), renew_s=25.0, clock=clock)
    feed(host, chats_met=96, documents_refused=0, now=clock.now)
    await host.reconcile()
    clock.now = 80.0  # chats far below their target: the limit halves
    feed(host, chats_met=50, documents_refused=0, now=clock.now)
    bus.away = 1
    with pytest.raises(ConnectionError):
        await host.reconcile()
    clock.now = 81.0
    [lowered] = await host.reconcile()
    assert (lowered.version, long_documents(lowered)) == (2, 4)


async def test_a_failed_pass_does_not_stop_the_controller() -> None:
    bus, clock = BrokerAway(), Clock()
    host = QuotaHost(bus, QuotaController(), period_s=0.01, clock=clock)
    feed(host, chats_met=96, documents_refused=0, now=clock.now)
    bus.away = 3
    running = asyncio.create_task(host.run())
    try:
        for _ in range(200):
            if await published(bus):
                break
            await asyncio.sleep(0.01)
        assert [q.version for q in await published(bus)] == [1]
        assert not running.done()
    finally:
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)


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
    [lowered] = await host.reconcile()  # 4
    clock.now = 100.0
    feed(host, chats_met=96, documents_refused=0, now=100.0)
    [renewed] = await host.reconcile()
    assert (long_documents(first), long_documents(lowered), long_documents(renewed)) == (8, 4, 4)
    restarted = QuotaHost(bus, clock=clock)
    for quotas in await published(bus):
        restarted.apply(quotas)
    clock.now = 105.0  # 30 s after the change: a fall may come, from 4
    feed(restarted, chats_met=50, documents_refused=0, now=105.0)
    [next_] = await restarted.reconcile()
    assert (next_.version, long_documents(next_)) == (4, 2)


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


def feed_goodput(
    host: WeightHost, dc: str, met: int, now: float, regions: tuple[GoodputRow, ...] = ()
) -> None:
    """The DC's goodput table of the window ending ``now`` (a newer version each time):
    100 requests, ``met`` in time; ``regions``: its rows by source region."""
    host.apply(
        GoodputTable(
            dc=dc,
            version=next(TABLE_VERSIONS),
            window_start=now - 60,
            window_end=now,
            classes=(row(TaskClass.INTERACTIVE, 100, met),),
            tenants=(),
            regions=regions,
        )
    )


async def test_the_weights_follow_goodput_for_every_edge_and_model_and_are_renewed() -> None:
    bus, clock = InMemoryBus(), Clock()
    host = WeightHost(bus, ["m1", "m2"], {"dc-a": None, "dc-b": None}, renew_s=20.0, clock=clock)
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


async def test_each_edge_gets_the_weights_its_own_region_s_requests_call_for() -> None:
    """dc-b serves its own region's chats in time and misses those from eu-west, 80 ms
    away: the edge in eu-west counts on less of dc-b, the one in us-east on all of it."""
    bus, clock = InMemoryBus(), Clock()
    per_region = WeightController(WeightParams(per_region=True))
    edges = {"dc-a": "eu-west", "dc-b": "us-east"}
    host = WeightHost(bus, ["m"], edges, per_region, clock=clock)
    far = region_row("eu-west", TaskClass.INTERACTIVE, 40, 20)
    near = region_row("us-east", TaskClass.INTERACTIVE, 60, 60)
    feed_goodput(host, "dc-b", 80, clock.now, regions=(far, near))  # 80 % in all
    published = {w.scope: weights_of(w) for w in await host.reconcile()}
    assert published == {"dc-a": {"dc-b": 0.8}, "dc-b": {"dc-b": 1.0}}
    clock.now += SETTLED_S  # dc-b now misses its own region's chats too
    near = region_row("us-east", TaskClass.INTERACTIVE, 60, 30)
    feed_goodput(host, "dc-b", 50, clock.now, regions=(far, near))
    published = {w.scope: weights_of(w) for w in await host.reconcile()}
    assert published == {"dc-a": {"dc-b": 0.64}, "dc-b": {"dc-b": 0.8}}


async def test_a_restarted_weights_controller_continues_versions_and_weights() -> None:
    bus, clock = InMemoryBus(), Clock()
    first = WeightHost(bus, ["m"], {"dc-a": None}, clock=clock)
    feed_goodput(first, "dc-b", 50, clock.now)
    [lowered] = await first.reconcile()
    restarted = WeightHost(bus, ["m"], {"dc-a": None}, clock=clock)
    reader = asyncio.create_task(follow(bus, WEIGHTS_TOPIC, restarted.apply, "earliest"))
    try:
        await asyncio.wait_for(restarted.caught_up(), 5.0)
    finally:
        reader.cancel()
    clock.now += SETTLED_S
    feed_goodput(restarted, "dc-b", 50, clock.now)
    [again] = await restarted.reconcile()
    assert again.version == lowered.version + 1
    assert weights_of(again) == {"dc-b": 0.64}  # a step down from where it stood


LONG_CYCLE_FLEET = FleetConfig.model_validate(
    {
        "dcs": [{"name": "dc-a", "region": "r1"}, {"name": "dc-b", "region": "r2"}],
        "models": [{"name": "m", "rps_per_instance": 5.0}, {"name": "unsized"}],
        "instances": [
            {"id": "a-0", "dc": "dc-a", "url": "http://127.0.0.1:1", "model": "m"},
            {"id": "b-0", "dc": "dc-b", "url": "http://127.0.0.1:2", "model": "m"},
            *(
                {"id": f"b-{n}", "dc": "dc-b", "url": f"http://127.0.0.1:{n + 2}", "model": "m"}
                | {"standby": True}
                for n in (1, 2)
            ),
            *(
                {"id": f"u-{n}", "dc": "dc-b", "url": "http://127.0.0.1:9", "model": "unsized"}
                | {"standby": n > 0}
                for n in (0, 1)
            ),
        ],
    }
)
"""dc-b runs one replica of ``m`` (5 requests a second each) and has GPUs for two more;
dc-a has none to spare, and ``unsized`` states no rate, so the long cycle leaves both."""


def feed_dc_b(
    host: PlacementHost,
    ended_rps: float,
    ready: int,
    now: float,
    queued: int = 0,
    unsized_running: int = 0,
    goodput: bool = True,
) -> None:
    """dc-b's tables for the minute ending ``now``: ``ended_rps`` requests a second ended
    there, ``ready`` replicas of ``m`` serve and ``queued`` requests wait for them, while
    ``unsized`` runs ``unsized_running``; ``goodput`` False: the capacity table alone."""
    version = next(TABLE_VERSIONS)
    if goodput:
        ended = row(TaskClass.INTERACTIVE, round(ended_rps * 60), 0)
        host.apply(
            GoodputTable(
                dc="dc-b",
                version=version,
                window_start=now - 60,
                window_end=now,
                classes=(ended,),
                tenants=(),
            )
        )
    m = capacity(ready, now).rows[0].model_copy(update={"queued": queued, "running": 1})
    unsized = m.model_copy(update={"model": "unsized", "queued": 0, "running": unsized_running})
    host.apply(
        CapacityTable(
            dc="dc-b", version=version, window_start=now - 60, window_end=now, rows=(m, unsized)
        )
    )


def targets(snapshot: PlacementRecommendation) -> dict[str, int]:
    return {a.model: a.target_replicas for a in snapshot.actions}


async def test_the_long_cycle_grows_a_hot_dc_onto_its_standby_gpus_and_waits_for_them() -> None:
    bus, clock = InMemoryBus(), Clock()
    host = PlacementHost(bus, LONG_CYCLE_FLEET, period_s=60.0, clock=clock)
    feed_dc_b(host, ended_rps=6.0, ready=1, now=clock.now)  # 1.2 of its one replica
    [grown] = await host.reconcile()
    assert (grown.scope, grown.version, targets(grown)) == ("dc-b", 1, {"m": 2})
    assert grown.actions[0].reason == "load 1.20"
    clock.now += 30  # the first move settles too, though it was the first snapshot
    feed_dc_b(host, ended_rps=20.0, ready=2, now=clock.now)
    assert await host.reconcile() == []
    clock.now += 120  # settled, but the second replica is still loading: nothing moves
    feed_dc_b(host, ended_rps=12.0, ready=1, now=clock.now)
    assert await host.reconcile() == []
    feed_dc_b(host, ended_rps=12.0, ready=2, now=clock.now + 1)  # it serves: 1.2 of two
    clock.now += 1
    [again] = await host.reconcile()
    assert (again.version, targets(again)) == (2, {"m": 3})  # 12 / 3.5 is 4; it has 3
    clock.now += 60  # too soon after the move, though the load fell away
    feed_dc_b(host, ended_rps=1.0, ready=3, now=clock.now)
    assert await host.reconcile() == []
    clock.now += 90  # settled and cold: one replica back, not all
    feed_dc_b(host, ended_rps=1.0, ready=3, now=clock.now)
    [shrunk] = await host.reconcile()
    assert targets(shrunk) == {"m": 2}
    clock.now += 45  # the tables stopped: nothing moves, nothing is renewed
    assert await host.reconcile() == []
    published = await read_for(bus, PLACEMENT_TOPIC, 0.05)
    assert [targets(p) for p in published] == [{"m": 2}, {"m": 3}, {"m": 2}]


async def test_a_queue_counts_as_demand_and_the_placement_is_renewed_unchanged() -> None:
    bus, clock = InMemoryBus(), Clock()
    host = PlacementHost(bus, LONG_CYCLE_FLEET, period_s=60.0, renew_s=100.0, clock=clock)
    feed_dc_b(host, ended_rps=3.0, ready=1, now=clock.now)  # 0.6 of its replica
    [base] = await host.reconcile()
    assert (targets(base), base.actions[0].reason) == ({"m": 1}, "base deployment")
    clock.now += 120
    feed_dc_b(host, ended_rps=3.0, ready=1, now=clock.now, queued=120)  # + 2 a second
    [grown] = await host.reconcile()
    assert targets(grown) == {"m": 2}
    clock.now += 100
    feed_dc_b(host, ended_rps=6.0, ready=2, now=clock.now)  # 0.6 of two: in the band
    [renewed] = await host.reconcile()
    assert (renewed.version, targets(renewed), renewed.issued_at) == (3, {"m": 2}, clock.now)


async def test_a_restarted_long_cycle_continues_from_the_published_placement() -> None:
    bus, clock = InMemoryBus(), Clock()
    first = PlacementHost(bus, LONG_CYCLE_FLEET, clock=clock)
    feed_dc_b(first, ended_rps=6.0, ready=1, now=clock.now)
    [grown] = await first.reconcile()
    restarted = PlacementHost(bus, LONG_CYCLE_FLEET, clock=clock, renew_s=10.0)
    reader = asyncio.create_task(follow(bus, PLACEMENT_TOPIC, restarted.apply, "earliest"))
    try:
        await asyncio.wait_for(restarted.caught_up(), 5.0)
    finally:
        reader.cancel()
    clock.now += 30
    feed_dc_b(restarted, ended_rps=6.0, ready=2, now=clock.now)  # in the band on two
    [renewed] = await restarted.reconcile()
    assert (renewed.version, targets(renewed)) == (grown.version + 1, {"m": 2})


async def test_the_first_move_settles_and_the_other_models_demand_is_not_charged() -> None:
    bus, clock = InMemoryBus(), Clock()
    host = PlacementHost(bus, LONG_CYCLE_FLEET, period_s=60.0, clock=clock)
    # 6 a second ended in dc-b, but five sixths of what runs there is the other model's
    feed_dc_b(host, ended_rps=6.0, ready=1, now=clock.now, unsized_running=5)
    [base] = await host.reconcile()
    assert targets(base) == {"m": 1}
    feed_dc_b(host, ended_rps=6.0, ready=1, now=clock.now)  # now all of it is m's
    [grown] = await host.reconcile()
    assert targets(grown) == {"m": 2}
    clock.now += 30  # served, and hotter still: but the move is 30 s old
    feed_dc_b(host, ended_rps=20.0, ready=2, now=clock.now)
    assert await host.reconcile() == []


async def test_stale_goodput_moves_nothing_and_replicas_that_never_serve_are_given_up() -> None:
    bus, clock = InMemoryBus(), Clock()
    host = PlacementHost(bus, LONG_CYCLE_FLEET, period_s=60.0, clock=clock)
    feed_dc_b(host, ended_rps=6.0, ready=1, now=clock.now)
    [grown] = await host.reconcile()
    assert targets(grown) == {"m": 2}
    clock.now += 150  # capacity fresh, goodput 150 s old: it would read as a cold DC
    feed_dc_b(host, ended_rps=0.0, ready=1, now=clock.now, goodput=False)
    assert await host.reconcile() == []
    clock.now += 100  # the second replica never came up, 250 s after it was asked for
    feed_dc_b(host, ended_rps=1.0, ready=1, now=clock.now)
    [given_up] = await host.reconcile()
    assert targets(given_up) == {"m": 1}


async def test_a_gap_in_the_tables_shorter_than_their_staleness_reads_the_newest() -> None:
    """With a cycle shorter than the tables' staleness (30 s), a hand-over between table
    workers left no table in the window: a rate of 0, and a DC in its band gave a replica
    back; skipped instead, the DC's renewal was skipped too, and its placement ran out."""
    bus, clock = InMemoryBus(), Clock()
    host = PlacementHost(bus, LONG_CYCLE_FLEET, period_s=4.0, renew_s=10.0, clock=clock)
    feed_dc_b(host, ended_rps=6.0, ready=1, now=clock.now)
    [grown] = await host.reconcile()
    assert targets(grown) == {"m": 2}
    clock.now += 120
    feed_dc_b(host, ended_rps=6.0, ready=2, now=clock.now - 6)  # fresh, but not in 4 s
    [renewed] = await host.reconcile()  # 0.6 of two: in the band, renewed unchanged
    assert (renewed.version, targets(renewed)) == (grown.version + 1, {"m": 2})


async def test_a_target_read_back_past_the_dc_s_gpus_is_sized_by_the_gpus_there() -> None:
    """A fleet file that lost standby GPUs since: the target read back was kept."""
    bus, clock = InMemoryBus(), Clock()
    earlier = PlacementHost(bus, LONG_CYCLE_FLEET, period_s=60.0, clock=clock)
    feed_dc_b(earlier, ended_rps=12.0, ready=1, now=clock.now)
    [grown] = await earlier.reconcile()
    big = grown.model_copy(
        update={"actions": (grown.actions[0].model_copy(update={"target_replicas": 5}),)}
    )
    host = PlacementHost(bus, LONG_CYCLE_FLEET, period_s=60.0, clock=clock)
    host.apply(big)
    clock.now += 120
    feed_dc_b(host, ended_rps=15.0, ready=3, now=clock.now)  # 1.0 of three: in the band
    [kept] = await host.reconcile()
    assert targets(kept) == {"m": 3}  # dc-b has GPUs for three


async def test_a_snapshot_read_back_from_ahead_of_the_clock_is_renewed_on_time(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Its age read negative: nothing was renewed until this clock caught up."""
    bus, clock = InMemoryBus(), Clock()
    ahead = PlacementHost(bus, LONG_CYCLE_FLEET, period_s=60.0, clock=lambda: clock.now + 300)
    feed_dc_b(ahead, ended_rps=6.0, ready=1, now=clock.now + 300)
    [published] = await ahead.reconcile()
    host = PlacementHost(bus, LONG_CYCLE_FLEET, period_s=60.0, renew_s=10.0, clock=clock)
    reader = asyncio.create_task(follow(bus, PLACEMENT_TOPIC, host._read_back, "earliest"))
    try:
        await asyncio.wait_for(host.caught_up(), 5.0)
    finally:
        reader.cancel()
    assert "300 s ahead of this clock" in caplog.text
    clock.now += 11
    feed_dc_b(host, ended_rps=6.0, ready=2, now=clock.now)  # 0.6 of two: in the band
    [renewed] = await host.reconcile()
    assert (renewed.version, targets(renewed)) == (published.version + 1, {"m": 2})


async def test_a_controller_no_longer_per_class_drops_the_class_weights_it_reads_back() -> None:
    """Read back, a per-class controller's weights would shadow the per-DC one for good:
    every reader takes a class's own weight first."""
    bus, clock = InMemoryBus(), Clock()
    per_class = WeightController(WeightParams(per_class=True))
    first = WeightHost(bus, ["m"], {"dc-a": None}, per_class, clock=clock)
    feed_goodput(first, "dc-b", 50, clock.now)
    [lowered] = await first.reconcile()
    assert weights_of(lowered, "m", TaskClass.INTERACTIVE) == {"dc-b": 0.8}
    restarted = WeightHost(bus, ["m"], {"dc-a": None}, clock=clock, renew_s=1.0)
    reader = asyncio.create_task(follow(bus, WEIGHTS_TOPIC, restarted.apply, "earliest"))
    try:
        await asyncio.wait_for(restarted.caught_up(), 5.0)
    finally:
        reader.cancel()
    clock.now += 5
    feed_goodput(restarted, "dc-b", 99, clock.now)
    [renewed] = await restarted.reconcile()
    assert {w.task_class for w in renewed.weights} == {None}
    assert weights_of(renewed, "m", TaskClass.INTERACTIVE) == {"dc-b": 1.0}


async def test_a_dc_with_its_base_replica_down_is_sized_by_what_serves() -> None:
    """dc-b's one base replica is down and its load would keep one busy: the long cycle
    does not wait for it to come up, but makes up for it on the standby GPUs."""
    bus, clock = InMemoryBus(), Clock()
    host = PlacementHost(bus, LONG_CYCLE_FLEET, period_s=60.0, clock=clock)
    feed_dc_b(host, ended_rps=6.0, ready=0, now=clock.now)
    [grown] = await host.reconcile()
    assert targets(grown) == {"m": 3}  # two serving for 6 a second, and the one down
    clock.now += 130  # the standby ones load: nothing moves while they may
    feed_dc_b(host, ended_rps=6.0, ready=1, now=clock.now)
    assert await host.reconcile() == []


async def test_expired_quotas_and_weights_start_again_from_where_the_gateways_are() -> None:
    """After two hours away, the controllers continue their versions but not the limits
    and weights they had set: the gateways dropped those at their TTL."""
    bus, clock = InMemoryBus(), Clock()
    quotas = QuotaHost(bus, clock=clock)
    feed(quotas, chats_met=50, documents_refused=0, now=clock.now)
    [lowered] = await quotas.reconcile()
    weights = WeightHost(bus, ["m"], {"dc-a": None}, clock=clock)
    feed_goodput(weights, "dc-b", 50, clock.now)
    [fallen] = await weights.reconcile()
    assert weights_of(fallen)["dc-b"] < 1
    clock.now += 7200
    feed(quotas, chats_met=96, documents_refused=0, now=clock.now)  # in the band
    [again] = await quotas.reconcile()
    assert (again.version, long_documents(lowered), long_documents(again)) == (2, 4, 8)
    feed_goodput(weights, "dc-b", 87, clock.now)  # in the band: no move
    [whole] = await weights.reconcile()
    assert (whole.version, weights_of(whole)) == (fallen.version + 1, {"dc-b": 1.0})


async def test_expired_quotas_are_not_renewed_while_no_instance_is_ready() -> None:
    bus, clock = InMemoryBus(), Clock()
    host = QuotaHost(bus, clock=clock)
    feed(host, chats_met=50, documents_refused=0, now=clock.now)
    assert len(await host.reconcile()) == 1
    clock.now += 7200
    feed(host, chats_met=96, documents_refused=0, now=clock.now)
    host.apply(capacity(0, now=clock.now).model_copy(update={"version": 10**9}))
    assert await host.reconcile() == []  # it renewed the limit the gateways had dropped


async def test_quotas_set_again_after_expiry_wait_before_their_next_move() -> None:
    """Set again to what they last changed to, they were taken as a renewal, and the next
    move was timed from the change two hours before."""
    bus, clock = InMemoryBus(), Clock()
    host = QuotaHost(bus, clock=clock)
    feed(host, chats_met=96, documents_refused=0, now=clock.now)
    [first] = await host.reconcile()
    clock.now += 7200
    feed(host, chats_met=96, documents_refused=0, now=clock.now)
    [again] = await host.reconcile()
    assert (long_documents(first), long_documents(again)) == (8, 8)
    clock.now += 5  # chats miss now; but the limit was set again 5 s ago
    feed(host, chats_met=50, documents_refused=0, now=clock.now)
    assert await host.reconcile() == []

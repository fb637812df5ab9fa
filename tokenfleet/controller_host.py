"""The controllers on an event bus: SLOMax's quotas, FleetMind's weights and its long
cycle's placements, in ``tokenfleet controller`` on Kafka (quotas and weights also in the
embedded mode's in-process loop).

``QuotaHost``: every ``period_s`` it reconciles each DC whose goodput and capacity tables it
has read (``control.controllers.slomax``) and publishes the quotas a change calls for on
``tf.control.quotas``. Gateways drop quotas older than their TTL, so unchanged quotas are
published again (a new version, the same limits) every ``renew_s``; the controller still
times its next move from the last change, not from a renewal. It reads
``tf.control.quotas`` back from the start, and reconciles nothing until it has read what
was there when it started, so that a restarted controller continues the versions and the
limits where they stand (its first move after a restart is timed from the last change)
instead of publishing versions the gateways drop as old.

Tables older than ``stale_after_s`` (a stream processor that stopped publishing) move
nothing and renew nothing: the quotas run out at their TTL and the gateways fall back to
the admission policy's defaults, as they do when no controller runs. Once a scope's
snapshot has expired (the tables stopped for longer than its TTL, or the controller was
away), its next pass starts again from those defaults too, where the gateways stand, not
from the limits or weights it published before; its versions go on.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from control.controllers.fleetmind import WeightController, WeightKey, keyed_weights, take_in
from control.controllers.placement import (
    DcReplicas,
    PlacementController,
    concluded_rps,
)
from control.controllers.slomax import QuotaController
from schemas import Envelope
from schemas.control import (
    AdmissionQuotas,
    ControlSnapshot,
    PlacementAction,
    PlacementRecommendation,
    RoutingWeights,
)
from schemas.fleet import FleetConfig
from schemas.tables import CapacityTable, GoodputTable
from streams.bus import EventBus
from streams.feeds import follow

log = logging.getLogger(__name__)

QUOTAS_TOPIC = "tf.control.quotas"
WEIGHTS_TOPIC = "tf.control.weights"
PLACEMENT_TOPIC = "tf.control.placement"
BASE = "base deployment"
"""The reason of a model's replicas the long cycle has not moved."""
TABLE_TOPICS = ("tf.tables.goodput", "tf.tables.capacity")
SnapshotT = TypeVar("SnapshotT", bound=ControlSnapshot)
STALE_AFTER_S = 30.0
"""Six slides of the tables' default window (5 s): the worker has stopped publishing."""
CLOCK_SLACK_S = 5.0
"""How far ahead of this host's clock a snapshot read back may have been issued before it is
taken as issued now."""


class _ControlHost(ABC, Generic[SnapshotT]):
    """What both controllers' hosts share: follow their inputs and their own topic from
    the start, read back what they published before deciding anything, then reconcile
    every ``period_s``; publish a pass's snapshots and take them in as if read back."""

    control_topic: str
    input_topics: tuple[str, ...]

    def __init__(
        self,
        bus: EventBus,
        ttl_s: float,
        period_s: float,
        renew_s: float | None,
        clock: Callable[[], float],
        source: str,
        stale_after_s: float,
    ) -> None:
        """``renew_s`` None: a third of the snapshots' TTL."""
        self.bus = bus
        self.period_s = period_s
        self.renew_s = ttl_s / 3 if renew_s is None else renew_s
        self.clock = clock
        self.source = source
        self.stale_after_s = stale_after_s
        self._published: dict[str, SnapshotT] = {}
        """The newest snapshot on the topic per scope (a change or a renewal)."""
        self._read = asyncio.Event()
        """Set whenever a snapshot of this host's topic is taken in."""

    async def run(self) -> None:
        """Read and reconcile until cancelled."""
        readers = [
            asyncio.create_task(follow(self.bus, topic, self.apply, "earliest"))
            for topic in self.input_topics
        ]
        readers.append(
            asyncio.create_task(follow(self.bus, self.control_topic, self._read_back, "earliest"))
        )
        try:
            await self.caught_up()
            while True:
                await asyncio.sleep(self.period_s)
                try:
                    await self.reconcile()
                except Exception:  # the bus away past its retries, or a bug: the next pass
                    log.warning(
                        "%s: a pass failed; the next tries again", self.source, exc_info=True
                    )
        finally:
            for reader in readers:
                reader.cancel()
            await asyncio.gather(*readers, return_exceptions=True)

    async def caught_up(self, retry_s: float = 1.0) -> None:
        """Until the snapshots on the topic now have been read (and applied) by the reader:
        a restarted controller continues their versions instead of publishing versions
        the gateways drop as old."""
        while True:
            try:
                newest = await self.bus.read_latest(self.control_topic)
                break
            except LookupError:  # no such topic yet: nothing was ever published
                return
            except Exception as exc:  # the bus is away: read again, decide nothing yet
                log.warning("reading %s failed (%s); retrying", self.control_topic, exc)
                await asyncio.sleep(retry_s)
        waiting = [e.payload for e in newest.values() if isinstance(e.payload, ControlSnapshot)]
        while True:
            self._read.clear()
            if not any(s.supersedes(self._published.get(s.scope)) for s in waiting):
                return
            await self._read.wait()

    @abstractmethod
    async def reconcile(self) -> list[SnapshotT]:
        """One pass: the snapshots the inputs call for, published."""

    @abstractmethod
    def apply(self, message: object) -> None:
        """Take in an input or a snapshot of this host's topic read from the bus."""

    def _read_back(self, message: object) -> None:
        """``apply`` a snapshot read from this host's topic, as issued now where it was
        issued past ``CLOCK_SLACK_S`` ahead of this host's clock (by a controller on a
        host whose clock is ahead, or by this one before a restart that followed its
        clock stepped back): its age would read negative, and nothing would be renewed or
        changed until the clock caught up. A clock stepped back under a running host is
        not caught: its own snapshots are held as it published them."""
        now = self.clock()
        if isinstance(message, ControlSnapshot) and message.issued_at > now + CLOCK_SLACK_S:
            log.warning(
                "%s: %s's snapshot for %s was issued %.0f s ahead of this clock; taken as "
                "issued now (check the hosts' clocks)",
                self.source,
                self.control_topic,
                message.scope,
                message.issued_at - now,
            )
            message = message.model_copy(update={"issued_at": now})
        self.apply(message)

    async def _publish(self, snapshots: list[SnapshotT]) -> list[SnapshotT]:
        if snapshots:
            await self.bus.publish_events([Envelope.wrap(s, source=self.source) for s in snapshots])
            for snapshot in snapshots:
                self.apply(snapshot)
        return snapshots

    def _expired(self, scope: str, now: float) -> bool:
        """Whether this host's snapshot for ``scope`` has run out: the gateways are back
        on their defaults."""
        published = self._published.get(scope)
        return published is not None and published.expired(now)

    def _taken_in(self, snapshot: SnapshotT) -> bool:
        """Hold ``snapshot`` if it is newer than the one held for its scope."""
        if not snapshot.supersedes(self._published.get(snapshot.scope)):
            return False
        self._published[snapshot.scope] = snapshot
        self._read.set()
        return True


class QuotaHost(_ControlHost[AdmissionQuotas]):
    control_topic = QUOTAS_TOPIC
    input_topics = TABLE_TOPICS

    def __init__(
        self,
        bus: EventBus,
        controller: QuotaController | None = None,
        period_s: float = 5.0,
        renew_s: float | None = None,
        clock: Callable[[], float] = time.time,
        source: str = "controller",
        stale_after_s: float = STALE_AFTER_S,
    ) -> None:
        """``renew_s`` None: a third of the quotas' TTL."""
        self.controller = controller or QuotaController()
        ttl_s = self.controller.params.ttl_s
        super().__init__(bus, ttl_s, period_s, renew_s, clock, source, stale_after_s)
        self._goodput: dict[str, GoodputTable] = {}
        self._capacity: dict[str, CapacityTable] = {}
        self._changed: dict[str, AdmissionQuotas] = {}
        """The quotas of the last change per DC: when and to what the limits last moved."""

    async def reconcile(self) -> list[AdmissionQuotas]:
        """One pass over every DC with both tables; what it published."""
        now = self.clock()
        return await self._publish(
            [
                quotas
                for dc, goodput in self._goodput.items()
                if dc in self._capacity
                and (quotas := self._next(dc, goodput, self._capacity[dc], now)) is not None
            ]
        )

    def apply(self, message: object) -> None:
        """Take in a table or a quota snapshot read from the bus (newer versions only)."""
        if isinstance(message, GoodputTable) and message.supersedes(self._goodput.get(message.dc)):
            self._goodput[message.dc] = message
        elif isinstance(message, CapacityTable) and message.supersedes(
            self._capacity.get(message.dc)
        ):
            self._capacity[message.dc] = message
        elif isinstance(message, AdmissionQuotas):
            before = self._published.get(message.scope)
            if not self._taken_in(message):
                return
            changed = self._changed.get(message.scope)
            started_again = before is not None and before.expired(message.issued_at)
            if changed is None or changed.quotas != message.quotas or started_again:
                self._changed[message.scope] = message  # a change, not a renewal

    def _next(
        self, dc: str, goodput: GoodputTable, capacity: CapacityTable, now: float
    ) -> AdmissionQuotas | None:
        """The change the tables call for, else a renewal that is due, else None (also
        when a table is stale)."""
        if now - min(goodput.window_end, capacity.window_end) > self.stale_after_s:
            return None
        published = self._published.get(dc)
        changed = self._changed.get(dc)
        current = (
            None  # none, or expired: the gateways are back on the defaults, and so is this
            if published is None or changed is None or published.expired(now)
            else changed.model_copy(update={"version": published.version})
        )
        desired = self.controller.reconcile(goodput, capacity, current, now)
        if desired is not None and published is not None and current is None:
            desired = desired.model_copy(update={"version": published.version + 1})
        if desired is not None:  # held as the last change once published (``apply``)
            return desired
        if (
            published is not None
            and not published.expired(now)
            and now - published.issued_at >= self.renew_s
        ):
            return published.model_copy(update={"version": published.version + 1, "issued_at": now})
        return None


class WeightHost(_ControlHost[RoutingWeights]):
    """FleetMind's weights controller on a bus: every ``period_s`` it reconciles the DCs'
    weights from their goodput tables (``control.controllers.fleetmind``) and publishes
    one snapshot per edge (``edges``: the DCs whose gateways choose DCs, each with its
    region, whose requests its weights are judged on; None: all requests) on
    ``tf.control.weights``, for every one of ``models``: the first as soon as tables are
    fresh, every DC whole, so that gateways and ``tokenfleet status`` see the controller
    at work before anything moves. Like ``QuotaHost``, it renews unchanged weights before
    their TTL runs out, reads the topic back before deciding anything, and lets stale
    tables move nothing."""

    control_topic = WEIGHTS_TOPIC
    input_topics = TABLE_TOPICS[:1]

    def __init__(
        self,
        bus: EventBus,
        models: Sequence[str],
        edges: Mapping[str, str | None],
        controller: WeightController | None = None,
        period_s: float = 5.0,
        renew_s: float | None = None,
        clock: Callable[[], float] = time.time,
        source: str = "controller",
        stale_after_s: float = STALE_AFTER_S,
    ) -> None:
        """``renew_s`` None: a third of the weights' TTL."""
        self.models = tuple(models)
        self.edges = dict(edges)
        self.controller = controller or WeightController()
        ttl_s = self.controller.params.ttl_s
        super().__init__(bus, ttl_s, period_s, renew_s, clock, source, stale_after_s)
        self._goodput: dict[str, GoodputTable] = {}
        self._weights: dict[str, dict[WeightKey, float]] = {edge: {} for edge in self.edges}
        """Each edge's (DC, class) weights as last published."""
        self._changed_at: dict[str, dict[WeightKey, float]] = {edge: {} for edge in self.edges}

    async def reconcile(self) -> list[RoutingWeights]:
        """One pass over every DC with a fresh goodput table, for each edge; what it
        published."""
        now = self.clock()
        fresh = {
            dc: table
            for dc, table in self._goodput.items()
            if now - table.window_end <= self.stale_after_s
        }
        whole = {key: 1.0 for dc, t in fresh.items() for key in self.controller.groups(dc, t)}
        due = []
        for edge, region in self.edges.items():
            if self._expired(edge, now):  # the gateways are back on whole weights
                self._weights[edge].clear()
                self._changed_at[edge].clear()
            current = self._weights[edge]
            changed = (
                self.controller.reconcile(fresh, current, self._changed_at[edge], now, region)
                if fresh  # tables all stale: nothing moves, the weights run out at their TTL
                else None
            )
            # unchanged: the first snapshot (every DC whole), or a renewal, on fresh tables
            if changed is not None or (fresh and self._renewal_due(edge, now)):
                weights = whole | (current if changed is None else changed)
                version = self._version(edge)
                due.append(self.controller.snapshot(weights, self.models, edge, version, now))
        return await self._publish(due)

    def _renewal_due(self, edge: str, now: float) -> bool:
        published = self._published.get(edge)
        return published is None or now - published.issued_at >= self.renew_s

    def _version(self, edge: str) -> int:
        published = self._published.get(edge)
        return 1 if published is None else published.version + 1

    def apply(self, message: object) -> None:
        """Take in a goodput table or a weights snapshot read from the bus (newer only)."""
        if isinstance(message, GoodputTable) and message.supersedes(self._goodput.get(message.dc)):
            self._goodput[message.dc] = message
        elif (
            isinstance(message, RoutingWeights)
            and self._taken_in(message)
            and message.scope in self.edges  # another edge's, from an older fleet file
        ):
            per_class = self.controller.params.per_class
            ours = {  # a weight of the other mode, from before a restart, is not ours
                key: weight
                for key, weight in keyed_weights(message).items()
                if (key[1] is None) != per_class
            }
            edge = message.scope
            take_in(self._weights[edge], self._changed_at[edge], ours, message.issued_at)


@dataclass(frozen=True)
class _Managed:
    """A model the long cycle places in a DC."""

    floor: int
    """Instances not on standby: its base deployment."""
    ceiling: int
    """Every instance of it there, standby included."""
    version: str
    rps: float
    """What one replica serves (the fleet file's ``rps_per_instance``)."""


class PlacementHost(_ControlHost[PlacementRecommendation]):
    """FleetMind's long cycle on a bus: every ``period_s`` (minutes) it judges each DC's
    demand over the last ``window_s`` against the replicas ready there
    (``control.controllers.placement``) and publishes one snapshot per DC on
    ``tf.control.placement``: the replicas to run of every model that has standby GPUs
    in it (instances marked ``standby`` in the fleet file). The first as soon as the DC's
    tables are fresh (its base deployment), then a change or a renewal. Like the other
    hosts it reads its topic back before deciding, and lets stale tables move nothing.

    Demand is what the DC's goodput tables say it ended per second over the window, plus
    what its capacity table shows waiting now, spread over the window; with several
    models in one DC (the tables hold no model), each model's share is its share of the
    requests running and queued. A model without ``rps_per_instance`` cannot be sized and
    is left alone."""

    control_topic = PLACEMENT_TOPIC
    input_topics = TABLE_TOPICS

    def __init__(
        self,
        bus: EventBus,
        fleet: FleetConfig,
        controller: PlacementController | None = None,
        period_s: float = 60.0,
        window_s: float | None = None,
        renew_s: float | None = None,
        clock: Callable[[], float] = time.time,
        source: str = "controller",
        stale_after_s: float = STALE_AFTER_S,
    ) -> None:
        """``window_s`` None: one period."""
        self.fleet = fleet
        self.controller = controller or PlacementController()
        self.window_s = period_s if window_s is None else window_s
        ttl_s = self.controller.params.ttl_s
        super().__init__(bus, ttl_s, period_s, renew_s, clock, source, stale_after_s)
        self._ended: dict[str, deque[tuple[float, float, int]]] = {}
        """Per DC, each goodput table's (window end, requests ended per second, version)."""
        self._capacity: dict[str, CapacityTable] = {}
        self._changed_at: dict[str, float] = {}

    def managed(self, dc: str) -> dict[str, _Managed]:
        """The models of ``dc`` the long cycle places: those with standby GPUs there and
        a stated ``rps_per_instance`` (the size of a replica)."""
        out = {}
        for model in self.fleet.models:
            mine = [i for i in self.fleet.instances if (i.dc, i.model) == (dc, model.name)]
            spare = [i for i in mine if i.standby]
            if model.rps_per_instance and spare:
                floor = len(mine) - len(spare)
                out[model.name] = _Managed(
                    floor, len(mine), spare[0].version, model.rps_per_instance
                )
        return out

    async def reconcile(self) -> list[PlacementRecommendation]:
        """One pass over every DC with standby GPUs and fresh tables; what it published."""
        now = self.clock()
        snapshots = []
        for dc in (d.name for d in self.fleet.dcs):
            models = self.managed(dc)
            capacity, ended = self._capacity.get(dc), self._ended.get(dc)
            if not models or capacity is None or not ended:
                continue
            if now - min(capacity.window_end, ended[-1][0]) > self.stale_after_s:
                continue  # a table stopped: it would read as a cold DC
            # none ended in the window (a cycle shorter than the tables' slide, a worker's
            # hand-over): the newest, fresh as checked above, not a rate of 0
            rates = [rate for end, rate, _ in ended if end >= now - self.window_s]
            rates = rates or [ended[-1][1]]
            desired = self._desired(dc, models, capacity, sum(rates) / len(rates), now)
            published = self._published.get(dc)
            if published is None:
                snapshots.append(self.controller.snapshot(dc, desired, 1, now))
            elif desired != published.actions or now - published.issued_at >= self.renew_s:
                snapshots.append(self.controller.snapshot(dc, desired, published.version + 1, now))
        return await self._publish(snapshots)

    def _desired(
        self, dc: str, models: dict[str, _Managed], capacity: CapacityTable, rate: float, now: float
    ) -> tuple[PlacementAction, ...]:
        """``rate``: the requests a second the DC's goodput tables saw end over the window."""
        busy = {r.model: 0 for r in capacity.rows}
        for r in capacity.rows:  # every model's, managed or not: the rate is the DC's
            busy[r.model] += r.running + r.queued
        total = sum(busy.values())
        actions = []
        for model, managed in models.items():
            rows = [r for r in capacity.rows if r.model == model]
            share = busy.get(model, 0) / total if total else 1 / max(len(busy), 1)
            current = self._current(dc, model)
            ready = sum(r.ready_endpoints for r in rows)
            # a target read back from before the fleet file lost GPUs: what there is now
            deployed = (
                managed.floor if current is None else min(current.target_replicas, managed.ceiling)
            )
            lost = 0 if self._warming(dc, now) else max(deployed - ready, 0)
            if lost:
                log.warning(
                    "%s: %d of %d %s replicas not serving; sized by the %d that are",
                    dc,
                    lost,
                    deployed,
                    model,
                    ready,
                )
            replicas = DcReplicas(  # counted in replicas that serve
                ready=ready,
                deployed=deployed - lost,
                floor=max(managed.floor - lost, 0),
                ceiling=managed.ceiling - lost,
                sent_rps=rate * share + sum(r.queued for r in rows) / self.window_s,
            )
            moves = self.controller.targets({dc: replicas}, managed.rps, self._changed_at, now)
            kept = (deployed - lost, BASE if current is None else current.reason)
            target, why = moves.get(dc, kept)
            actions.append(
                PlacementAction(
                    model=model,
                    model_version=managed.version,
                    dc=dc,
                    target_replicas=target + lost,
                    reason=why,
                )
            )
        return tuple(actions)

    def _warming(self, dc: str, now: float) -> bool:
        """Whether replicas the last move asked for in ``dc`` may still be loading: for
        twice the settling time after it. Past that, and in a DC never moved, a replica
        short of those deployed is down or never came up: it counts as lost, and the DC
        is judged by what serves, one more replica asked for to make up for it. Waiting
        instead for every replica to serve would freeze a DC with a base replica down,
        just when it has the least capacity."""
        return now - self._changed_at.get(dc, -math.inf) <= 2 * self.controller.params.settle_s

    def _current(self, dc: str, model: str) -> PlacementAction | None:
        """What was last published for ``model`` in ``dc``."""
        published = self._published.get(dc)
        actions = published.actions if published is not None else ()
        return next((a for a in actions if a.model == model), None)

    def apply(self, message: object) -> None:
        """Take in a table or a placement read from the bus (newer versions only)."""
        if isinstance(message, GoodputTable):
            ended = self._ended.setdefault(message.dc, deque(maxlen=1000))
            if not ended or message.version > ended[-1][2]:
                ended.append((message.window_end, concluded_rps(message), message.version))
        elif isinstance(message, CapacityTable) and message.supersedes(
            self._capacity.get(message.dc)
        ):
            self._capacity[message.dc] = message
        elif isinstance(message, PlacementRecommendation):
            before = self._published.get(message.scope)
            if not self._taken_in(message):
                return
            if before is None:  # the first read (after a restart, maybe the newest alone)
                moved = any(a.reason != BASE for a in message.actions)
            else:
                moved = _targets(before) != _targets(message)
            if moved:
                self._changed_at[message.scope] = message.issued_at


def _targets(placement: PlacementRecommendation) -> dict[str, int]:
    return {a.model: a.target_replicas for a in placement.actions}

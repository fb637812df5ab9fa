"""What a gateway knows of its fleet: instances from the fleet file, their last telemetry,
their recent upstream failures, each DC's last goodput table, and the last control
snapshots it heard.

Everything here is last-known: when the feeds go quiet (Kafka down, collector stopped) the
gateway keeps routing on what it last heard, and on its own failure observations.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Generic, TypeVar

import numpy as np

from control.routing.snapshot import DEFAULT_BLOCK_SIZE, FleetSnapshot, prefix_blocks_held
from gateway.state import SharedView
from schemas.control import ControlSnapshot
from schemas.fleet import FleetConfig, InstanceConfig
from schemas.tables import GoodputTable
from schemas.telemetry import InstanceTelemetry

UNKNOWN_KV_BLOCKS = 1 << 20
"""KV blocks assumed for an instance until its telemetry reports the real size: large, so
that an unknown cache never looks full."""
TABLES_STALE_S = 30.0
"""A DC's goodput table whose window ended longer ago than this says nothing of its pace
now: the age at which the controllers stop acting on tables too
(``tokenfleet.controller_host.STALE_AFTER_S``)."""


@dataclass(frozen=True)
class DcPace:
    """What a DC's newest goodput table says of its pace: requests completed per second
    of each model over the table's window, and when that window ended (epoch seconds)."""

    version: int
    window_end: float
    completed_per_s: Mapping[str, float]

    @classmethod
    def of(cls, table: GoodputTable) -> DcPace:
        span = table.window_end - table.window_start
        rates = {row.key: row.completed / span if span > 0 else 0.0 for row in table.models}
        return cls(table.version, table.window_end, rates)


@dataclass(frozen=True)
class Pool:
    """The instances of one model in one DC, in fleet-file order (a snapshot's rows)."""

    model: str
    dc: str
    instances: tuple[InstanceConfig, ...]

    @functools.cached_property
    def ids(self) -> tuple[str, ...]:
        """Asked several times per request, so computed once."""
        return tuple(i.id for i in self.instances)


@dataclass(frozen=True)
class PoolLoad:
    """A pool's load as last scraped: the mean requests waiting and mean share of KV in
    use per ready instance, and the requests running or waiting in all."""

    waiting: float = 0.0
    kv_use: float = 0.0
    requests: int = 0


class FleetView:
    def __init__(
        self, fleet: FleetConfig, failure_cooldown_s: float = 5.0, consecutive_5xx: int = 5
    ) -> None:
        self.fleet = fleet
        self.failure_cooldown_s = failure_cooldown_s
        self.consecutive_5xx = consecutive_5xx
        self._telemetry: dict[str, InstanceTelemetry] = {}
        self._standby = frozenset(i.id for i in fleet.instances if i.standby)
        """Instances down until a placement starts them: not ready before telemetry says."""
        self._other_version = frozenset(i.id for i in fleet.instances if _off_version(i, fleet))
        """Instances of a version their model's requests must not run on: never ready, so
        no decision, retry or ceiling counts them (a rolling upgrade's old replicas)."""
        self._failed_until: dict[str, float] = {}
        self._errors_in_a_row: dict[str, int] = {}
        self._tokens_seen: dict[str, float] = {}
        self._pace: dict[str, DcPace] = {}
        self._pools: dict[tuple[str, str], Pool] = {}
        for instance in fleet.instances:
            key = (instance.model, instance.dc)
            known = self._pools.get(key)
            members = (known.instances if known else ()) + (instance,)
            self._pools[key] = Pool(instance.model, instance.dc, members)

    def pool(self, model: str, dc: str) -> Pool | None:
        return self._pools.get((model, dc))

    def dcs_serving(self, model: str) -> list[str]:
        return [dc for (m, dc) in self._pools if m == model]

    def observe(self, telemetry: InstanceTelemetry) -> None:
        if any(i.id == telemetry.instance_id for i in self.fleet.instances):
            self._telemetry[telemetry.instance_id] = telemetry

    def observe_goodput(self, table: GoodputTable, now: float | None = None) -> None:
        """Keep each DC's newest goodput table's pace: a replayed older one changes
        nothing, but any table replaces one gone stale (versions are a worker's clock in
        milliseconds, and the worker taking a DC over may run behind)."""
        held = self._pace.get(table.dc)
        now = time.time() if now is None else now
        if held is None or table.version > held.version or _stale(held, now):
            self._pace[table.dc] = DcPace.of(table)

    def completed_per_s(self, model: str, dc: str, now: float | None = None) -> float:
        """Requests of ``model`` the DC completed per second over its tables' last window
        (the pace its queue for the model drains at, as the simulator's edge reads it from
        the tables published to it); 0 while no table came or the last one is stale."""
        pace = self._pace.get(dc)
        if pace is None or _stale(pace, time.time() if now is None else now):
            return 0.0
        return pace.completed_per_s.get(model, 0.0)

    def failed(self, instance_id: str, *, status: int | None = None) -> None:
        """An upstream call failed: keep the instance out of decisions for a cooldown. A
        5xx or 404 answer (``status``) counts toward ``consecutive_5xx`` answers in a row, as
        Envoy's outlier detection counts them (its default is 5): vLLM answers 500 for
        some requests' own faults (a tool parser that raised), and one such request,
        retried once, would otherwise leave out two instances, and a pool of two
        unserved. A failed transport (no answer, or one unreadable) leaves it out at once."""
        if status is not None:
            errors = self._errors_in_a_row.get(instance_id, 0) + 1
            self._errors_in_a_row[instance_id] = errors
            if errors < self.consecutive_5xx:
                return
        self._errors_in_a_row.pop(instance_id, None)
        self._failed_until[instance_id] = time.monotonic() + self.failure_cooldown_s

    def served(self, instance_id: str) -> None:
        """The instance answered below 500: its 5xx answers in a row start again from 0."""
        if self._errors_in_a_row:
            self._errors_in_a_row.pop(instance_id, None)

    def tokens_streamed(self, instance_id: str) -> None:
        """A streamed answer's token after its first came back from the instance: one of
        its steps ended just now, and the next began. (A first token can trail its step:
        the emulator, for one, adds the whole API overhead to it.) Each replica sees the
        streams it relays; with many sequences decoding on an instance, those are enough
        to see most steps end."""
        self._tokens_seen[instance_id] = time.monotonic()

    def ready(self, instance_id: str) -> bool:
        if instance_id in self._other_version:
            return False
        if time.monotonic() < self._failed_until.get(instance_id, 0.0):
            return False
        telemetry = self._telemetry.get(instance_id)
        if telemetry is None:
            return instance_id not in self._standby
        return telemetry.ready

    def prefix_capacity(self, instance_id: str) -> int:
        """The instance's KV cache, as last reported, in prefix blocks (``BLOCK_TOKENS``
        each, whatever its engine's block size): its entry's size in the prefix index."""
        telemetry = self._telemetry.get(instance_id)
        if telemetry is None:
            return prefix_blocks_held(UNKNOWN_KV_BLOCKS, DEFAULT_BLOCK_SIZE)
        return prefix_blocks_held(telemetry.kv_blocks_total, telemetry.block_size)

    def any_ready(self) -> bool:
        return any(self.ready(i.id) for i in self.fleet.instances)

    def load(self, pool: Pool) -> PoolLoad:
        """The pool's ready instances as last scraped."""
        rows = [t for i in pool.ids if self.ready(i) and (t := self._telemetry.get(i))]
        if not rows:
            return PoolLoad()
        waiting = sum(t.waiting for t in rows)
        return PoolLoad(
            waiting / len(rows),
            sum(t.kv_blocks_used / max(t.kv_blocks_total, 1) for t in rows) / len(rows),
            waiting + sum(t.running for t in rows),
        )

    def snapshot(self, pool: Pool, shared: SharedView) -> FleetSnapshot:
        rows = [self._telemetry.get(i) for i in pool.ids]
        return FleetSnapshot(
            instance_ids=pool.ids,
            ready=np.array([self.ready(i) for i in pool.ids]),
            waiting=np.array([t.waiting if t else 0 for t in rows], dtype=np.int64),
            running=np.array([t.running if t else 0 for t in rows], dtype=np.int64),
            inflight_tokens=np.maximum(shared.inflight_tokens, 0).astype(np.int64),
            kv_blocks_used=np.array([t.kv_blocks_used if t else 0 for t in rows], dtype=np.int64),
            kv_blocks_total=np.array(
                [t.kv_blocks_total if t else UNKNOWN_KV_BLOCKS for t in rows], dtype=np.int64
            ),
            pending_prefill_tokens=np.maximum(shared.pending_prefill, 0.0),
            last_step_end_s=np.array([self._tokens_seen.get(i, -np.inf) for i in pool.ids]),
            kv_block_size=np.array(
                [t.block_size if t else DEFAULT_BLOCK_SIZE for t in rows], dtype=np.int64
            ),
        )


def _stale(pace: DcPace, now: float) -> bool:
    return now - pace.window_end > TABLES_STALE_S


def _off_version(instance: InstanceConfig, fleet: FleetConfig) -> bool:
    model = fleet.model(instance.model)
    return model is not None and model.version not in (None, instance.version)


SnapshotT = TypeVar("SnapshotT", bound=ControlSnapshot)


class LastKnown(Generic[SnapshotT]):
    """The newest control snapshot per scope; a snapshot past its TTL reads as None, which
    callers answer with their documented safe default."""

    def __init__(self) -> None:
        self._by_scope: dict[str, SnapshotT] = {}

    def offer(self, snapshot: SnapshotT, now: float | None = None) -> bool:
        """Keep ``snapshot`` if it is live and newer than the one held, or the one held has
        expired (a controller started again on a new topic counts from version 1 again);
        True if it was kept. An expired snapshot is never kept: a replay of an old one
        must not displace a live one."""
        now = time.time() if now is None else now
        if not snapshot.replaces(self._by_scope.get(snapshot.scope), now):
            return False
        self._by_scope[snapshot.scope] = snapshot
        return True

    def current(self, scope: str, now: float | None = None) -> SnapshotT | None:
        snapshot = self._by_scope.get(scope)
        if snapshot is None or snapshot.expired(time.time() if now is None else now):
            return None
        return snapshot

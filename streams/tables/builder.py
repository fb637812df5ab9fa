"""One DC's windowed state, and the builder that feeds every DC from decoded events."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from schemas import Envelope
from schemas.base import TaskClass
from schemas.objectives import ClassObjective, Objectives
from schemas.tables import CapacityTable, GoodputTable, KvTable, WindowedTable
from schemas.telemetry import InstanceTelemetry, KvBlocksRemoved
from streams.tables import outcomes
from streams.tables.capacity import FleetSlice
from streams.tables.goodput import GoodputCounts, group_keys, rows
from streams.tables.outcomes import Outcome, RequestState
from streams.tables.windows import WindowSpec

DEDUP_MEMORY = 100_000
"""Telemetry and KV event ids remembered for deduplication."""


@dataclass
class DcTables:
    """One DC's slices: goodput groups and fleet state, by slice start."""

    goodput: dict[float, dict[str, GoodputCounts]] = field(default_factory=dict)
    fleet: dict[float, FleetSlice] = field(default_factory=dict)
    counted: dict[float, set[str]] = field(default_factory=dict)
    """Ids of the outcomes and evictions counted, by slice: a host that delivers one twice
    (a replay after a crash) counts it once."""
    watermark: float = float("-inf")
    """The latest event time seen for this DC."""
    horizon: float = float("inf")
    """The latest event time its host believes (its clock and the grace): a later one
    counts as of the horizon, and is remembered as counted by its own time, which a
    replay finds the same whatever the clock then. One event stamped an hour ahead (a
    producer's clock, or milliseconds sent as seconds) moved the watermark with it, and
    every slice expired and every later event counted as late, for as long as the
    watermark stood there."""
    version: int = 0
    """The last tables' version: versions are the publishing clock's milliseconds, but
    never go back within a host while that clock steps back (NTP)."""

    def add_outcome(
        self, outcome: Outcome, objective: ClassObjective, spec: WindowSpec
    ) -> set[float]:
        """Count an outcome; returns the slices it changed (none for one counted before)."""
        ts = min(outcome.ts, self.horizon)
        counted_in = spec.slice_of(outcome.ts)  # its own time: the same in a replay
        if not self._first(outcome.event_id, counted_in):
            return set()
        if not outcome.unmatched:  # its time is when it was given up, not an event's
            self.watermark = max(self.watermark, ts)
        late = outcome.unmatched or spec.is_late(ts, self.watermark)
        at = spec.slice_of(max(self.watermark, ts) if late else ts)
        groups = self.goodput.setdefault(at, {})
        for key in group_keys(outcome):
            counts = groups.setdefault(key, GoodputCounts())
            if late:
                counts.late_events += 1
            else:
                counts.add(outcome, objective)
        if not late and outcome.kind is outcomes.OutcomeKind.COMPLETED and not outcome.repeated:
            prefill = outcome.input_tokens - outcome.cached_tokens
            self._fleet(at).deliver(outcome.model, prefill, outcome.output_tokens)
        return {counted_in, at}

    def add_telemetry(
        self, telemetry: InstanceTelemetry, ts: float, spec: WindowSpec
    ) -> set[float]:
        ts = min(ts, self.horizon)
        self.watermark = max(self.watermark, ts)
        if spec.is_late(ts, self.watermark):
            return set()
        self._fleet(spec.slice_of(ts)).observe(telemetry, ts)
        return {spec.slice_of(ts)}

    def add_evictions(
        self, event_id: str, instance: str, blocks: int, ts: float, spec: WindowSpec
    ) -> set[float]:
        counted_in = spec.slice_of(ts)  # its own time: the same in a replay
        if not self._first(event_id, counted_in):
            return set()
        ts = min(ts, self.horizon)
        at = spec.slice_of(ts)
        self.watermark = max(self.watermark, ts)
        if not spec.is_late(ts, self.watermark):
            self._fleet(at).evicted(instance, blocks)
        return {counted_in, at}

    def _first(self, event_id: str, at: float) -> bool:
        ids = self.counted.setdefault(at, set())
        if event_id in ids:
            return False
        ids.add(event_id)
        return True

    def expire(self, spec: WindowSpec) -> set[float]:
        """Drop the slices no window can use any more; returns their starts. So do those
        more than a window past the horizon, which hold only the ids of events stamped
        that far ahead (counted by their own time): they would never fall behind the
        watermark, and a producer sending milliseconds as seconds would add one with
        every event. A replay after a crash may count such an event again."""
        gone = set()
        ahead = self.horizon + spec.size_s
        for slices in (self.goodput, self.fleet, self.counted):
            for start in [s for s in slices if spec.expired(s, self.watermark) or s > ahead]:
                del slices[start]
                gone.add(start)
        return gone

    def tables(self, dc: str, spec: WindowSpec, now: float) -> list[WindowedTable]:
        """The three tables of the window up to ``now`` (rates over the time it spans)."""
        slices = spec.slices(now)
        groups: dict[str, GoodputCounts] = {}
        fleet = FleetSlice()
        for at in slices:
            for key, counts in self.goodput.get(at, {}).items():
                groups.setdefault(key, GoodputCounts()).merge(counts)
            if at in self.fleet:
                fleet.merge(self.fleet[at])
        start = slices[0]
        self.version = version = max(int(now * 1000), self.version + 1)
        span = now - start
        classes, tenants, regions, models = rows(groups, span)
        kv = fleet.kv_totals(span)
        return [
            CapacityTable(
                dc=dc,
                version=version,
                window_start=start,
                window_end=now,
                rows=fleet.capacity_rows(span, now),
            ),
            KvTable(
                dc=dc,
                version=version,
                window_start=start,
                window_end=now,
                pressure=kv["pressure"],
                prefix_hit_rate=kv["prefix_hit_rate"],
                evictions_per_s=kv["evictions_per_s"],
                preemptions_per_s=kv["preemptions_per_s"],
                instances=fleet.kv_rows(span),
            ),
            GoodputTable(
                dc=dc,
                version=version,
                window_start=start,
                window_end=now,
                classes=classes,
                tenants=tenants,
                regions=regions,
                models=models,
            ),
        ]

    def _fleet(self, at: float) -> FleetSlice:
        return self.fleet.setdefault(at, FleetSlice())

    def slice_starts(self) -> set[float]:
        return set(self.goodput) | set(self.fleet) | set(self.counted)

    def slice_dict(self, at: float) -> dict[str, Any]:
        """One slice's counts as JSON-able data, for a host that stores slices one by one
        (the ids it counted apart: they grow with the events, the counts do not)."""
        fleet = self.fleet.get(at)
        return {
            "goodput": {k: c.to_dict() for k, c in self.goodput.get(at, {}).items()},
            "fleet": fleet.to_dict() if fleet else None,
        }

    def load_slice(self, at: float, data: dict[str, Any]) -> None:
        self.goodput[at] = {k: GoodputCounts.from_dict(c) for k, c in data["goodput"].items()}
        if data["fleet"] is not None:
            self.fleet[at] = FleetSlice.from_dict(data["fleet"])
        if "counted" in data:  # a slice stored with its ids, by workers before 2026-12-03
            self.load_counted(at, data["counted"])

    def load_counted(self, at: float, ids: list[str]) -> None:
        self.counted.setdefault(at, set()).update(ids)


class TableBuilder:
    """Every table of every DC from events fed in any order, duplicates included.

    Lifecycle events are joined per request (``streams.tables.outcomes``); telemetry and
    KV events are deduplicated by event id and attributed to the DC of their instance.
    """

    def __init__(
        self,
        spec: WindowSpec | None = None,
        objectives: Objectives | None = None,
        clock: Callable[[], float] | None = None,
    ) -> None:
        """``clock``: the time events cannot be later than (with the spec's grace), for a
        host on the wall clock (``DcTables.horizon``); None: any time."""
        self.spec = spec or WindowSpec()
        self.objectives = objectives or Objectives()
        self.clock = clock
        self.dcs: dict[str, DcTables] = {}
        self.requests: dict[str, RequestState] = {}
        self._instance_dc: dict[str, str] = {}
        self._seen: OrderedDict[str, None] = OrderedDict()

    def feed(self, envelope: Envelope) -> None:
        payload = envelope.payload
        if (request_id := outcomes.request_of(envelope)) is not None:
            state = self.requests.setdefault(request_id, outcomes.new_state())
            for outcome in outcomes.apply(state, envelope):
                self.add_outcome(outcome)
        elif isinstance(payload, InstanceTelemetry | KvBlocksRemoved) and self._first(envelope):
            if isinstance(payload, InstanceTelemetry):
                self._instance_dc[payload.instance_id] = payload.dc
                self._dc(payload.dc).add_telemetry(payload, envelope.ts, self.spec)
            elif (dc := self._instance_dc.get(payload.instance_id)) is not None:
                self._dc(dc).add_evictions(
                    envelope.event_id,
                    payload.instance_id,
                    len(payload.block_hashes),
                    envelope.ts,
                    self.spec,
                )

    def add_outcome(self, outcome: Outcome) -> None:
        objective = self.objectives.of(TaskClass(outcome.task_class), outcome.tenant)
        self._dc(outcome.dc).add_outcome(outcome, objective, self.spec)

    def tables(self, now: float) -> list[WindowedTable]:
        """Every DC's tables for the window up to ``now``. Old slices go, and so do
        requests quiet for longer than a window and its grace, or, while they may still
        run, ``outcomes.quiet_limit_s`` (ends they still hold count as late events at
        ``now``)."""
        settled = self.spec.size_s + self.spec.grace_s
        quiet = [
            key
            for key, state in self.requests.items()
            if state["last_ts"] < now - outcomes.quiet_limit_s(state, settled)
        ]
        for key in quiet:
            for outcome in outcomes.unmatched(self.requests.pop(key), now):
                self.add_outcome(outcome)
        published = []
        for dc, state in sorted(self.dcs.items()):
            state.expire(self.spec)
            published.extend(state.tables(dc, self.spec, now))
        return published

    def _dc(self, dc: str) -> DcTables:
        """``dc``'s state, its horizon brought to now."""
        state = self.dcs.setdefault(dc, DcTables())
        if self.clock is not None:
            state.horizon = self.clock() + self.spec.grace_s
        return state

    def _first(self, envelope: Envelope) -> bool:
        if envelope.event_id in self._seen:
            return False
        self._seen[envelope.event_id] = None
        if len(self._seen) > DEDUP_MEMORY:
            self._seen.popitem(last=False)
        return True

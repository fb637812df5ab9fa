"""What operators watch: per DC, goodput, compliance and capacity by class, and the
controls in force (weights, the long-document limit, the replicas placed), now and over
the last minutes.

Built from the same compacted topics the controllers read and write
(``tf.tables.goodput``, ``tf.tables.capacity``, ``tf.control.quotas``,
``tf.control.weights``, ``tf.control.placement``), so it shows what the loop acts on. The
controller's process serves it (``tokenfleet/operator_page.py``): a web page fed by
server-sent events, a JSON document, and Prometheus gauges.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from control.controllers.fleetmind import weights_of
from control.controllers.slomax import ceiling, long_documents
from schemas import Envelope
from schemas.base import TaskClass
from schemas.control import AdmissionQuotas, PlacementRecommendation, RoutingWeights
from schemas.tables import CapacityTable, GoodputRow, GoodputTable

log = logging.getLogger(__name__)

HISTORY_S = 900.0
"""How far back the page's charts reach: fifteen minutes of table slides."""
PUBLISHERS_WINDOW_S = 60.0
"""A table worker counts as publishing a DC's tables while one of its tables is this
recent: thirty of the default 2 s publish intervals."""
ONE_APP_ID = "run one app id (TOKENFLEET_WORKER_APP_ID)"
"""What to do when two table workers publish a DC's tables."""


def recent_publishers(last_published: Mapping[str, float], now: float) -> list[str]:
    """The table workers (app ids, with when each last published a DC's tables) that
    count as publishing them at ``now``."""
    horizon = now - PUBLISHERS_WINDOW_S
    return sorted(source for source, at in last_published.items() if at >= horizon)


@dataclass
class _Dc:
    """The latest of each table and control for one DC, and its points over time."""

    goodput: GoodputTable | None = None
    capacity: CapacityTable | None = None
    quotas: AdmissionQuotas | None = None
    weight: float | None = None
    placement: PlacementRecommendation | None = None
    history: deque[dict[str, float | None]] = field(default_factory=deque)
    publishers: dict[str, float] = field(default_factory=dict)
    """Each table worker (its app id, the tables' ``source``) and when it last published."""


class OperatorView:
    """Takes in tables and controls (``apply``, newer versions only) and says the state
    of every DC (``state``); ``clock``: wall-clock seconds, as the tables' times."""

    def __init__(self, clock: Callable[[], float] = time.time, history_s: float = HISTORY_S):
        self.clock = clock
        self.history_s = history_s
        self._dcs: dict[str, _Dc] = {}
        self._weights: dict[str, RoutingWeights] = {}
        """The newest weights snapshot of each edge (each has its own: they are judged on
        its region's requests)."""

    def apply_envelope(self, envelope: Envelope) -> None:
        """``apply``, noting which table worker sent a table: two workers with different
        app ids are two consumer groups, each counting every event, whose tables alternate
        on the same keys; that is a deployment error, logged once each time it starts."""
        table = envelope.payload
        if isinstance(table, GoodputTable | CapacityTable):
            dc = self._dc(table.dc)
            before = self._publishers(dc)
            dc.publishers[envelope.source] = max(dc.publishers.get(envelope.source, 0), envelope.ts)
            now = self._publishers(dc)
            if len(now) > 1 and len(before) <= 1:
                log.warning(
                    "the tables of %s come from %d table workers (%s): each counts every "
                    "event and their tables alternate; %s",
                    table.dc,
                    len(now),
                    ", ".join(now),
                    ONE_APP_ID,
                )
        self.apply(table)

    def apply(self, message: object) -> None:
        if isinstance(message, GoodputTable):
            dc = self._dc(message.dc)
            if message.supersedes(dc.goodput):
                dc.goodput = message
                self._record(dc, message)
        elif isinstance(message, CapacityTable):
            dc = self._dc(message.dc)
            if message.supersedes(dc.capacity):
                dc.capacity = message
        elif isinstance(message, AdmissionQuotas):
            dc = self._dc(message.scope)
            if dc.quotas is None or message.issued_at >= dc.quotas.issued_at:
                dc.quotas = message
        elif isinstance(message, PlacementRecommendation):
            dc = self._dc(message.scope)
            if dc.placement is None or message.issued_at >= dc.placement.issued_at:
                dc.placement = message  # the newest issued, as quotas and weights
        elif isinstance(message, RoutingWeights):
            held = self._weights.get(message.scope)
            if held is None or message.issued_at >= held.issued_at:
                self._weights[message.scope] = message
                self._lowest_weights()

    def _in_force(self) -> list[RoutingWeights]:
        """The edges' weights snapshots still within their TTL; with none, the newest (an
        edge of an older fleet file, or a controller gone, leaves snapshots on the
        compacted topic for good)."""
        now = self.clock()
        live = [w for w in self._weights.values() if w.issued_at + w.ttl_s >= now]
        newest = max(self._weights.values(), key=lambda w: w.issued_at, default=None)
        return live or ([] if newest is None else [newest])

    def _lowest_weights(self) -> None:
        """Each DC's weight for chats as the edge that counts on it least holds it: the
        figure that says whether any edge is moving traffic off it."""
        lowest: dict[str, float] = {}
        for snapshot in self._in_force():
            for name, weight in weights_of(snapshot, task_class=TaskClass.INTERACTIVE).items():
                lowest[name] = min(weight, lowest.get(name, weight))
        for name, dc in self._dcs.items():
            dc.weight = lowest.pop(name, None)
        for name, weight in lowest.items():
            self._dc(name).weight = weight

    def state(self) -> dict[str, Any]:
        """Every DC's figures now and its points over time, ready for JSON."""
        now = self.clock()
        self._lowest_weights()  # a snapshot may have expired since the last one came
        dcs = sorted(self._dcs.items())
        return {"at": now, "dcs": [self._dc_state(name, dc, now) for name, dc in dcs]}

    def _dc(self, name: str) -> _Dc:
        return self._dcs.setdefault(name, _Dc())

    def _publishers(self, dc: _Dc) -> list[str]:
        """The table workers that published the DC's tables lately."""
        return recent_publishers(dc.publishers, self.clock())

    def _record(self, dc: _Dc, table: GoodputTable) -> None:
        dc.history.append(
            {
                "at": table.window_end,
                "goodput_tokens_per_s": sum(r.goodput_tokens_per_s for r in table.classes),
                "interactive_compliance": _compliance(table, "interactive"),
                "weight": dc.weight,
                "long_documents": None if dc.quotas is None else long_documents(dc.quotas),
            }
        )
        horizon = table.window_end - self.history_s
        while (dc.history[0]["at"] or 0.0) < horizon:
            dc.history.popleft()

    def _soonest_weights(self) -> RoutingWeights | None:
        """The weights snapshot in force that expires first."""
        return min(self._in_force(), key=lambda w: w.issued_at + w.ttl_s, default=None)

    def _dc_state(self, name: str, dc: _Dc, now: float) -> dict[str, Any]:
        return {
            "dc": name,
            "tables_age_s": _age(now, dc.goodput, dc.capacity),
            "classes": [_class_row(row) for row in _active(dc.goodput)],
            "capacity": _capacity(dc.capacity),
            "weight": dc.weight,
            "long_documents": None if dc.quotas is None else long_documents(dc.quotas),
            "batch": None if dc.quotas is None else ceiling(dc.quotas, TaskClass.BATCH),
            "replicas": _replicas(dc.placement),
            "controls_left_s": _controls_left(now, dc.quotas, self._soonest_weights()),
            "history": list(dc.history),
            "table_publishers": self._publishers(dc),
        }


def _replicas(placement: PlacementRecommendation | None) -> dict[str, int] | None:
    """The replicas of each model FleetMind's long cycle runs in the DC (None: it
    places none there)."""
    if placement is None:
        return None
    return {a.model: a.target_replicas for a in placement.actions}


def _compliance(table: GoodputTable, task_class: str) -> float | None:
    row = next((r for r in table.classes if r.key == task_class), None)
    return None if row is None or not row.completed else row.compliance


def _active(table: GoodputTable | None) -> list[GoodputRow]:
    """The classes that had any request end in the window."""
    if table is None:
        return []
    return [r for r in table.classes if r.completed + r.failures + r.cancellations + r.timeouts]


def _class_row(row: GoodputRow) -> dict[str, Any]:
    return {
        "task_class": row.key,
        "completed": row.completed,
        "goodput_tokens_per_s": row.goodput_tokens_per_s,
        "output_tokens_per_s": row.output_tokens_per_s,
        "compliance": row.compliance if row.completed else None,  # nothing completed: none
        "ttft_p95_s": row.ttft_p95_s,
        "failures": row.failures + row.timeouts,
        "cancellations": row.cancellations,
    }


def _capacity(table: CapacityTable | None) -> dict[str, Any] | None:
    if table is None:
        return None
    blocks = sum(r.kv_blocks_total for r in table.rows)
    return {
        "ready": sum(r.ready_endpoints for r in table.rows),
        "running": sum(r.running for r in table.rows),
        "queued": sum(r.queued for r in table.rows),
        "kv_used": 1 - sum(r.kv_blocks_free for r in table.rows) / blocks if blocks else None,
        "headroom": min((r.headroom for r in table.rows), default=None),
    }


def _age(now: float, *tables: GoodputTable | CapacityTable | None) -> float | None:
    ends = [t.window_end for t in tables if t is not None]
    return now - min(ends) if ends else None


def _controls_left(
    now: float, quotas: AdmissionQuotas | None, weights: RoutingWeights | None
) -> dict[str, float | None]:
    return {
        kind: None if snapshot is None else snapshot.issued_at + snapshot.ttl_s - now
        for kind, snapshot in (("quotas", quotas), ("weights", weights))
    }

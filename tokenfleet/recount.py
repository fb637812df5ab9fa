"""Recount the goodput tables from the raw events and compare them with what the table
worker published: ``tokenfleet recount``.

An auditor's check that the tables the controllers act on are what the recorded events
say. The raw lifecycle topics are read from their start, fed in event-time order to the
same pure logic the worker runs (``streams.tables.TableBuilder``, with the fleet's
objectives and the worker's window), and each DC's latest published goodput table is
compared, row by row (class, tenant, region and model), with the recount of the same
window.

Exact while the worker is caught up: events that reached the broker after the worker
published its latest table (traffic still running) show as differences in that window.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from schemas import Envelope
from schemas.objectives import Objectives
from schemas.tables import GoodputRow, GoodputTable
from streams.bus import EventBus
from streams.tables.builder import TableBuilder
from streams.tables.windows import WindowSpec

RAW_TOPICS = ("tf.requests", "tf.completions", "tf.cancellations")
"""What the goodput tables are made of: every lifecycle event."""
GOODPUT_TOPIC = "tf.tables.goodput"


@dataclass(frozen=True)
class Difference:
    """One figure of one row that the published table and the recount disagree on."""

    dc: str
    row: str
    """``class:<name>``, ``tenant:<id>``, ``region:<region>/<class>`` or ``model:<name>``."""
    figure: str
    published: object
    recounted: object


@dataclass(frozen=True)
class Recount:
    tables: dict[str, tuple[GoodputTable, GoodputTable]]
    """Per DC: its latest published table and the recount of the same window."""
    differences: list[Difference]
    events: int
    undecodable: int


async def recount_on(
    bus: EventBus, spec: WindowSpec, objectives: Objectives, dcs: Iterable[str] = ()
) -> Recount:
    """Read the raw topics and the published tables from ``bus`` and recount (``dcs``:
    only these; none named: every DC with a published table)."""
    events: list[Envelope] = []
    undecodable = 0
    for topic in RAW_TOPICS:
        read, skipped = await bus.read_all(topic)
        events += read
        undecodable += skipped
    published = {
        dc: envelope.payload
        for dc, envelope in (await bus.read_latest(GOODPUT_TOPIC, auditing=True)).items()
        if isinstance(envelope.payload, GoodputTable) and (not dcs or dc in set(dcs))
    }
    return recount(events, published, spec, objectives, undecodable)


def recount(
    events: Iterable[Envelope],
    published: Mapping[str, GoodputTable],
    spec: WindowSpec,
    objectives: Objectives,
    undecodable: int = 0,
) -> Recount:
    """Recount ``events`` for the window of each table in ``published``."""
    builder = TableBuilder(spec, objectives)
    ordered = sorted(events, key=lambda e: e.ts)
    for event in ordered:
        builder.feed(event)
    tables: dict[str, tuple[GoodputTable, GoodputTable]] = {}
    for dc, table in sorted(published.items(), key=lambda item: item[1].window_end):
        recounted = _goodput_of(builder, dc, table.window_end) or _empty(table)
        tables[dc] = (table, recounted)
    differences = [d for dc, pair in sorted(tables.items()) for d in _compare(dc, *pair)]
    return Recount(tables, differences, len(ordered), undecodable)


def _goodput_of(builder: TableBuilder, dc: str, at: float) -> GoodputTable | None:
    """The recount's goodput table of ``dc`` for the window ending ``at`` (the windows
    are recounted oldest first: a recount expires the slices older windows need)."""
    return next((t for t in builder.tables(at) if isinstance(t, GoodputTable) and t.dc == dc), None)


def _empty(table: GoodputTable) -> GoodputTable:
    """The recount of a DC none of whose events were found: nothing ended there."""
    return table.model_copy(update={"classes": (), "tenants": (), "regions": (), "models": ()})


def _compare(dc: str, published: GoodputTable, recounted: GoodputTable) -> list[Difference]:
    mine = _rows(published)
    theirs = _rows(recounted, kinds={name.partition(":")[0] for name in mine})
    differences = []
    for name in sorted(mine.keys() | theirs.keys()):
        left, right = mine.get(name, {}), theirs.get(name, {})
        for figure in sorted(left.keys() | right.keys()):
            if left.get(figure) != right.get(figure):
                differences.append(
                    Difference(dc, name, figure, left.get(figure), right.get(figure))
                )
    return differences


def _rows(table: GoodputTable, kinds: set[str] | None = None) -> dict[str, dict[str, object]]:
    """Each row's figures by name, rows with nothing ended left out (a table lists every
    class, a recount only those it saw); ``kinds``: only rows of these (a table of a
    worker before the region and model rows has none of them to compare)."""
    return {
        f"{kind}:{row.key}": row.model_dump(exclude={"key"})
        for kind, rows in (
            ("class", table.classes),
            ("tenant", table.tenants),
            ("region", table.regions),
            ("model", table.models),
        )
        if kinds is None or kind in kinds
        for row in rows
        if _ended(row)
    }


def _ended(row: GoodputRow) -> int:
    return row.completed + row.failures + row.cancellations + row.timeouts + row.late_events

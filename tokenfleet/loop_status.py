"""Whether the control loop is closed: ``tokenfleet status``.

The loop is closed when, for every DC, the stream processors' tables are fresh (the
worker runs and reads the events, and its capacity table holds recent telemetry: the
collector runs), made by one table worker, and the controllers' snapshots are in force
(published and within their TTL, so the gateways apply them rather than their safe
defaults). Read from the compacted topics, the latest value per key, as any reader of
them would.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import cast

from schemas import Envelope
from schemas.control import ControlSnapshot
from schemas.deadletter import DeadLetter
from schemas.tables import CapacityTable, WindowedTable
from schemas.topics import DEADLETTER_TOPIC, topic_for
from streams.kafka import KafkaBus
from tokenfleet.operator_view import ONE_APP_ID, recent_publishers

TABLE_TOPICS = ("tf.tables.goodput", "tf.tables.capacity")
CONTROL_TOPICS = ("tf.control.quotas", "tf.control.weights")
STALE_AFTER_S = 30.0
"""Tables older than this move no controller (``tokenfleet/controller_host.py``)."""


@dataclass(frozen=True)
class OnTheBroker:
    """What ``tokenfleet status`` reads: the latest value of each key of the tables' and
    controls' topics (a topic never published is left out), and per DC, each table
    worker (the tables' ``source``: the worker's app id) that published its tables, and
    when it last did."""

    latest: dict[str, dict[str, Envelope]]
    published: dict[str, dict[str, float]]
    dead_letters: list[Envelope] = field(default_factory=list)
    """The letters on ``tf.deadletter`` (kept 14 days)."""


async def read_broker(bootstrap: str) -> OnTheBroker:
    """One read of each topic (the tables', the controls' and the dead letters'), on one
    connection, that writes nothing: a record that does not decode is skipped (a reader
    of the loop's state leaves dead-lettering to the loop's own consumers, or each
    status would dead-letter it again)."""
    bus = KafkaBus(bootstrap, source="status")
    found = OnTheBroker({}, {})
    try:
        for topic in (*TABLE_TOPICS, *CONTROL_TOPICS):
            try:
                envelopes, _ = await bus.read_all(topic)
            except LookupError:
                continue
            found.latest[topic] = {_key(envelope): envelope for envelope in envelopes}
            for envelope in envelopes:
                if isinstance(table := envelope.payload, WindowedTable):
                    sources = found.published.setdefault(table.dc, {})
                    sources[envelope.source] = max(sources.get(envelope.source, 0.0), envelope.ts)
        await _read_dead_letters(bus, found)
    finally:
        await bus.close()
    return found


async def _read_dead_letters(bus: KafkaBus, found: OnTheBroker) -> None:
    try:
        envelopes, _ = await bus.read_all(DEADLETTER_TOPIC)
    except LookupError:
        return
    found.dead_letters.extend(e for e in envelopes if isinstance(e.payload, DeadLetter))


def dead_letter_note(found: OnTheBroker, now: float) -> str | None:
    """What ``tf.deadletter`` holds, for the operator to read (it opens no loop: each
    letter is a record its consumer skipped and went on past); None where it is empty."""
    if not found.dead_letters:
        return None
    # each consumer of a record dead-letters it under the record's event id (gateway
    # replicas reading one control, for one): a letter per record
    unique = {e.event_id: e for e in found.dead_letters}.values()
    letters = [cast(DeadLetter, e.payload) for e in unique]
    by_topic = Counter(letter.source_topic for letter in letters)
    topics = ", ".join(f"{topic} {n}" for topic, n in by_topic.most_common())
    latest = max(found.dead_letters, key=lambda e: e.ts)
    last = cast(DeadLetter, latest.payload)
    return (
        f"dead letters on {DEADLETTER_TOPIC}: {len(letters)} ({topics}); the latest "
        f"{now - latest.ts:.0f} s ago, from {last.source_topic}[{last.partition}]@"
        f"{last.offset}: {last.reason}"
    )


def _key(envelope: Envelope) -> str:
    """The key its topic gives the envelope's payload: its records in log order, the last
    one of a key is its latest value."""
    return topic_for(type(envelope.payload)).key_of(envelope.payload)


@dataclass(frozen=True)
class Check:
    what: str
    key: str
    ok: bool
    detail: str


def loop_checks(
    latest: Mapping[str, Mapping[str, Envelope]],
    now: float,
    stale_after_s: float = STALE_AFTER_S,
    only: Collection[str] | None = None,
) -> list[Check]:
    """One check per table per DC and per control snapshot per scope, from the latest
    value of each topic's keys (``latest[topic][key]``); ``only``: these DCs and scopes."""
    checks = []
    for topic in TABLE_TOPICS:
        for dc, envelope in sorted(latest.get(topic, {}).items()):
            if only is not None and dc not in only:
                continue
            table = envelope.payload
            if not isinstance(table, WindowedTable):
                continue
            age = now - table.window_end
            detail = f"{age:.1f} s old"
            fresh = age <= stale_after_s
            if isinstance(table, CapacityTable) and table.rows:
                telemetry = min(row.telemetry_age_s for row in table.rows)
                detail += f", telemetry {telemetry:.1f} s old"
                fresh = fresh and telemetry <= stale_after_s
            checks.append(Check(topic, dc, fresh, detail))
    for topic in CONTROL_TOPICS:
        for scope, envelope in sorted(latest.get(topic, {}).items()):
            if only is not None and scope not in only:
                continue
            control = envelope.payload
            if not isinstance(control, ControlSnapshot):
                continue
            left = control.issued_at + control.ttl_s - now
            detail = f"version {control.version}, " + (
                f"{left:.0f} s of TTL left" if left >= 0 else f"expired {-left:.0f} s ago"
            )
            checks.append(Check(topic, scope, left >= 0, detail))
    return checks


def publisher_checks(
    published: Mapping[str, Mapping[str, float]],
    now: float,
    only: Collection[str] | None = None,
) -> list[Check]:
    """One check per DC: its tables come from one table worker, as the operators' view
    counts them (``published``: per DC, each worker and when it last published). Two app
    ids are two consumer groups, each counting every event, whose tables alternate on the
    same keys."""
    checks = []
    for dc, sources in sorted(published.items()):
        recent = recent_publishers(sources, now)
        if recent and (only is None or dc in only):
            advice = "" if len(recent) == 1 else f": {ONE_APP_ID}"
            checks.append(Check("table workers", dc, len(recent) == 1, ", ".join(recent) + advice))
    return checks


def process_checks(
    pids: Mapping[str, int | None], silent: Mapping[str, str] | None = None
) -> list[Check]:
    """One check per part of a local deployment (``tokenfleet up``): whether it runs, and
    answers (``silent``: each running part that does not, with the URL it was asked at; a
    frozen process still runs, and its tables or controls may never go stale)."""
    silent = silent or {}
    return [
        Check(
            "process",
            name,
            pid is not None and name not in silent,
            _process_detail(pid, silent.get(name)),
        )
        for name, pid in pids.items()
    ]


def _process_detail(pid: int | None, silent_at: str | None) -> str:
    if pid is None:
        return "not running"
    return f"pid {pid}" if silent_at is None else f"pid {pid}, not answering at {silent_at}"


def verdict(checks: list[Check]) -> tuple[bool, str]:
    """Whether the loop is closed, and why not."""
    tables = {c.what for c in checks if c.what in TABLE_TOPICS}
    missing = [topic for topic in TABLE_TOPICS if topic not in tables]
    failing = [f"{c.what}[{c.key}] {c.detail}" for c in checks if not c.ok]
    if missing:
        return False, "no " + ", ".join(missing) + " yet (is tokenfleet worker running?)"
    if failing:
        return False, "; ".join(failing)
    if not any(c.what in CONTROL_TOPICS for c in checks):
        return False, "no controls published (is tokenfleet controller running?)"
    return True, "tables fresh and controls in force"

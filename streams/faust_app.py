"""The table logic hosted by Faust on Kafka: `tokenfleet worker`.

Three agents, each keyed so that its table is co-partitioned with its input:

1. **join** reads ``tf.requests``, ``tf.completions`` and ``tf.cancellations`` (6
   partitions each, keyed by request id) in batches into the ``join`` table (request id
   -> join state, written once per request per batch) and sends the outcomes a batch
   released to ``APP_ID-dc-updates``, one record per DC;
2. **fleet** reads ``tf.telemetry`` and ``tf.kv-events`` (3 partitions, keyed by
   instance id), remembers each instance's DC in ``instance-dc``, and sends telemetry and
   evictions to ``APP_ID-dc-updates`` keyed by DC (the re-keying ``group_by`` would do);
3. **aggregate** reads ``APP_ID-dc-updates`` in batches into ``dc-slices`` (one key per DC and
   slice), and a timer publishes each DC's tables to the compacted ``tf.tables.*``.

At-least-once: offsets are committed only once what their events wrote (changelog writes
and outcomes) reached the broker, so a restarted worker recovers its tables from their
changelogs and reads again from its last committed offsets. Events it sees again change
no state (the join keeps a request's event ids, the DC state the ids of what it counted),
but each one sends its request's released outcomes again: a join state can reach its
changelog without the outcomes it released, if the worker dies between the two writes.
So totals come out as if it had never stopped. A request's join state is forgotten once
no event has touched it for a window and its grace; ends it still holds (its start never
came) then count as late events. Every mutated value is written back to its table: Faust
persists only assignments.
"""

from __future__ import annotations

import gc
import logging
import time
from collections import Counter, defaultdict
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import faust
import mode.loop
from faust.types import TP

from schemas import DEADLETTER_TOPIC, DecodeError, Envelope, Topic, decode, encode, topic_for
from schemas.base import TaskClass
from schemas.objectives import Objectives
from schemas.telemetry import InstanceTelemetry, KvBlocksRemoved
from schemas.topics import DAY_MS
from streams.bus import MAX_RECORD_BYTES, RawRecord, dead_letter
from streams.faust_parts import (
    RUST_JSON,
    KeyedTable,
    SinglePartitionTable,
    SourcePartitionTable,
    TaskListingWorker,
    WorkerApp,
)
from streams.settings import WorkerSettings
from streams.tables import outcomes
from streams.tables.builder import DcTables
from streams.tables.outcomes import Outcome
from streams.tables.windows import WindowSpec

log = logging.getLogger(__name__)

LIFECYCLE_TOPICS = ("tf.requests", "tf.completions", "tf.cancellations")
FLEET_TOPICS = ("tf.telemetry", "tf.kv-events")
GC_THRESHOLDS = (10_000, 20, 100)
"""The garbage collector's generation thresholds in a worker (Python's are 700, 10, 10).
Each event allocates a few hundred short-lived objects beside tables of long-lived ones,
so the default collects every few events and scans the tables often: the worker took 19.3
and 19.9 s of CPU for 90,000 events with the defaults, 14.5 s with these (4,230 against
5,810 events/s; the streams bench's steps, a fresh broker per run, 2-core machine)."""
JOIN_WITHIN_S = 0.05
"""Longest a lifecycle event waits for its batch to fill: a small share of the tables'
publish interval."""
IDS_PER_RECORD = 10_000
"""Counted ids per table record: about 350 KB of 32-character ids, under Kafka's 1 MB."""
PROGRESS_EVERY_S = 10.0
"""How often the worker logs, at INFO, what its agents processed since it started."""
OUTCOMES_PER_UPDATE = 500
"""Outcomes per record on the updates topic: about 250 KB, under Kafka's 1 MB default."""


def updates_topic_of(settings: WorkerSettings) -> Topic:
    """The re-keyed stream, the app's own (two app ids never share it). Create it before
    the worker starts: a topic that appears after the consumer group formed is only
    assigned at the next metadata refresh, minutes later."""
    return Topic(f"{settings.app_id}-dc-updates", "dc", 1, False, DAY_MS, ())


def build_app(
    bootstrap: str,
    settings: WorkerSettings,
    objectives: Objectives | None = None,
    replication: int = 1,
) -> WorkerApp:
    """The worker's app; ``objectives`` (None: the defaults) decide which completions
    count as goodput; ``replication``: the brokers that keep its changelogs."""
    objectives = objectives or Objectives()
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    app = WorkerApp(
        settings.app_id,
        broker=f"kafka://{bootstrap}",
        store="memory://",
        datadir=str(settings.data_dir / settings.app_id),
        web_enabled=False,
        topic_replication_factor=replication,
        consumer_auto_offset_reset="earliest",
        key_serializer="raw",
        value_serializer="raw",
        # Changelog writes and outcomes are many small records: let the producer batch
        # them for 5 ms instead of sending each on its own.
        producer_linger=0.005,
        table_standby_replicas=settings.standby_replicas,
        broker_session_timeout=settings.session_timeout_s,
        # Kafka's rule: at most a third of the session; Faust's 3 s, where the session
        # allows, so that a worker learns of a rebalance within 3 s.
        broker_heartbeat_interval=min(3.0, settings.session_timeout_s / 3),
    )
    spec = settings.spec
    raw = {"key_serializer": "raw", "value_serializer": "raw"}
    lifecycle = app.topic(*LIFECYCLE_TOPICS, **raw)
    fleet_events = app.topic(*FLEET_TOPICS, **raw)
    updates_topic = updates_topic_of(settings).name
    updates = app.topic(updates_topic, partitions=1, internal=True, value_serializer=RUST_JSON)
    dead_letters = app.topic(DEADLETTER_TOPIC, **raw)
    as_json = faust.Schema(key_serializer=RUST_JSON, value_serializer=RUST_JSON)
    joins = KeyedTable(app, name="join", beacon=app.tables.beacon, partitions=6, schema=as_json)
    app.tables.add(joins)
    instance_dc = app.tables.add(
        SourcePartitionTable(
            app, name="instance-dc", beacon=app.tables.beacon, partitions=3, schema=as_json
        )
    )
    dc_slices = app.tables.add(
        SinglePartitionTable(
            app, name="dc-slices", beacon=app.tables.beacon, partitions=1, schema=as_json
        )
    )

    decoded = _decoder(app, dead_letters, settings.app_id)

    quiet = _QuietRequests(joins, spec.size_s + spec.grace_s)
    processed = app.processed
    logged: Counter[str] = Counter()
    # Each series at 0 from the start, so that a first dead letter shows as an increase.
    for topic in (*LIFECYCLE_TOPICS, *FLEET_TOPICS):
        app.dead_lettered[topic] = app.dead_letters_unsent[topic] = 0
    processed.update(dict.fromkeys(("lifecycle", "fleet", "updates"), 0))

    @app.timer(interval=PROGRESS_EVERY_S)
    async def log_progress() -> None:
        if processed != logged:
            log.info(
                "processed since start: %s",
                ", ".join(f"{n} {kind} events" for kind, n in processed.items()),
            )
            logged.clear()
            logged.update(processed)

    @app.agent(lifecycle)
    async def join(stream: faust.StreamT) -> None:
        async for events in stream.take_events(settings.batch, within=JOIN_WITHIN_S):
            processed["lifecycle"] += len(events)
            released: list[Outcome] = []
            for key, (partition, envelopes) in (await _by_request(events, decoded)).items():
                state = joins.get(key) or outcomes.new_state()
                for envelope in envelopes:
                    released += outcomes.apply(state, envelope)
                joins.put(key, quiet.touched(state, partition), partition)
            for partition in {event.message.partition for event in events}:
                released += quiet.forget(partition)
            for dc, update in _outcome_updates(released):
                await updates.send(key=dc.encode(), value=update)

    @app.agent(fleet_events)
    async def fleet(stream: faust.StreamT) -> None:
        async for event in stream.events():
            processed["fleet"] += 1
            envelope = await decoded(event)
            update = None if envelope is None else _fleet_update(envelope, instance_dc)
            if update is not None:
                await updates.send(key=update["dc"].encode(), value=update)

    live = _LiveStates(dc_slices)

    @app.agent(updates)
    async def aggregate(stream: faust.StreamT) -> None:
        async for batch in stream.take(settings.batch, within=0.25):
            processed["updates"] += len(batch)
            by_dc: dict[str, list[dict[str, Any]]] = defaultdict(list)
            for update in batch:
                by_dc[update["dc"]].append(update)
            for dc, items in by_dc.items():
                live.apply(dc, items, spec, objectives)

    owner_of_updates = TP(updates_topic, 0)

    @app.timer(interval=settings.publish_s)
    async def publish() -> None:
        # Only the worker now assigned the DC state publishes it, once it is recovered:
        # after a rebalance the other one still holds a copy that no longer changes, and
        # a table half read from its changelog holds an older state than the last one
        # published (the totals would go back).
        if app.in_recovery or owner_of_updates not in app.consumer.assignment():
            return
        now = time.time()
        for dc in live.dcs():
            for table in live.of(dc).tables(dc, spec, now):
                value = encode(Envelope.wrap(table, source=settings.app_id))
                if len(value) > MAX_RECORD_BYTES:  # the producer would fail, and the worker
                    log.error(
                        "%s of %s: %d bytes, not published", type(table).__name__, dc, len(value)
                    )
                    continue
                topic = topic_for(type(table)).name
                await app.topic(topic, **raw).send(key=dc.encode(), value=value)
                app.published[topic] += 1

    return app


def _decoder(
    app: WorkerApp, dead_letters: faust.TopicT, source: str
) -> Callable[[faust.EventT], Awaitable[Envelope | None]]:
    """An event's envelope; one that does not decode is sent to the dead-letter topic
    (as ``source``'s), counted and logged, and answers None, as a tombstone does (a
    record without a value: decoding it raised TypeError, which escaped the batch's
    agent and lost the batch). A letter the producer fails to send is logged and counted
    (``dead_letters_unsent``), and the record skipped all the same."""

    async def decoded(event: faust.EventT) -> Envelope | None:
        if event.value is None:  # a tombstone: no event, as the buses skip it
            return None
        try:
            return _on_its_topic(decode(event.value), event.message.topic)
        except DecodeError as exc:
            message = event.message
            key = message.key.decode(errors="replace") if message.key else None
            record = RawRecord(message.topic, message.partition, message.offset, key, message.value)
            letter = encode(dead_letter(record, str(exc), source))
            try:
                await dead_letters.send(key=message.topic.encode(), value=letter)
            except Exception:  # raised through the agent, it took its batch down unread
                where = (message.topic, message.partition, message.offset)
                log.exception("the dead letter of %s[%d]@%d", *where)
                app.dead_letters_unsent[message.topic] += 1
                return None
            app.dead_lettered[message.topic] += 1
            log.warning(
                "dead-lettered %s[%d]@%d (%d from that topic so far): %s",
                message.topic,
                message.partition,
                message.offset,
                app.dead_lettered[message.topic],
                exc,
            )
            return None

    return decoded


def _on_its_topic(envelope: Envelope, topic: str) -> Envelope:
    """``envelope``, read from ``topic``; DecodeError where the catalog puts its message on
    another topic: each agent passes over events not of its kinds, so a well-formed event
    published on the wrong topic vanished, neither counted nor dead-lettered."""
    own = topic_for(type(envelope.payload)).name
    if own != topic:
        raise DecodeError(f"a {envelope.schema_ref} event travels on {own}, not {topic}")
    return envelope


def _fleet_update(envelope: Envelope, instance_dc: faust.types.TableT) -> dict[str, Any] | None:
    """What a fleet event tells its DC's state: a telemetry reading (whose DC the
    instance's later evictions are sent to), or evictions of an instance whose DC is
    known; None for anything else."""
    payload = envelope.payload
    if isinstance(payload, InstanceTelemetry):
        instance_dc[payload.instance_id] = payload.dc
        reading = payload.model_dump(mode="json")
        return {"kind": "telemetry", "dc": payload.dc, "ts": envelope.ts, "reading": reading}
    if isinstance(payload, KvBlocksRemoved):
        dc = instance_dc.get(payload.instance_id)
        if dc is not None:
            return {
                "kind": "evictions",
                "dc": dc,
                "event_id": envelope.event_id,
                "instance": payload.instance_id,
                "blocks": len(payload.block_hashes),
                "ts": envelope.ts,
            }
    return None


def run_worker(
    make_app: Callable[[], faust.App], loglevel: str = "WARNING", **options: Any
) -> None:
    """Run the app ``make_app`` builds in a Faust worker until it stops: on uvloop (it
    comes with uvicorn[standard]; chosen before the app exists), logging at ``loglevel``, and
    without Faust's start-up spinner, which lowers the root logger to DEBUG to spin on
    every record, so each debug call of Faust and aiokafka builds a record (a sixth of
    the CPU); and with ``GC_THRESHOLDS``. ``kill -USR1`` logs what each task waits on.
    ``options`` go to the worker."""
    mode.loop.use("uvloop")
    gc.set_threshold(*GC_THRESHOLDS)
    worker = TaskListingWorker(make_app(), loglevel=loglevel, quiet=True, **options)
    worker.spinner = None
    worker.execute_from_commandline()


class _QuietRequests:
    """Forgets the join state of requests no event has touched for ``after_s`` seconds,
    or, while they may still run, ``outcomes.quiet_limit_s``.

    A key's deletion goes to its own changelog partition, which each state records;
    a batch with events of partition P sweeps P's quiet states, at most every
    ``after_s / 2``. Quiet is measured in processing time, not event time,
    so a worker replaying old events does not forget a request between its own events.
    """

    def __init__(self, table: KeyedTable, after_s: float) -> None:
        self.table = table
        self.after_s = after_s
        self._next_sweep: dict[int, float] = {}

    def touched(self, state: outcomes.RequestState, partition: int) -> outcomes.RequestState:
        return state | {"partition": partition, "touched": time.time()}

    def forget(self, partition: int) -> list[Outcome]:
        """Delete ``partition``'s quiet states; returns the ends they held, as late events."""
        now = time.time()
        if now < self._next_sweep.get(partition, 0.0):
            return []
        self._next_sweep[partition] = now + self.after_s / 2
        given_up = []
        for key in [
            key
            for key, state in self.table.items()
            if state.get("partition") == partition
            and state.get("touched", now) < now - outcomes.quiet_limit_s(state, self.after_s)
        ]:
            given_up += outcomes.unmatched(self.table.remove(key, partition), now)
        return given_up


class _LiveStates:
    """Each DC's state as objects, over a table that keeps it as JSON: one record per slice
    (``dc|slice start``: its counts, and how many id records it has), the ids counted in the
    slice (so that a replay counts nothing twice) in records of their own
    (``dc|slice start|ids|n``, up to ``IDS_PER_RECORD`` each), and ``dc|meta``. A write
    costs the slices it changed and the ids it added. (A slice record that held all its ids
    passed Kafka's 1 MB record limit at 30,000 outcomes in one 5 s slice, and crashed the
    worker.)

    A write puts a slice's new id records first and its slice record after, with their new
    count: a worker that dies between the two left id records that no slice record counts,
    which are ignored and later overwritten, and counts that never ran ahead of their ids.

    A cached state is used while the table still holds the very ``meta`` value it was
    built with; after a recovery or a rebalance it holds another, and the state is rebuilt
    from the table. ``meta`` lists the DC's slices: a state built while the table is still
    recovering (a listed slice or a counted id record missing) is used once, not cached.
    """

    def __init__(self, table: faust.types.TableT) -> None:
        self.table = table
        self._states: dict[str, tuple[DcTables, object]] = {}

    def dcs(self) -> list[str]:
        return [key.removesuffix("|meta") for key in list(self.table) if key.endswith("|meta")]

    def of(self, dc: str) -> DcTables:
        meta = self.table.get(f"{dc}|meta")
        cached = self._states.get(dc)
        if cached is not None and cached[1] is meta:
            return cached[0]
        state = DcTables(watermark=meta["watermark"] if meta else float("-inf"))
        id_records: dict[float, int] = {}
        ids: dict[tuple[float, int], list[str]] = {}
        prefix = f"{dc}|"
        for key, value in list(self.table.items()):
            if not key.startswith(prefix) or key == f"{dc}|meta":
                continue
            at, _, n = key.removeprefix(prefix).partition("|ids|")
            if n:
                ids[float(at), int(n)] = value
            else:
                state.load_slice(float(at), value)
                id_records[float(at)] = value.get("ids", 0)
        complete = meta is None or set(meta["slices"]) <= set(id_records)
        for at, count in id_records.items():
            for n in range(count):
                if (at, n) in ids:
                    state.load_counted(at, ids[at, n])
                else:
                    complete = False
        if complete:
            self._states[dc] = (state, meta)
        return state

    def apply(
        self, dc: str, items: list[dict[str, Any]], spec: WindowSpec, objectives: Objectives
    ) -> None:
        """Apply a batch's updates of ``dc`` to its state and store what they changed."""
        state = self.of(dc)
        state.horizon = time.time() + spec.grace_s
        changed: set[float] = set()
        counted: dict[float, list[str]] = defaultdict(list)
        for item in items:
            changed |= _apply(state, item, spec, objectives, counted)
        self.store(dc, state, changed, state.expire(spec), counted)

    def store(
        self,
        dc: str,
        state: DcTables,
        changed: set[float],
        gone: set[float],
        counted: dict[float, list[str]],
    ) -> None:
        """Write the slices ``changed`` with the ids newly ``counted`` in them, and drop
        the slices ``gone`` with every id record under them."""
        if gone:
            under = tuple(f"{dc}|{at}|" for at in gone)
            for key in [key for key in list(self.table) if key.startswith(under)]:
                self.table.pop(key, None)
            for at in gone:
                self.table.pop(f"{dc}|{at}", None)
        for at in changed - gone:
            known = self.table.get(f"{dc}|{at}")
            records = known.get("ids", 0) if known else 0
            new = counted.get(at, [])
            for first in range(0, len(new), IDS_PER_RECORD):
                self.table[f"{dc}|{at}|ids|{records}"] = new[first : first + IDS_PER_RECORD]
                records += 1
            self.table[f"{dc}|{at}"] = state.slice_dict(at) | {"ids": records}
        meta = {"watermark": state.watermark, "slices": sorted(state.slice_starts())}
        self.table[f"{dc}|meta"] = meta
        self._states[dc] = (state, meta)


async def _by_request(
    events: list[faust.EventT], decoded: Callable[[faust.EventT], Awaitable[Envelope | None]]
) -> dict[str, tuple[int, list[Envelope]]]:
    """A batch's lifecycle events by request, in arrival order, with their partition (one
    per request: events are keyed by request id); undecodable ones are dead-lettered."""
    by_request: dict[str, tuple[int, list[Envelope]]] = {}
    for event in events:
        envelope = await decoded(event)
        key = None if envelope is None else outcomes.request_of(envelope)
        if envelope is not None and key is not None:
            by_request.setdefault(key, (event.message.partition, []))[1].append(envelope)
    return by_request


def _outcome_updates(released: list[Outcome]) -> Iterator[tuple[str, dict[str, Any]]]:
    """The outcomes of a batch as updates, one per DC and up to ``OUTCOMES_PER_UPDATE``."""
    by_dc: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for outcome in released:
        by_dc[outcome.dc].append(outcome.to_dict())
    for dc, items in by_dc.items():
        for at in range(0, len(items), OUTCOMES_PER_UPDATE):
            chunk = items[at : at + OUTCOMES_PER_UPDATE]
            yield dc, {"kind": "outcomes", "dc": dc, "outcomes": chunk}


def _apply(
    state: DcTables,
    item: dict[str, Any],
    spec: WindowSpec,
    objectives: Objectives,
    counted: dict[float, list[str]],
) -> set[float]:
    """Apply one update; returns the slices it changed, and adds to ``counted`` the ids
    it counted for the first time, by the slice that remembers them."""
    if item["kind"] in ("outcomes", "outcome"):  # one each, from workers before 2026-12-03
        changed: set[float] = set()
        for fields in item.get("outcomes") or [item["outcome"]]:
            outcome = Outcome.from_dict(fields)
            objective = objectives.of(TaskClass(outcome.task_class), outcome.tenant)
            if slices := state.add_outcome(outcome, objective, spec):
                counted[spec.slice_of(outcome.ts)].append(outcome.event_id)
                changed |= slices
        return changed
    if item["kind"] == "telemetry":
        reading = InstanceTelemetry.model_validate(item["reading"])
        return state.add_telemetry(reading, item["ts"], spec)
    at = spec.slice_of(item["ts"])
    if slices := state.add_evictions(
        item["event_id"], item["instance"], item["blocks"], item["ts"], spec
    ):
        counted[at].append(item["event_id"])
    return slices

"""The table logic: what the stream processors compute, checked against the records a
simulated run produced, under reordering, duplicates, early ends and late events."""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from faust.exceptions import PartitionsMismatch
from hypothesis import given
from hypothesis import strategies as st

from schemas import Envelope
from schemas.base import TaskClass
from schemas.lifecycle import (
    CancelReason,
    RejectReason,
    RequestArrived,
    RequestCancelled,
    RequestCompleted,
    RequestFailed,
    RequestRejected,
    RequestRouted,
)
from schemas.objectives import DEFAULT_OBJECTIVES, ClassObjective, Objectives
from schemas.tables import CapacityTable, GoodputTable, KvTable
from schemas.telemetry import InstanceTelemetry, KvBlocksRemoved
from sim.events import lifecycle_events
from sim.records import RequestRecord
from sim.run import RunConfig, simulate_run
from streams import InMemoryBus
from streams.faust_app import _apply, _LiveStates, build_app
from streams.settings import WorkerSettings
from streams.table_host import TableHost
from streams.tables import outcomes
from streams.tables.builder import DcTables, TableBuilder
from streams.tables.outcomes import OPEN_REQUEST_S, Outcome, OutcomeKind
from streams.tables.sketch import QuantileSketch
from streams.tables.windows import WindowSpec
from tests.conftest import read_for

SPEC = WindowSpec(size_s=600.0, slide_s=60.0, grace_s=600.0)
EPOCH = 1_800_000_000.0  # a slide boundary


@pytest.fixture(scope="module")
def records() -> list[RequestRecord]:
    _, records = simulate_run(RunConfig("azure-conv", instances=4, requests=300))
    return records


def goodput(tables: Sequence[object]) -> GoodputTable:
    return next(t for t in tables if isinstance(t, GoodputTable))


def build(events: Sequence[Envelope], now: float) -> list[object]:
    builder = TableBuilder(SPEC)
    for event in events:
        builder.feed(event)
    return builder.tables(now)


def test_goodput_totals_equal_the_simulated_records(records: list[RequestRecord]) -> None:
    events = lifecycle_events(records, model="m", epoch=EPOCH)
    now = EPOCH + SPEC.size_s - 1  # the window's last slice is still open: [EPOCH, now]
    row = goodput(build(events, now)).classes[0]
    done = [r for r in records if r.outcome == "completed" and r.arrival_s + r.e2e_s < 600]
    objective = DEFAULT_OBJECTIVES[TaskClass.INTERACTIVE]
    met = [r for r in done if objective.met(r.ttft_s, r.tpot_s, r.e2e_s, r.deadline_s)]
    assert row.key == "interactive"
    assert row.completed == len(done) > 0
    assert row.output_tokens == sum(r.output_tokens for r in done)
    assert row.goodput_tokens == sum(r.output_tokens for r in met)
    assert row.compliance == pytest.approx(len(met) / len(done))
    true_p95 = float(np.quantile([r.ttft_s for r in done], 0.95, method="lower"))
    assert row.ttft_p95_s == pytest.approx(true_p95, rel=0.02)


def test_reordered_and_redelivered_events_give_the_same_tables(
    records: list[RequestRecord],
) -> None:
    events = lifecycle_events(records, model="m", epoch=EPOCH)
    shaken = events + random.Random(1).sample(events, len(events) // 3)  # redeliveries
    random.Random(2).shuffle(shaken)  # completions now often come before arrivals
    now = EPOCH + SPEC.size_s
    assert build(shaken, now) == build(events, now)


def _request(
    n: int, at: float, region: str = "eu", tenant: str = "t", model: str = "m"
) -> list[Envelope]:
    rid = f"r{n}"
    return [
        Envelope.wrap(
            RequestArrived(
                request_id=rid,
                tenant=tenant,
                task_class=TaskClass.INTERACTIVE,
                model=model,
                input_tokens=100,
                output_budget=10,
                source_region=region,
            ),
            source="test",
            ts=at,
        ),
        Envelope.wrap(
            RequestRouted(request_id=rid, dc="dc-a", instance_id="i0", policy="p", candidates=()),
            source="test",
            ts=at,
        ),
    ]


def _completed(n: int, at: float, output_tokens: int = 10, tenant: str = "t") -> Envelope:
    done = RequestCompleted(
        request_id=f"r{n}",
        dc="dc-a",
        instance_id="i0",
        task_class=TaskClass.INTERACTIVE,
        tenant=tenant,
        input_tokens=100,
        cached_tokens=0,
        output_tokens=output_tokens,
        ttft_s=0.5,
        tpot_s=0.05,
        e2e_s=1.0,
    )
    return Envelope.wrap(done, source="test", ts=at)


def test_ends_repeats_and_late_events_are_counted_not_lost() -> None:
    builder = TableBuilder(WindowSpec(size_s=60, slide_s=10, grace_s=5))
    start = EPOCH
    builder.feed(_completed(1, start + 1))  # before its start: held
    for event in _request(1, start):
        builder.feed(event)
    builder.feed(_completed(1, start + 2, output_tokens=7))  # run twice
    for event in _request(2, start):
        builder.feed(event)
    cancelled = RequestCancelled(
        request_id="r2", reason=CancelReason.TIMEOUT, output_tokens=4, instance_id="i0"
    )
    builder.feed(Envelope.wrap(cancelled, source="test", ts=start + 3))
    builder.feed(_completed(4, start + 1))  # r4's start never comes: held, not counted
    early = goodput(builder.tables(start + 59)).classes[0]  # the window [start, start + 59]
    assert (early.completed, early.output_tokens, early.repeated_executions) == (1, 10, 1)
    assert (early.timeouts, early.wasted_tokens) == (1, 4 + 7)
    for event in _request(3, start + 100):  # moves the watermark on
        builder.feed(event)
    builder.feed(_completed(3, start + 101))
    for event in _request(5, start):
        builder.feed(event)
    builder.feed(_completed(5, start + 4))  # 97 s behind the watermark: late
    later = goodput(builder.tables(start + 110)).classes[0]
    # r4, quiet for longer than a window and its grace, is forgotten: its held end is late too
    assert (later.completed, later.late_events) == (1, 2)


def test_a_dc_s_refusal_counts_there_as_a_failure_and_one_at_the_door_nowhere() -> None:
    """As the simulator counts it (``sim.control_loop``): a request a DC's admission
    refused is a miss of that DC, the one it ended in even where an earlier DC had taken
    it; one refused before any DC took it is in no DC's table."""
    builder = TableBuilder(WindowSpec(size_s=60, slide_s=10, grace_s=5))
    start = EPOCH

    def refused(n: int, dc: str | None) -> Envelope:
        why = RequestRejected(
            request_id=f"r{n}", reason=RejectReason.DEADLINE, retry_after_s=1.0, dc=dc
        )
        return Envelope.wrap(why, source="test", ts=start + 1)

    builder.feed(refused(1, "dc-a"))  # before its start: held until the start comes
    for n in (1, 2, 3):
        builder.feed(_request(n, start)[0])  # arrived, never routed
    builder.feed(_request(2, start)[1])  # r2 routed to dc-a, then refused by dc-b
    builder.feed(refused(2, "dc-b"))
    builder.feed(refused(3, None))
    tables = {t.dc: t for t in builder.tables(start + 59) if isinstance(t, GoodputTable)}
    assert set(tables) == {"dc-a", "dc-b"}
    builder.tables(start + 100)  # past a window and its grace: r3 ended, and is let go
    assert "r3" not in builder.requests
    for dc in ("dc-a", "dc-b"):
        chats = tables[dc].classes[0]
        assert (chats.key, chats.failures, chats.completed, chats.timeouts) == (
            "interactive",
            1,
            0,
            0,
        )


def test_a_client_that_left_while_a_dc_held_its_request_is_a_miss_of_that_dc() -> None:
    """As the simulator counts it: a request held in dc-b's pool whose client left is a
    cancellation in dc-b's table (not a late event once forgotten), also where dc-a had
    taken it before (routed there, it failed before its first token and fell back)."""
    builder = TableBuilder(WindowSpec(size_s=60, slide_s=10, grace_s=5))
    builder.feed(_request(1, EPOCH)[0])  # arrived, held, never routed
    builder.feed(_request(2, EPOCH)[0])
    builder.feed(_request(2, EPOCH)[1])  # routed to dc-a, then held in dc-b
    for n in (1, 2):
        left = RequestCancelled(
            request_id=f"r{n}",
            reason=CancelReason.CLIENT_DISCONNECT,
            dc="dc-b",
            task_class=TaskClass.INTERACTIVE,
            tenant="t",
        )
        builder.feed(Envelope.wrap(left, source="test", ts=EPOCH + 5))
    tables = [t for t in builder.tables(EPOCH + 59) if isinstance(t, GoodputTable)]
    assert [t.dc for t in tables] == ["dc-b"]
    chats = tables[0].classes[0]
    assert (chats.cancellations, chats.completed, chats.late_events) == (2, 0, 0)


def test_an_answer_that_runs_longer_than_a_window_still_counts_when_it_ends() -> None:
    """Its first token does not touch its join state, so a request that arrived and has
    not ended is kept while it may still run (``OPEN_REQUEST_S``), not a window and its
    grace; one that never ends is given up after that."""
    builder = TableBuilder(WindowSpec(size_s=60, slide_s=10, grace_s=5))
    start = EPOCH
    for event in _request(1, start) + _request(2, start):
        builder.feed(event)
    builder.tables(start + 100)  # both quiet for longer than a window and its grace
    builder.feed(_completed(1, start + 121))
    chats = goodput(builder.tables(start + 125)).classes[0]
    assert (chats.completed, chats.late_events) == (1, 0)
    assert "r2" in builder.requests
    builder.tables(start + OPEN_REQUEST_S + 1)
    assert "r2" not in builder.requests


def test_an_end_too_old_for_the_window_counts_late_rather_than_nowhere() -> None:
    """63 s behind the latest event: not in the window up to it (which starts 50 s back,
    at a slide's edge), so a late event; measured from the window and its grace (65 s)
    it was neither late nor in any table."""
    builder = TableBuilder(WindowSpec(size_s=60, slide_s=10, grace_s=5))
    start = EPOCH
    for event in _request(1, start) + _request(2, start):
        builder.feed(event)
    builder.feed(_completed(2, start + 64))
    builder.feed(_completed(1, start + 1))
    chats = goodput(builder.tables(start + 64)).classes[0]
    assert (chats.completed, chats.late_events) == (1, 1)


def test_each_source_region_s_requests_have_rows_of_their_own_by_class() -> None:
    builder = TableBuilder(WindowSpec(size_s=60, slide_s=10, grace_s=5))
    for n, region in enumerate(("eu", "eu", "us")):
        for event in _request(n, EPOCH, region):
            builder.feed(event)
        builder.feed(_completed(n, EPOCH + 1, output_tokens=10 * (n + 1)))
    table = goodput(builder.tables(EPOCH + 59))
    keyed = [(r.key, r.completed, r.output_tokens) for r in table.regions]
    assert keyed == [("eu/interactive", 2, 30), ("us/interactive", 1, 30)]
    assert table.region_rows("us") == {TaskClass.INTERACTIVE: table.regions[1]}
    assert table.region_rows("ap") == {}
    assert table.classes[0].completed == 3


def test_each_model_s_completions_have_a_row_of_their_own() -> None:
    """What an edge reads a DC's drain rate for a model from: its completions alone, over
    the window's span; a request that failed completed nothing."""
    builder = TableBuilder(WindowSpec(size_s=60, slide_s=10, grace_s=5))
    for n, model in enumerate(("llama", "llama", "qwen", "qwen")):
        for event in _request(n, EPOCH, model=model):
            builder.feed(event)
        failed = RequestFailed(request_id=f"r{n}", instance_id="i0", error="engine dead")
        ended = (
            _completed(n, EPOCH + 1) if n < 3 else Envelope.wrap(failed, source="t", ts=EPOCH + 1)
        )
        builder.feed(ended)
    table = goodput(builder.tables(EPOCH + 59))
    keyed = [(r.key, r.completed, r.failures) for r in table.models]
    assert keyed == [("llama", 2, 0), ("qwen", 1, 1)]
    assert table.models[0].output_tokens_per_s == pytest.approx(20 / 59)


def test_a_region_name_as_long_as_an_identifier_still_makes_a_row_key_that_fits() -> None:
    builder = TableBuilder(WindowSpec(size_s=60, slide_s=10, grace_s=5))
    long, other = "r" * 256, "r" * 255 + "s"  # equal for their first 255 characters
    for n, region in enumerate((long, other)):
        for event in _request(n, EPOCH, region):
            builder.feed(event)
        builder.feed(_completed(n, EPOCH + 1))
    table = goodput(builder.tables(EPOCH + 59))
    assert all(len(row.key) <= 256 for row in table.regions)
    assert [len(table.region_rows(r)) for r in (long, other)] == [1, 1]
    assert table.region_rows(long) != table.region_rows(other)


def test_a_redelivered_event_releases_again_what_its_request_released() -> None:
    """A worker killed after writing a request's join state to its changelog but before
    the outcome it released reached its topic replays the event from its last committed
    offset, with the join state recovered: the event is seen, and the outcome must still
    go out. Counted twice, it counts once."""
    completed = _completed(1, EPOCH + 1)
    state = outcomes.new_state()
    released = [
        o for event in [*_request(1, EPOCH), completed] for o in outcomes.apply(state, event)
    ]
    assert [o.event_id for o in released] == [completed.event_id]
    recovered = json.loads(json.dumps(state))  # as the changelog holds it
    assert outcomes.apply(recovered, completed) == released
    builder = TableBuilder(WindowSpec(size_s=60, slide_s=10, grace_s=5))
    for outcome in released * 2:
        builder.add_outcome(outcome)
    assert goodput(builder.tables(EPOCH + 59)).classes[0].completed == 1


def _telemetry(instance: str, used: int, hits: int, queries: int, ready: bool = True):
    return InstanceTelemetry(
        instance_id=instance,
        dc="dc-a",
        model="m",
        model_version="1",
        ready=ready,
        waiting=2,
        running=3,
        inflight_tokens=100,
        kv_blocks_used=used,
        kv_blocks_total=1000,
        prefix_cache_hits=hits,
        prefix_cache_queries=queries,
    )


def test_capacity_and_kv_come_from_the_latest_telemetry_and_counter_growth() -> None:
    builder = TableBuilder(WindowSpec(size_s=60, slide_s=10, grace_s=5))
    feed = [
        (_telemetry("i0", 100, 0, 0), 1.0),
        (_telemetry("i0", 400, 300, 1000), 30.0),
        (_telemetry("i1", 900, 0, 0, ready=False), 20.0),
    ]
    for telemetry, at in feed:
        builder.feed(Envelope.wrap(telemetry, source="test", ts=EPOCH + at))
    removed = KvBlocksRemoved(instance_id="i0", block_hashes=(1, 2, 3))
    builder.feed(Envelope.wrap(removed, source="test", ts=EPOCH + 31))
    tables = builder.tables(EPOCH + 59)  # the window [EPOCH, EPOCH + 59]: 59 s
    capacity = next(t for t in tables if isinstance(t, CapacityTable))
    kv = next(t for t in tables if isinstance(t, KvTable))
    [row] = capacity.rows
    assert (row.ready_endpoints, row.kv_blocks_total, row.kv_blocks_free) == (1, 1000, 600)
    assert row.telemetry_age_s == pytest.approx(29.0)  # freshest at 30 s, read at 59 s
    assert kv.pressure == pytest.approx((400 + 900) / 2000)
    assert kv.prefix_hit_rate == pytest.approx(0.3)
    assert kv.evictions_per_s == pytest.approx(3 / 59)  # over the time the window spans


@given(st.lists(st.floats(0.001, 1000.0), min_size=1, max_size=300), st.floats(0, 1))
def test_the_sketch_is_within_its_relative_accuracy(values: list[float], q: float) -> None:
    sketch, halves = QuantileSketch(), (QuantileSketch(), QuantileSketch())
    for n, value in enumerate(values):
        sketch.add(value)
        halves[n % 2].add(value)
    truth = float(np.quantile(values, q, method="lower"))
    assert sketch.quantile(q) == pytest.approx(truth, rel=0.0101)
    halves[0].merge(halves[1])
    assert halves[0].quantile(q) == sketch.quantile(q)


def test_an_event_counts_before_its_slice_closes() -> None:
    builder = TableBuilder(WindowSpec(size_s=60, slide_s=10, grace_s=5))
    for event in _request(1, EPOCH + 2):
        builder.feed(event)
    builder.feed(_completed(1, EPOCH + 3))
    table = goodput(builder.tables(EPOCH + 4))
    assert table.classes[0].completed == 1
    # the open slice [EPOCH, EPOCH + 10) and the five whole ones before it
    assert (table.window_start, table.window_end) == (EPOCH - 50, EPOCH + 4)


def test_an_end_whose_start_never_comes_counts_late_when_given_up() -> None:
    """Its own slice is long gone by then: it counts in the window of the time it is
    given up, though the DC has seen nothing since."""
    builder = TableBuilder(WindowSpec(size_s=60, slide_s=10, grace_s=5))
    builder.feed(_completed(9, EPOCH))
    assert builder.tables(EPOCH + 30) == []  # held: no DC has counted anything yet
    row = goodput(builder.tables(EPOCH + 1000)).classes[0]
    assert (row.completed, row.late_events) == (0, 1)
    assert goodput(builder.tables(EPOCH + 1001)).classes[0].late_events == 1


def test_an_end_no_event_places_in_a_dc_is_logged_when_given_up(
    caplog: pytest.LogCaptureFixture,
) -> None:
    builder = TableBuilder(WindowSpec(size_s=60, slide_s=10, grace_s=5))
    cancelled = RequestCancelled(request_id="r7", reason=CancelReason.CLIENT_DISCONNECT)
    builder.feed(Envelope.wrap(cancelled, source="test", ts=EPOCH))
    with caplog.at_level("WARNING", logger="streams.tables.outcomes"):
        assert builder.tables(EPOCH + 1000) == []
    assert "request r7, which no event placed in a DC" in caplog.text


def test_a_tenant_s_own_objective_decides_whether_its_requests_count_as_goodput() -> None:
    strict = Objectives(tenants={"t": {TaskClass.INTERACTIVE: ClassObjective(ttft_s=0.2)}})
    compliance = []
    for objectives in (None, strict):  # the request's TTFT is 0.5 s
        builder = TableBuilder(WindowSpec(size_s=60, slide_s=10, grace_s=5), objectives)
        for event in [*_request(1, EPOCH), _completed(1, EPOCH + 1)]:
            builder.feed(event)
        compliance.append(goodput(builder.tables(EPOCH + 59)).classes[0].compliance)
    assert compliance == [1.0, 0.0]


def test_a_whole_answer_is_judged_on_its_end_and_kept_out_of_the_ttft_percentiles() -> None:
    """Chats: TTFT 2 s, TPOT 0.1 s. A whole answer of 11 tokens meets that if it ends by
    2 + 10 x 0.1 = 3 s, whatever its unseen first token; its TTFT (its end) is no TTFT."""
    builder = TableBuilder(WindowSpec(size_s=60, slide_s=10, grace_s=5))
    answers = {1: 2.9, 2: 3.1}  # whole, ending in time and late
    for n, e2e in answers.items():
        for event in _request(n, EPOCH):
            builder.feed(event)
        whole = _completed(n, EPOCH + 4, output_tokens=11).payload.model_copy(
            update={"ttft_s": e2e, "tpot_s": 0.0, "e2e_s": e2e, "streamed": False}
        )
        builder.feed(Envelope.wrap(whole, source="test", ts=EPOCH + 4))
    for event in [*_request(3, EPOCH), _completed(3, EPOCH + 1)]:  # streamed, TTFT 0.5 s
        builder.feed(event)
    table = goodput(builder.tables(EPOCH + 59))
    [row] = [r for r in table.classes if r.key == TaskClass.INTERACTIVE.value]
    assert (row.completed, row.compliance) == (3, pytest.approx(2 / 3))
    assert row.ttft_p95_s == pytest.approx(0.5, rel=0.02)
    span = table.window_end - table.window_start  # the counts, and the rates they make
    assert (row.output_tokens, row.goodput_tokens) == (32, 21)
    assert row.goodput_tokens_per_s == pytest.approx(21 / span)
    assert row.output_tokens_per_s == pytest.approx(32 / span)


def test_an_objective_judges_a_whole_answer_by_when_a_streamed_one_would_have_ended() -> None:
    chats = DEFAULT_OBJECTIVES[TaskClass.INTERACTIVE]
    assert chats.met(9.0, 0.0, 9.0, None, whole_output_tokens=71)  # by 2 + 70 x 0.1
    assert not chats.met(9.0, 0.0, 9.0, None, whole_output_tokens=70)
    assert not chats.met(9.0, 0.0, 9.0, None)  # read as streamed: a 9 s first token
    documents = DEFAULT_OBJECTIVES[TaskClass.LONG_DOCUMENT]  # TTFT only: the end by 30 s
    assert documents.met(29.0, 0.0, 29.0, None, whole_output_tokens=500)


def test_the_worker_stores_a_busy_slice_in_records_under_kafka_s_limit() -> None:
    """30,000 outcomes in one 5 s slice, counted in two batches (a worker catching up):
    each record stays under half of Kafka's 1 MB default (one record of the slice's every
    id had crashed the worker), and a state rebuilt from the records (a recovery) knows
    every id, so a replayed outcome is not counted again."""
    spec = WindowSpec(size_s=120.0, slide_s=5.0, grace_s=60.0)
    records: dict[str, object] = {}
    live = _LiveStates(records)  # type: ignore[arg-type]  # a dict stands in for the table
    ids = [f"{n:032x}" for n in range(30_000)]
    batches = [ids[:15_000], ids[15_000:]]
    for batch in batches:
        live.apply("dc", [_outcomes_update(batch)], spec, Objectives())
    assert max(len(json.dumps(value)) for value in records.values()) < 500_000
    rebuilt = _LiveStates(records).of("dc")  # type: ignore[arg-type]
    replayed: dict[float, list[str]] = defaultdict(list)
    assert _apply(rebuilt, _outcomes_update(ids[7:8]), spec, Objectives(), replayed) == set()
    assert sum(len(c) for c in rebuilt.counted.values()) == 30_000


def _outcomes_update(ids: list[str], ts: float = 1_000_002.0) -> dict[str, Any]:
    """An update of the worker's aggregate: completions with these ids, at ``ts``."""
    return {"kind": "outcomes", "outcomes": [_outcome_fields(i, ts) for i in ids]}


def _outcome_fields(event_id: str, ts: float) -> dict[str, object]:
    return Outcome(
        request_id=event_id,
        event_id=event_id,
        ts=ts,
        dc="dc",
        model="m",
        task_class="interactive",
        tenant="t",
        kind=OutcomeKind.COMPLETED,
        output_tokens=10,
        ttft_s=0.1,
        tpot_s=0.01,
        e2e_s=0.2,
    ).to_dict()


def test_ids_that_no_slice_record_counts_are_ignored_and_gone_slices_leave_no_ids() -> None:
    """A worker that died after a write's id records and before its slice record left ids
    the slice's counts do not include: a rebuilt state ignores them (the replayed update
    counts again, once), and an expired slice takes every id record under it along."""
    spec = WindowSpec(size_s=10.0, slide_s=5.0, grace_s=0.0)
    records: dict[str, object] = {}
    live = _LiveStates(records)  # type: ignore[arg-type]  # a dict stands in for the table
    live.apply("dc", [_outcomes_update(["a", "b"])], spec, Objectives())
    records["dc|1000000.0|ids|1"] = ["c"]  # the died-between-writes leftover
    live = _LiveStates(records)  # type: ignore[arg-type]  # a restarted worker's
    assert live.of("dc").counted[1_000_000.0] == {"a", "b"}
    # the replay: counted, its id record written over the leftover
    live.apply("dc", [_outcomes_update(["c"])], spec, Objectives())
    goodput = _LiveStates(records).of("dc").goodput[1_000_000.0]  # type: ignore[arg-type]
    assert {c.completed for c in goodput.values()} == {3}  # 2 if "c" had been loaded
    far_later = _outcomes_update(["z"], ts=1_000_100.0)  # the first slice expires
    live.apply("dc", [far_later], spec, Objectives())
    assert not [key for key in records if key.startswith("dc|1000000.0")]


def test_the_worker_s_partition_check_waits_for_its_changelog_s_metadata(tmp_path: Path) -> None:
    """A changelog listed with no partitions yet (just created) is no mismatch, and is
    checked again at the next write; a real mismatch still stops the agent."""

    class Metadata:
        """What the check asks of the worker's consumer: a topic's partition count."""

        def __init__(self) -> None:
            self.counts = {"tf.telemetry": 3}

        def topic_partitions(self, name: str) -> int | None:
            return self.counts.get(name)

    app = build_app("localhost:9", WorkerSettings(app_id="check", data_dir=tmp_path))
    app.consumer = metadata = Metadata()
    table = app.tables["instance-dc"]
    metadata.counts[table.changelog_topic_name] = 0
    table._verify_source_topic_partitions("tf.telemetry")
    metadata.counts[table.changelog_topic_name] = 2
    with pytest.raises(PartitionsMismatch):
        table._verify_source_topic_partitions("tf.telemetry")


def test_workers_keep_no_standby_copies_of_their_tables_unless_asked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Faust's default is one copy; the worker's none (a second worker would read every
    changelog of the first's), and an operator's setting reaches Faust."""
    default = build_app("localhost:9", WorkerSettings(app_id="none", data_dir=tmp_path))
    assert default.conf.table_standby_replicas == 0
    monkeypatch.setenv("TOKENFLEET_WORKER_STANDBY_REPLICAS", "1")
    asked = build_app("localhost:9", WorkerSettings(app_id="one", data_dir=tmp_path))
    assert asked.conf.table_standby_replicas == 1


def test_an_event_stamped_an_hour_ahead_counts_as_of_now_and_expires_nothing() -> None:
    """A producer's clock an hour ahead (or milliseconds sent as seconds) moved the
    watermark with it: every slice expired and every later event counted as late."""
    now = EPOCH + 30
    builder = TableBuilder(WindowSpec(size_s=60, slide_s=10, grace_s=5), clock=lambda: now)
    for n in (1, 2):
        for event in _request(n, EPOCH):
            builder.feed(event)
        builder.feed(_completed(n, EPOCH + 1))
    for event in _request(3, EPOCH + 3600):
        builder.feed(event)
    builder.feed(_completed(3, EPOCH + 3600))
    for event in _request(4, EPOCH + 2):
        builder.feed(event)
    builder.feed(_completed(4, EPOCH + 3))
    [row] = [r for r in goodput(builder.tables(now)).classes if r.key == "interactive"]
    assert (row.completed, row.late_events) == (4, 0)


def test_table_versions_never_go_back_when_the_clock_does() -> None:
    builder = TableBuilder(SPEC)
    for event in _request(1, EPOCH):
        builder.feed(event)
    builder.feed(_completed(1, EPOCH + 1))
    first = goodput(builder.tables(EPOCH + 10)).version
    assert goodput(builder.tables(EPOCH + 5)).version > first  # NTP stepped the clock back


async def test_the_embedded_host_leaves_out_a_table_too_large_to_publish_and_goes_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A goodput table with a row for each of 3,000 tenants passes the size a record may
    have: the host published nothing more, and its task ended without a word."""
    builder, bus, now = TableBuilder(SPEC), InMemoryBus(), time.time()  # the host's clock
    for n in range(3000):
        for event in [
            *_request(n, now, tenant=f"t{n}"),
            _completed(n, now, tenant=f"t{n}"),
        ]:
            builder.feed(event)
    host = TableHost(bus, builder, publish_s=0.01)
    running = asyncio.create_task(host.run())
    with caplog.at_level("ERROR", logger="streams.table_host"):
        # Each pass encodes the goodput table of 3,000 rows before it finds it too large:
        # on a loaded machine half a second saw a single pass.
        published = await read_for(bus, "tf.tables.capacity", 3.0)
    running.cancel()
    await asyncio.gather(running, return_exceptions=True)
    assert len(published) > 1  # pass after pass
    assert not await read_for(bus, "tf.tables.goodput", 0.05)
    assert any("GoodputTable: not published" in r.getMessage() for r in caplog.records)


def test_an_outcome_stamped_ahead_and_delivered_again_later_counts_once() -> None:
    """Remembered by the slice its time capped to the horizon, a replay under a later
    clock found it in another slice, and counted it again."""
    spec = WindowSpec(size_s=60, slide_s=10, grace_s=5)
    state = DcTables(horizon=EPOCH + 5)
    ahead = Outcome.from_dict(_outcome_fields("e1", EPOCH + 20))
    objective = DEFAULT_OBJECTIVES[TaskClass.INTERACTIVE]
    assert state.add_outcome(ahead, objective, spec)
    state.horizon = EPOCH + 35  # the worker restarted, and its clock went on
    assert not state.add_outcome(ahead, objective, spec)
    [row] = [r for r in goodput(state.tables("dc", spec, EPOCH + 30)).classes if r.completed]
    assert row.completed == 1


def test_ids_of_events_stamped_far_ahead_do_not_pile_up() -> None:
    """Counted by their own time, an event a second stamped in milliseconds (a year ahead
    and more) kept a slice each, which never fell behind the watermark."""
    spec = WindowSpec(size_s=60, slide_s=10, grace_s=5)
    state = DcTables(horizon=EPOCH + 5)
    objective = DEFAULT_OBJECTIVES[TaskClass.INTERACTIVE]
    for n in range(5):
        state.add_outcome(
            Outcome.from_dict(_outcome_fields(f"m{n}", EPOCH * 1000 + n)), objective, spec
        )
    state.expire(spec)
    assert max(state.slice_starts()) <= EPOCH + 5

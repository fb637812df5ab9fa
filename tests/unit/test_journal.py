"""A pipeline's journal replays to the same decisions, and the audit catches a record that
was changed or lost (``control/journal/``)."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from control.admission.registry import make_admission
from control.admission.request import LONG_DOCUMENT_TOKENS
from control.fleet.fleetmind import FleetMind
from control.fleet.journal import dc_choice_record, replay_dc_choice
from control.fleet.view import DataCenterState, DcRequest, FleetState
from control.journal import (
    PART,
    PART_BYTES,
    SAME_AS_LAST_PASS,
    JournaledPipeline,
    Record,
    replay,
)
from control.pipeline import ClassLoad, Pipeline, ReleaseFailed
from control.routing import PoolModel, RouteRequest, make_router
from gateway.journal import Journals
from schemas import Envelope, encode
from schemas.audit import JournalRecord
from schemas.base import Message, TaskClass
from schemas.control import ClassQuota
from sim.clients import ClientModel
from sim.cluster import Cluster
from sim.control_loop import QuotaLoop
from sim.simulator import Simulation
from sim.workload import TraceRequest
from streams.bus import MAX_RECORD_BYTES
from tests.unit.test_admission import fleet, request
from tests.unit.test_pipeline import _BreaksOnSecondRoute
from tests.unit.test_simulator import STEPS, _profile
from tokenfleet.audit import ABSENT, audit_journal, fields_that_differ
from tokenfleet.cli import main

SEED = 7
POOL = PoolModel(STEPS, max_num_batched_tokens=2_048)


def _pipeline(_start: Record) -> Pipeline[str]:
    return Pipeline(make_admission("slomax"), make_router("tokenpilot", seed=SEED, pool=POOL))


def _journaled_run() -> tuple[list[Record], Simulation]:
    """Chats beside long documents and deadline batch work on two small instances, past
    what they serve: SLOMax holds, rejects and answers holds early, its controller moves
    the quotas, clients give up and retry, and TokenPilot learns from first tokens and
    KV events, all of it recorded."""
    chats = [
        TraceRequest(f"c{n}", 0.05 * n, 200, 20, tuple(range(n % 3, n % 3 + 10)))
        for n in range(300)
    ]
    documents = [
        TraceRequest(f"d{n}", 0.5 * n, 16_384, 5, (), TaskClass.LONG_DOCUMENT) for n in range(30)
    ]
    batch = [
        TraceRequest(f"b{n}", 0.3 * n, 800, 200, (), TaskClass.BATCH, deadline_s=0.3 * n + 8)
        for n in range(40)
    ]
    simulation = Simulation(
        Cluster.single(_profile(num_blocks=4_000, budget=2_048), 2),
        make_router("tokenpilot", seed=SEED, pool=POOL),
        admission=make_admission("slomax"),
        clients=ClientModel(retry_share=0.5),
        control=QuotaLoop(),
    )
    records: list[Record] = []
    host = simulation.pipeline
    simulation.pipeline = JournaledPipeline(
        host.admission, host.router, journal=records.append, recipe={"policy": "tokenpilot"}
    )
    simulation.run(sorted(chats + documents + batch, key=lambda r: r.arrival_s))
    return records, simulation


def test_a_simulated_run_s_journal_replays_to_the_same_decisions() -> None:
    records, _ = _journaled_run()
    calls = {r["call"] for r in records}
    assert {"arrive", "release", "first_token", "finished", "kv_events", "quotas"} <= calls
    verdicts = {r["outcome"]["admission"]["verdict"] for r in records if r["call"] == "arrive"}
    assert verdicts == {"dispatch", "hold", "reject"}
    # Through JSON, as the journal travels.
    audit = replay(json.loads(json.dumps(records)), _pipeline)
    assert audit.problem is None
    assert audit.differences == []
    assert audit.decisions == sum(r["call"] in ("arrive", "release") for r in records)


def _first(records: list[Record], call: str, **where: Any) -> Record:
    return next(
        r for r in records if r["call"] == call and all(r[k] == v for k, v in where.items())
    )


def test_a_changed_snapshot_or_a_lost_first_token_shows_as_differences() -> None:
    records, _ = _journaled_run()
    routed = [
        r
        for r in records
        if r["call"] == "arrive" and r["outcome"]["route"] is not None and r["seq"] > 50
    ]
    changed = copy.deepcopy(records)
    seq = routed[0]["seq"]
    chosen = routed[0]["outcome"]["route"]["chosen"]
    changed[seq]["fleet"]["waiting"][chosen] += 50  # the log says it saw another queue
    audit = replay(changed, _pipeline)
    assert audit.differences
    assert audit.differences[0].seq == seq
    first = audit.differences[0]
    differing = [at for at, _, _ in fields_that_differ(first.recorded, first.replayed)]
    assert any(at.startswith("route.") for at in differing)  # past the first 300 characters

    # A record lost from the middle: the replay stops there and says so.
    lost = [r for r in records if r["seq"] != seq]
    audit = replay(lost, _pipeline)
    assert audit.problem == f"record {seq} is missing (the next is {seq + 1})"
    assert audit.differences == []

    # What the router learned from counts: without the first tokens it observed (the
    # ends recorded without them), later decisions come out different.
    unlearned = copy.deepcopy(records)
    for record in unlearned:
        if record["call"] == "finished":
            record["observation"] = None
    assert replay(unlearned, _pipeline).differences


def test_the_fields_that_differ_are_named_by_their_path_with_both_values() -> None:
    recorded = {"route": {"chosen": 0, "scores": [1.0, 2.0]}, "verdict": "dispatch"}
    replayed = {"route": {"chosen": 1, "scores": [1.0, 2.0]}, "held": True}
    assert list(fields_that_differ(recorded, replayed)) == [
        ("route.chosen", 0, 1),
        ("verdict", "dispatch", ABSENT),
        ("held", ABSENT, True),
    ]
    assert list(fields_that_differ([1, 2], [1, 2, 3])) == [("", [1, 2], [1, 2, 3])]


def test_a_journal_from_before_the_engines_block_sizes_were_kept_replays_on_the_default() -> None:
    records, _ = _journaled_run()
    assert replay(records, _pipeline).differences == []

    def forget(value: Any) -> None:
        if isinstance(value, dict):
            value.pop("kv_block_size", None)
            for item in value.values():
                forget(item)
        elif isinstance(value, list):
            for item in value:
                forget(item)

    older = copy.deepcopy(records)
    forget(older)
    assert older != records  # the sizes were there to forget
    audit = replay(older, _pipeline)
    assert (audit.problem, audit.differences) == (None, [])


def test_the_slots_a_host_holds_are_journaled_with_the_decisions_they_shaped() -> None:
    """A host sharing a ceiling starts a second long document once granted a second slot:
    the replay does too, and a journal that says the slot never came does not."""
    records: list[Record] = []
    pipeline: JournaledPipeline[str] = JournaledPipeline(
        make_admission("slomax"),
        make_router("round_robin"),
        slots={TaskClass.LONG_DOCUMENT: 1},
        journal=records.append,
    )
    for rid in ("d1", "d2"):
        document = request(TaskClass.LONG_DOCUMENT, LONG_DOCUMENT_TOKENS, rid=rid)
        route = RouteRequest(rid, LONG_DOCUMENT_TOKENS, 10)
        pipeline.arrive(document, route, rid, fleet(), 0.0)
    pipeline.slots = {TaskClass.LONG_DOCUMENT: 2}
    assert [o.payload for o in pipeline.release(fleet, 1.0)] == ["d2"]
    assert replay(json.loads(json.dumps(records)), _round_robin).differences == []
    for record in records:
        if record["call"] == "slots":
            record["value"] = {"long_document": 1}
    assert [d.call for d in replay(records, _round_robin).differences] == ["release"]


def _round_robin(_start: Record) -> Pipeline[str]:
    return Pipeline(make_admission("slomax"), make_router("round_robin"))


def test_a_journal_must_begin_with_its_recipe() -> None:
    records, _ = _journaled_run()
    audit = replay([dict(r, seq=n) for n, r in enumerate(records[1:])], _pipeline)
    assert audit.problem == "the journal begins with 'arrive', not 'start'"
    assert replay([], _pipeline).problem == "the journal is empty"


def test_a_dc_choice_replays_and_a_changed_input_shows() -> None:
    request = DcRequest("r1", "eu", "dc-a", 1_000, None, frozenset({"eu", "us"}), None, 0.3)
    v1 = frozenset({"v1"})

    def dc(name: str, region: str, utilisation: float, wait_s: float) -> DataCenterState:
        return DataCenterState(name, region, 4, v1, v1, utilisation, wait_s, instances=4)

    fleet = FleetState(
        (dc("dc-a", "eu", 1.4, 2.0), dc("dc-b", "us", 0.2, 0.0), dc("dc-c", "ap", 0.0, 0.0)),
        {("eu", "us"): 0.08},
    )
    policy = FleetMind()
    decision = policy.choose(request, fleet)
    record = json.loads(json.dumps(dc_choice_record(request, fleet, decision) | {"seq": 0}))
    assert decision.excluded == {"dc-c": "residency"}
    assert replay_dc_choice(record, policy) is None
    record["dcs"][0] |= {"utilisation": 0.0, "predicted_wait_s": 0.0}  # says dc-a was idle
    difference = replay_dc_choice(record, policy)
    assert difference is not None
    assert difference.recorded["order"] != difference.replayed["order"]


def test_a_record_the_gateway_cannot_keep_leaves_a_gap_and_the_decision_stands() -> None:
    lost: list[int] = []
    kept: list[tuple[str, Record]] = []
    failing = iter([False, False, False, True])  # DC choices' start, the pool's, r0, r1

    def emit(message: Message) -> None:
        assert isinstance(message, JournalRecord)
        assert len(message.journal) <= 256  # a long gateway name is cut to fit
        if next(failing, False):
            raise OSError(28, "No space left on device")
        kept.append((message.journal, message.record))

    journals = Journals(
        "g" * 300, lambda _model: {}, "fleetmind", emit, on_lost=lambda: lost.append(1)
    )
    journal, _ = journals.pool("m", "dc-a")
    pipeline = JournaledPipeline(
        make_admission("fcfs"), make_router("round_robin"), journal=journal
    )
    for n in range(3):
        pipeline.first_token(f"r{n}", float(n))
    assert lost == [1]
    dc_choices = kept[0][0]
    pool = [record for name, record in kept if name != dc_choices]
    assert [r["seq"] for r in pool] == [0, 1, 3]
    assert replay(pool, _pipeline).problem == "record 2 is missing (the next is 3)"


def test_passes_that_see_the_last_pass_s_snapshot_refer_to_it_and_replay() -> None:
    """A host passes every 50 ms while it holds a request: each pass wrote its snapshot
    whole, hundreds of KB a second on a large pool for one held request."""
    records, _ = _journaled_run()
    passes = [r for r in records if r["call"] == "release"]
    assert any(SAME_AS_LAST_PASS in r["fleets"]["snapshots"] for r in passes)  # replayed above
    journal: list[Record] = []
    held = JournaledPipeline(
        make_admission("slomax"), make_router("round_robin"), journal=journal.append
    )
    zeros = (0,) * 256
    busy = fleet((2, 1) * 128, zeros, zeros, running=zeros)  # 256 queueing: batch waits
    batch = request(TaskClass.BATCH, deadline=3600.0)
    outcome = held.arrive(batch, RouteRequest("r", 1_000, 100), "r", busy, 0.0)
    assert outcome.admission.verdict.value == "hold"
    for n in range(200):
        assert held.release(lambda: busy, 0.05 * n) == []
    passes_bytes = sum(len(json.dumps(r)) for r in journal if r["call"] == "release")
    assert passes_bytes < 2 * len(json.dumps(journal[1]["fleet"])) + 200 * 200
    assert replay(json.loads(json.dumps(journal)), _round_robin).differences == []


def test_the_audit_reports_a_record_it_cannot_replay_and_fails_with_nothing_to_compare(
    tmp_path: Path,
) -> None:
    recipe = {"policy": "round_robin", "params": {}, "seed": 0, "admission": "fcfs"}
    alone = tmp_path / "start-only.jsonl"
    journals = Journals(
        "g", lambda _model: recipe | {"profile": None}, "fleetmind", _write_to(alone)
    )
    journal, pool_recipe = journals.pool("m", "a")
    JournaledPipeline(
        make_admission("fcfs"), make_router("round_robin"), journal=journal, recipe=pool_recipe
    )
    assert main(["audit", "--from", str(alone)]) == 1  # reproduced nothing: exit 0 before
    [start] = [json.loads(line)["payload"]["record"] for line in alone.read_text().splitlines()[1:]]
    assert audit_journal("g/m@a/1", [start]).problem is None
    nulled = audit_journal("g/m@a/1", [start | {"quotas": None}])
    assert nulled.problem is not None  # AttributeError escaped the audit
    assert "malformed" in nulled.problem
    recipe_of_another_version = start | {"recipe": start["recipe"] | {"policy": "newer"}}
    unknown = audit_journal("g/m@a/1", [recipe_of_another_version]).problem
    assert unknown is not None
    assert "(KeyError: unknown policy 'newer'; known:" in unknown  # not the KeyError's repr


def _write_to(path: Path) -> Callable[[Message], None]:
    def emit(message: Message) -> None:
        with path.open("a") as out:
            out.write(encode(Envelope.wrap(message, source="g")).decode() + "\n")

    return emit


@pytest.mark.parametrize("part_bytes", [PART_BYTES, 1])
def test_a_release_pass_that_failed_is_journaled_with_what_it_decided_and_replays(
    part_bytes: int,
) -> None:
    """Also in parts (``part_bytes`` 1: an outcome a record), as a pass that let out many
    before it failed is written."""
    records: list[Record] = []

    def broken(_start: Record) -> Pipeline[str]:
        return Pipeline(make_admission("slomax"), _BreaksOnSecondRoute())

    pipeline = JournaledPipeline(
        make_admission("slomax"),
        _BreaksOnSecondRoute(),
        journal=records.append,
        part_bytes=part_bytes,
    )
    document = TaskClass.LONG_DOCUMENT
    pipeline.quotas = {
        document: ClassQuota(
            task_class=document, tokens_per_s=1e6, burst_tokens=10**6, max_concurrency=2
        )
    }
    pipeline.peers = {document: ClassLoad(inflight=2)}  # the ceiling is full: both wait
    for n in (1, 2):
        held = request(document, 20_000, rid=f"d{n}")
        pipeline.arrive(held, RouteRequest(f"d{n}", 20_000, 100), f"d{n}", fleet(), 0.0)
    pipeline.peers = {}
    with pytest.raises(ReleaseFailed):
        pipeline.release(fleet, now=2.0)
    [failed] = [r for r in records if r["call"] == "release"]
    assert failed["outcomes"]["failed"] == "ZeroDivisionError"
    parts = [o["request_id"] for r in records if r["call"] == PART for o in r["outcomes"]]
    before = [o["request_id"] for o in failed["outcomes"]["before"]] + parts
    assert before == ["d1", "d2"]
    assert bool(parts) == (part_bytes == 1)
    audit = replay(json.loads(json.dumps(records)), broken)
    assert (audit.problem, audit.differences) == (None, [])


def test_a_drain_of_many_held_requests_is_written_in_parts_and_replays() -> None:
    """A stopping gateway answers every held request in one drain; about 4,800 of them
    passed the bus's limit in one record."""
    journal: list[Record] = []
    pipeline = JournaledPipeline(
        make_admission("slomax"), make_router("round_robin"), journal=journal.append, part_bytes=300
    )
    zeros = (0,) * 4
    busy = fleet((2, 1) * 2, zeros, zeros, running=zeros)  # queueing: batch waits
    for n in range(5):
        batch = request(TaskClass.BATCH, deadline=3600.0, rid=f"b{n}")
        pipeline.arrive(batch, RouteRequest(f"b{n}", 1_000, 100), f"b{n}", busy, 0.0)
    assert len(pipeline.drain("stopping")) == 5
    [drain] = [r for r in journal if r["call"] == "drain"]
    assert drain["parts"] == 1 + sum(r["call"] == PART for r in journal) > 1
    audit = replay(json.loads(json.dumps(journal)), _round_robin)
    assert (audit.problem, audit.differences, audit.decisions) == (None, [], 6)


def test_a_pass_that_lets_out_many_writes_them_in_parts_each_within_the_bus_s_limit() -> None:
    """200 batch requests held on 256 busy instances, then let out at once: written whole,
    the pass carried every instance's score for each of them, past the 1,000,000 bytes a
    bus takes, and the pool's replay stopped there."""
    journal = _held_and_let_out(200, part_bytes=PART_BYTES)
    assert max(_written_bytes(r) for r in journal) < MAX_RECORD_BYTES
    whole = _held_and_let_out(200, part_bytes=10**9)
    assert max(_written_bytes(r) for r in whole) > MAX_RECORD_BYTES  # the pass in one
    [first] = [r for r in journal if r["call"] == "release"]
    parts = [r for r in journal if r["call"] == PART]
    assert first["parts"] == 1 + len(parts) > 1
    assert len(first["outcomes"]) + sum(len(p["outcomes"]) for p in parts) == 200
    audit = replay(json.loads(json.dumps(journal)), _pipeline)
    assert (audit.problem, audit.differences, audit.decisions) == (None, [], 201)
    without_the_pass = [r for r in journal if r is not first]
    stray = replay([r | {"seq": n} for n, r in enumerate(without_the_pass)], _pipeline)
    assert stray.problem == f"record {first['seq']} continues no record"
    cut = replay(journal[:-1], _pipeline)  # read while the pass was still being written
    assert cut.problem == f"the journal ends before 1 part(s) of record {first['seq']}"
    assert cut.decisions == 200  # the arrivals before it, still counted


def _held_and_let_out(count: int, part_bytes: int) -> list[Record]:
    """The journal of ``count`` batch requests held on 256 busy instances, then let out."""
    journal: list[Record] = []
    pipeline = JournaledPipeline(
        make_admission("slomax"),
        make_router("tokenpilot", seed=SEED, pool=POOL),
        journal=journal.append,
        part_bytes=part_bytes,
    )
    zeros = (0,) * 256
    busy = fleet((2, 1) * 128, zeros, zeros, running=zeros)  # 256 queueing: batch waits
    for n in range(count):
        batch = request(TaskClass.BATCH, deadline=3600.0, rid=f"b{n}")
        pipeline.arrive(batch, RouteRequest(f"b{n}", 1_000, 100), f"b{n}", busy, 0.0)
    idle = fleet(zeros, zeros, zeros, running=zeros)
    assert len(pipeline.release(lambda: idle, 1.0)) == count
    return journal


def _written_bytes(record: Record) -> int:
    return len(encode(Envelope.wrap(JournalRecord(journal="j", record=record), source="g")))

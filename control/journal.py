"""A pipeline's journal, and the audit that replays it.

A decision is reproducible from the log alone when the log holds everything that shaped
it: the snapshot and request it was made on, and everything the pipeline learned before
(every first token, end and observation its router learned from, every quota, peer
load and slot grant it was given). ``JournaledPipeline`` records each of those calls, in
order, as JSON records; ``replay`` builds the same pipeline afresh from the journal's
first record, makes the same calls and reports every decision that comes out different
(``tokenfleet audit``). Nothing but the calls is recorded: the router's and admission's
state is rebuilt by replaying what built it, so a router that learns needs no hook of
its own.

A record is plain JSON: floats that JSON cannot carry (infinities, NaN: an instance never
seen streaming, an ineligible candidate's score) are written as the strings ``"inf"``,
``"-inf"`` and ``"nan"``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from control.admission.request import AdmissionRequest
from control.admission.view import AdmissionDecision
from control.pipeline import ClassLoad, Outcome, Payload, Pipeline, ReleaseFailed
from control.routing.snapshot import (
    SNAPSHOT_ARRAYS,
    BoolArray,
    Decision,
    FleetSnapshot,
    KvEvent,
    Observation,
    RouteRequest,
)
from schemas.base import TaskClass
from schemas.control import ClassQuota
from schemas.objectives import ClassObjective

Record = dict[str, Any]
Journal = Callable[[Record], None]
"""Where a journaled pipeline writes its records, one call each, in order."""

START = "start"
"""The call of a journal's first record: the recipe the pipeline was built from, and its
objectives, quotas, peers' load and slots at that moment."""


def json_number(value: float) -> float | str:
    return value if math.isfinite(value) else str(value)


def _optional_number(value: float | None) -> float | str | None:
    return None if value is None else json_number(value)


def _array(values: np.ndarray) -> list[Any]:
    if values.dtype.kind == "f":
        return [json_number(v) for v in values.tolist()]
    return list(values.tolist())


def _optional_array(values: np.ndarray | None) -> list[Any] | None:
    return None if values is None else _array(values)


def _floats(values: Sequence[Any]) -> np.ndarray:
    return np.array([float(v) for v in values], dtype=np.float64)


def snapshot_record(fleet: FleetSnapshot) -> Record:
    return {"ids": list(fleet.instance_ids)} | {
        name: _array(getattr(fleet, name)) for name in SNAPSHOT_ARRAYS
    }


def snapshot_from(record: Record) -> FleetSnapshot:
    return FleetSnapshot(
        tuple(record["ids"]),
        np.array(record["ready"], dtype=np.bool_),
        np.array(record["waiting"], dtype=np.int64),
        np.array(record["running"], dtype=np.int64),
        np.array(record["inflight_tokens"], dtype=np.int64),
        np.array(record["kv_blocks_used"], dtype=np.int64),
        np.array(record["kv_blocks_total"], dtype=np.int64),
        _floats(record["pending_prefill_tokens"]),
        _floats(record["last_step_end_s"]),
    )


def _route_record(route: RouteRequest) -> Record:
    return {
        "request_id": route.request_id,
        "input_tokens": route.input_tokens,
        "output_budget": route.output_budget,
        "prefix_blocks": list(route.prefix_blocks),
        "task_class": route.task_class,
        "known_matches": _optional_array(route.known_matches),
    }


def _route_from(record: Record) -> RouteRequest:
    matches = record["known_matches"]
    return RouteRequest(
        record["request_id"],
        record["input_tokens"],
        record["output_budget"],
        tuple(record["prefix_blocks"]),
        record["task_class"],
        None if matches is None else np.array(matches, dtype=np.int64),
    )


def _request_record(request: AdmissionRequest) -> Record:
    objective = request.objective
    return {
        "request_id": request.request_id,
        "task_class": request.task_class.value,
        "tenant": request.tenant,
        "input_tokens": request.input_tokens,
        "output_budget": request.output_budget,
        "arrival_s": request.arrival_s,
        "deadline_s": request.deadline_s,
        "objective": None if objective is None else objective.model_dump(mode="json"),
    }


def _request_from(record: Record) -> AdmissionRequest:
    objective = record["objective"]
    return AdmissionRequest(
        record["request_id"],
        TaskClass(record["task_class"]),
        record["tenant"],
        record["input_tokens"],
        record["output_budget"],
        record["arrival_s"],
        record["deadline_s"],
        None if objective is None else ClassObjective.model_validate(objective),
    )


def decision_record(decision: Decision | None) -> Record | None:
    """What a routing decision is compared by: the instance and every candidate's score."""
    if decision is None:
        return None
    return {"policy": decision.policy, "chosen": decision.chosen, "scores": _array(decision.scores)}


def _admission_record(decision: AdmissionDecision) -> Record:
    return {
        "verdict": decision.verdict.value,
        "reason": decision.reason,
        "allowed": _optional_array(decision.allowed),
        "hold_until_s": _optional_number(decision.hold_until_s),
        "retry_after_s": _optional_number(decision.retry_after_s),
        "figures": [[name, json_number(value)] for name, value in decision.figures],
    }


def outcome_record(outcome: Outcome[Any]) -> Record:
    return {
        "request_id": outcome.request.request_id,
        "admission": _admission_record(outcome.admission),
        "route": decision_record(outcome.route),
    }


def _quotas_record(quotas: Mapping[TaskClass, ClassQuota]) -> Record:
    return {c.value: q.model_dump(mode="json") for c, q in quotas.items()}


def _quotas_from(record: Record) -> dict[TaskClass, ClassQuota]:
    return {TaskClass(c): ClassQuota.model_validate(q) for c, q in record.items()}


def _peers_record(peers: Mapping[TaskClass, ClassLoad]) -> Record:
    return {
        c.value: [p.inflight, p.decoding, p.held, p.drained_per_s, p.head_key]
        for c, p in peers.items()
    }


def _peers_from(record: Record) -> dict[TaskClass, ClassLoad]:
    return {TaskClass(c): ClassLoad(*load) for c, load in record.items()}


def _slots_record(slots: Mapping[TaskClass, int] | None) -> Record | None:
    return None if slots is None else {c.value: n for c, n in slots.items()}


def _slots_from(record: Record | None) -> dict[TaskClass, int] | None:
    return None if record is None else {TaskClass(c): n for c, n in record.items()}


def objectives_record(objectives: Mapping[TaskClass, ClassObjective]) -> Record:
    return {c.value: o.model_dump(mode="json") for c, o in objectives.items()}


def objectives_from(record: Record) -> dict[TaskClass, ClassObjective]:
    return {TaskClass(c): ClassObjective.model_validate(o) for c, o in record.items()}


def _observation_record(observation: Observation | None) -> list[Any] | None:
    if observation is None:
        return None
    o = observation
    return [o.request_id, o.instance, o.ttft_s, o.output_tokens]


_RECORDED_FIELDS: dict[str, Callable[[Any], Record | None]] = {
    "quotas": _quotas_record,
    "peers": _peers_record,
    "slots": _slots_record,
}
"""The fields a host sets between calls, recorded when they change."""


PART = "part"
"""A record that carries more of the outcomes of the record before it (a release pass's,
a failed one's or a drain's)."""
PART_BYTES = 400_000
"""The most bytes of outcomes one record carries; more go on in ``PART`` records, which the
replay joins to it. Written whole, a pass that let out about 190 held requests at 256
instances (every outcome carries every instance's score: 5 KB each) passed the bus's
1,000,000 bytes, and the pool's replay stopped there; so did a drain of about 4,800 held
requests. 400 KB leaves room for a pass's snapshots beside them."""


@dataclass
class JournaledPipeline(Pipeline[Payload]):
    """A pipeline that writes every call that shapes its decisions to ``journal``, with
    its results; it decides exactly as ``Pipeline`` does. ``recipe``: what an auditor
    needs to build its admission and router afresh (the host's to say: policy names,
    parameters, seed, the pool's profile), written in the first record."""

    journal: Journal | None = None
    """Must not raise: the call it records has already changed the pipeline."""
    recipe: Record = field(default_factory=dict)
    _seq: int = field(default=0, init=False)
    _last_pass_snapshot: Record | None = field(default=None, init=False, repr=False)
    """The last snapshot a release pass recorded whole (``SAME_AS_LAST_PASS``)."""
    part_bytes: int = PART_BYTES
    """The most bytes of outcomes one release record carries (``PART_BYTES``)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self._write(
            START,
            recipe=self.recipe,
            objectives=objectives_record(self.objectives),
            quotas=_quotas_record(self.quotas),
            peers=_peers_record(self.peers),
            slots=_slots_record(self.slots),
        )

    def __setattr__(self, name: str, value: Any) -> None:
        encode = _RECORDED_FIELDS.get(name)
        watched = encode is not None and self.__dict__.get("journal") is not None
        if watched and value != getattr(self, name):
            assert encode is not None
            self._write(name, value=encode(value))
        object.__setattr__(self, name, value)

    def _write(self, call: str, **fields: Any) -> None:
        """Hand the record to the journal; its number is taken first, so that a record
        the journal fails to keep shows as a gap, never as a number used twice."""
        if self.journal is None:
            return
        seq, self._seq = self._seq, self._seq + 1
        self.journal({"seq": seq, "call": call} | fields)

    def arrive(
        self,
        request: AdmissionRequest,
        route: RouteRequest,
        payload: Payload,
        fleet: FleetSnapshot,
        now: float,
    ) -> Outcome[Payload]:
        outcome = super().arrive(request, route, payload, fleet, now)
        self._write(
            "arrive",
            now=now,
            request=_request_record(request),
            route=_route_record(route),
            fleet=snapshot_record(fleet),
            outcome=outcome_record(outcome),
        )
        return outcome

    def release(self, fleet: Callable[[], FleetSnapshot], now: float) -> list[Outcome[Payload]]:
        taken: list[FleetSnapshot] = []

        def recorded() -> FleetSnapshot:
            taken.append(fleet())
            return taken[-1]

        try:
            outcomes = super().release(recorded, now)
        except ReleaseFailed as failed:
            self._write_pass(now, taken, _failed_pass(failed))
            raise
        self._write_pass(now, taken, [outcome_record(o) for o in outcomes])
        return outcomes

    def _write_pass(self, now: float, taken: list[FleetSnapshot], result: Any) -> None:
        fleets = _distinct_snapshots(taken)
        whole = fleets["snapshots"]
        fleets["snapshots"] = [
            SAME_AS_LAST_PASS if s == self._last_pass_snapshot else s for s in whole
        ]
        if whole:
            self._last_pass_snapshot = whole[-1]
        self._write_in_parts("release", result, now=now, fleets=fleets)

    def _write_in_parts(self, call: str, result: list[Record] | Record, **fields: Any) -> None:
        """Write ``call``'s record with its ``result``: outcomes, or a failed pass's (its
        outcomes ``before``), in parts of at most ``part_bytes`` (``PART`` after the first)."""
        first, *rest = _parts(_outcomes_in(result), self.part_bytes)
        head = _with_outcomes(result, first)
        parts = {"parts": 1 + len(rest)} if rest else {}
        self._write(call, **fields, outcomes=head, **parts)
        for part in rest:
            self._write(PART, outcomes=part)

    def reroute(
        self, route: RouteRequest, fleet: FleetSnapshot, now: float, allowed: BoolArray | None
    ) -> Decision:
        decision = super().reroute(route, fleet, now, allowed)
        self._write(
            "reroute",
            now=now,
            route=_route_record(route),
            fleet=snapshot_record(fleet),
            allowed=_optional_array(allowed),
            decision=decision_record(decision),
        )
        return decision

    def first_token(self, request_id: str, now: float) -> None:
        super().first_token(request_id, now)
        self._write("first_token", request_id=request_id, now=now)

    def kv_events(self, instance: int, events: Sequence[KvEvent]) -> None:
        super().kv_events(instance, events)
        self._write("kv_events", instance=instance, events=[[b, s] for b, s in events])

    def left_instance(self, request_id: str) -> None:
        super().left_instance(request_id)
        self._write("left_instance", request_id=request_id)

    def finished(
        self,
        request_id: str,
        now: float,
        *,
        completed_tokens: int = 0,
        observation: Observation | None = None,
        cancelled: bool = False,
    ) -> None:
        super().finished(
            request_id,
            now,
            completed_tokens=completed_tokens,
            observation=observation,
            cancelled=cancelled,
        )
        self._write(
            "finished",
            request_id=request_id,
            now=now,
            completed_tokens=completed_tokens,
            observation=_observation_record(observation),
            cancelled=cancelled,
        )

    def withdraw(self, request_id: str) -> bool:
        withdrawn = super().withdraw(request_id)
        self._write("withdraw", request_id=request_id, withdrawn=withdrawn)
        return withdrawn

    def drain(self, reason: str) -> list[Outcome[Payload]]:
        outcomes = super().drain(reason)
        self._write_in_parts("drain", [outcome_record(o) for o in outcomes], reason=reason)
        return outcomes


SAME_AS_LAST_PASS = "same as the last pass"
"""Written for a release pass's snapshot equal to the last one a pass recorded whole: a
host passes every 50 ms while it holds a request, and a pool of 256 instances wrote 22 KB
a pass, most of them the same snapshot again (hundreds of KB a second for one held
request)."""


def _parts(outcomes: list[Record], budget: int) -> list[list[Record]]:
    """``outcomes`` in order, in parts of at most ``budget`` bytes of JSON each (an
    outcome larger than that alone in its part); one part, empty, for none."""
    parts: list[list[Record]] = [[]]
    size = 0
    for outcome in outcomes:
        length = len(json.dumps(outcome))
        if parts[-1] and size + length > budget:
            parts.append([])
            size = 0
        parts[-1].append(outcome)
        size += length
    return parts


def _distinct_snapshots(taken: list[FleetSnapshot]) -> Record:
    """The snapshots a release pass took, each written once (a host usually hands the
    same one to every dispatch of a pass), and the order it took them in."""
    distinct: list[FleetSnapshot] = []
    order = []
    for snapshot in taken:
        row = next((n for n, s in enumerate(distinct) if s is snapshot), None)
        if row is None:
            distinct.append(snapshot)
            row = len(distinct) - 1
        order.append(row)
    return {"snapshots": [snapshot_record(s) for s in distinct], "order": order}


@dataclass(frozen=True)
class Difference:
    """A recorded result that the replay did not reproduce."""

    seq: int
    call: str
    recorded: Any
    replayed: Any


@dataclass
class Replayed:
    """One journal's audit."""

    decisions: int = 0
    """Results compared: arrivals, release passes' outcomes, reroutes, withdrawals,
    drains."""
    differences: list[Difference] = field(default_factory=list)
    problem: str | None = None
    """Why the journal could not be replayed to its end (no first record, a gap)."""


def missing(expected: int, record: Record) -> str | None:
    """What is missing where ``record`` stands in place of record ``expected``."""
    if record["seq"] == expected:
        return None
    return f"record {expected} is missing (the next is {record['seq']})"


class _Diverged(Exception):
    """The replay asked for a snapshot the recorded call never took."""


def replay(records: Iterable[Record], build: Callable[[Record], Pipeline[str]]) -> Replayed:
    """Replay one pipeline's journal, in order: ``build`` makes the pipeline from the
    first record's recipe (its admission and router, fresh), then every call is made again
    and every result compared with the recorded one. A gap in the records ends the replay
    (the state after it is unknown), reported as the problem."""
    result = Replayed()
    pipeline: Pipeline[str] | None = None
    last_pass = _LastPass()
    in_parts = _InParts()
    for expected, record in enumerate(records):
        if (gap := missing(expected, record)) is not None:
            result.problem = gap
            break
        if pipeline is None:
            if record["call"] != START:
                result.problem = f"the journal begins with {record['call']!r}, not {START!r}"
                break
            pipeline = build(record)
            pipeline.objectives = objectives_from(record["objectives"])
            pipeline.quotas = _quotas_from(record["quotas"])
            pipeline.peers = _peers_from(record["peers"])
            pipeline.slots = _slots_from(record.get("slots"))
            continue
        try:
            whole = in_parts.whole(record)
        except _OutOfOrder as out_of_order:
            result.problem = str(out_of_order)
            break
        if whole is None:
            continue
        record = whole
        replayed = _call(pipeline, record, last_pass)
        if replayed is _NO_RESULT:
            continue
        result.decisions += 1
        recorded = record[_RESULT_FIELD[record["call"]]]
        if replayed != recorded:
            result.differences.append(Difference(record["seq"], record["call"], recorded, replayed))
    else:
        if pipeline is None:
            result.problem = "the journal is empty"
        else:
            result.problem = in_parts.unfinished()
    return result


_RESULT_FIELD = {
    "arrive": "outcome",
    "release": "outcomes",
    "reroute": "decision",
    "withdraw": "withdrawn",
    "drain": "outcomes",
}
_NO_RESULT = object()


class _OutOfOrder(Exception):
    """A ``PART`` record that continues no record, or a record amid another's parts."""


@dataclass
class _InParts:
    """A record written in parts (``PART``), gathered until whole."""

    first: Record | None = None
    left: int = 0

    def whole(self, record: Record) -> Record | None:
        """``record``, or the record whose last part it is; None while parts are to come."""
        if record["call"] == PART:
            if self.first is None:
                raise _OutOfOrder(f"record {record['seq']} continues no record")
            _outcomes_in(self.first["outcomes"]).extend(record["outcomes"])
            self.left -= 1
        elif self.first is not None:
            raise _OutOfOrder(
                f"record {record['seq']} comes amid record {self.first['seq']}'s parts"
            )
        elif record.get("parts", 1) > 1:
            result = record["outcomes"]
            copied = _with_outcomes(result, list(_outcomes_in(result)))  # to extend
            self.first, self.left = record | {"outcomes": copied}, record["parts"] - 1
        else:
            return record
        if self.left:
            return None
        whole, self.first = self.first, None
        return whole

    def unfinished(self) -> str | None:
        """What the journal lacks where it ended amid a record's parts."""
        if self.first is None:
            return None
        return f"the journal ends before {self.left} part(s) of record {self.first['seq']}"


def _outcomes_in(result: list[Record] | Record) -> list[Record]:
    """A record's outcomes, from its result: a failed pass's are those it decided
    ``before`` it failed."""
    return result if isinstance(result, list) else result["before"]


def _with_outcomes(result: list[Record] | Record, outcomes: list[Record]) -> list[Record] | Record:
    """``result`` with ``outcomes`` in place of its own (``_outcomes_in``)."""
    return outcomes if isinstance(result, list) else result | {"before": outcomes}


@dataclass
class _LastPass:
    """The last snapshot a replayed release pass read whole."""

    snapshot: Record | None = None

    def whole(self, snapshots: list[Record | str]) -> list[Record]:
        """A pass's snapshots, each written as ``SAME_AS_LAST_PASS`` made whole."""
        out = []
        for snapshot in snapshots:
            if snapshot == SAME_AS_LAST_PASS:
                if self.snapshot is None:
                    raise ValueError("a release pass refers to a pass before it that has none")
                snapshot = self.snapshot
            assert isinstance(snapshot, dict)
            out.append(snapshot)
        if out:
            self.snapshot = out[-1]
        return out


def _call(pipeline: Pipeline[str], record: Record, last_pass: _LastPass) -> Any:
    """Make the recorded call on ``pipeline``; its result as recorded, or ``_NO_RESULT``
    for a call that decides nothing."""
    call, now = record["call"], record.get("now", 0.0)
    if call == "arrive":
        request = _request_from(record["request"])
        route, fleet = _route_from(record["route"]), snapshot_from(record["fleet"])
        return outcome_record(pipeline.arrive(request, route, request.request_id, fleet, now))
    if call == "release":
        return _replayed_release(pipeline, record, now, last_pass)
    if call == "reroute":
        allowed = record["allowed"]
        decision = pipeline.reroute(
            _route_from(record["route"]),
            snapshot_from(record["fleet"]),
            now,
            None if allowed is None else np.array(allowed, dtype=np.bool_),
        )
        return decision_record(decision)
    if call == "withdraw":
        return pipeline.withdraw(record["request_id"])
    if call == "drain":
        return [outcome_record(o) for o in pipeline.drain(record["reason"])]
    _learn(pipeline, record)
    return _NO_RESULT


def _replayed_release(
    pipeline: Pipeline[str], record: Record, now: float, last_pass: _LastPass
) -> Any:
    taken = record["fleets"]
    snapshots = [snapshot_from(s) for s in last_pass.whole(taken["snapshots"])]
    order = iter(taken["order"])

    def recorded() -> FleetSnapshot:
        row = next(order, None)
        if row is None:
            raise _Diverged
        snapshot: FleetSnapshot = snapshots[row]
        return snapshot

    try:
        return [outcome_record(o) for o in pipeline.release(recorded, now)]
    except ReleaseFailed as failed:
        if isinstance(failed.__cause__, _Diverged):
            return "asked for more snapshots than the recorded pass took"
        return _failed_pass(failed)


def _failed_pass(failed: ReleaseFailed[Any]) -> Record:
    """A failed pass's result: what it decided before, and the kind of its error."""
    return {
        "failed": type(failed.__cause__).__name__,
        "before": [outcome_record(o) for o in failed.outcomes],
    }


def _learn(pipeline: Pipeline[str], record: Record) -> None:
    """The calls that only tell the pipeline something: first tokens, ends, settings."""
    call = record["call"]
    if call == "first_token":
        pipeline.first_token(record["request_id"], record["now"])
    elif call == "kv_events":
        pipeline.kv_events(record["instance"], [(b, s) for b, s in record["events"]])
    elif call == "left_instance":
        pipeline.left_instance(record["request_id"])
    elif call == "finished":
        seen = record["observation"]
        pipeline.finished(
            record["request_id"],
            record["now"],
            completed_tokens=record["completed_tokens"],
            observation=None if seen is None else Observation(*seen),
            cancelled=record["cancelled"],
        )
    elif call == "quotas":
        pipeline.quotas = _quotas_from(record["value"])
    elif call == "peers":
        pipeline.peers = _peers_from(record["value"])
    elif call == "slots":
        pipeline.slots = _slots_from(record["value"])
    else:
        raise ValueError(f"unknown call {call!r} in a pipeline's journal")

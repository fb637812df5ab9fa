"""The replay: a pipeline's journal made again, call by call, and every result that comes
out different (``tokenfleet audit``)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from control.journal.records import (
    Record,
    decision_record,
    objectives_from,
    outcome_record,
    peers_from,
    quotas_from,
    request_from,
    route_from,
    slots_from,
    snapshot_from,
)
from control.journal.writer import (
    PART,
    SAME_AS_LAST_PASS,
    START,
    failed_pass,
    outcomes_in,
    with_outcomes,
)
from control.pipeline import Pipeline, ReleaseFailed
from control.routing.snapshot import FleetSnapshot, Observation


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
            pipeline.quotas = quotas_from(record["quotas"])
            pipeline.peers = peers_from(record["peers"])
            pipeline.slots = slots_from(record.get("slots"))
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
            outcomes_in(self.first["outcomes"]).extend(record["outcomes"])
            self.left -= 1
        elif self.first is not None:
            raise _OutOfOrder(
                f"record {record['seq']} comes amid record {self.first['seq']}'s parts"
            )
        elif record.get("parts", 1) > 1:
            result = record["outcomes"]
            copied = with_outcomes(result, list(outcomes_in(result)))  # to extend
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
        request = request_from(record["request"])
        route, fleet = route_from(record["route"]), snapshot_from(record["fleet"])
        return outcome_record(pipeline.arrive(request, route, request.request_id, fleet, now))
    if call == "release":
        return _replayed_release(pipeline, record, now, last_pass)
    if call == "reroute":
        allowed = record["allowed"]
        decision = pipeline.reroute(
            route_from(record["route"]),
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
        return failed_pass(failed)


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
        pipeline.quotas = quotas_from(record["value"])
    elif call == "peers":
        pipeline.peers = peers_from(record["value"])
    elif call == "slots":
        pipeline.slots = slots_from(record["value"])
    else:
        raise ValueError(f"unknown call {call!r} in a pipeline's journal")

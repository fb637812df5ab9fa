"""The writer: ``JournaledPipeline``, a pipeline that writes every call that shapes its
decisions, with its results, to a journal, in records (a long result in parts)."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from control.admission.request import AdmissionRequest
from control.journal.records import (
    Record,
    decision_record,
    objectives_record,
    observation_record,
    optional_array,
    outcome_record,
    peers_record,
    quotas_record,
    request_record,
    route_record,
    slots_record,
    snapshot_record,
)
from control.pipeline import Outcome, Payload, Pipeline, ReleaseFailed
from control.routing.snapshot import (
    BoolArray,
    Decision,
    FleetSnapshot,
    KvEvent,
    Observation,
    RouteRequest,
)

Journal = Callable[[Record], None]
"""Where a journaled pipeline writes its records, one call each, in order."""

START = "start"
"""The call of a journal's first record: the recipe the pipeline was built from, and its
objectives, quotas, peers' load and slots at that moment."""


_RECORDED_FIELDS: dict[str, Callable[[Any], Record | None]] = {
    "quotas": quotas_record,
    "peers": peers_record,
    "slots": slots_record,
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
            quotas=quotas_record(self.quotas),
            peers=peers_record(self.peers),
            slots=slots_record(self.slots),
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
            request=request_record(request),
            route=route_record(route),
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
            self._write_pass(now, taken, failed_pass(failed))
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
        first, *rest = _parts(outcomes_in(result), self.part_bytes)
        head = with_outcomes(result, first)
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
            route=route_record(route),
            fleet=snapshot_record(fleet),
            allowed=optional_array(allowed),
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
            observation=observation_record(observation),
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


def outcomes_in(result: list[Record] | Record) -> list[Record]:
    """A record's outcomes, from its result: a failed pass's are those it decided
    ``before`` it failed."""
    return result if isinstance(result, list) else result["before"]


def with_outcomes(result: list[Record] | Record, outcomes: list[Record]) -> list[Record] | Record:
    """``result`` with ``outcomes`` in place of its own (``outcomes_in``)."""
    return outcomes if isinstance(result, list) else result | {"before": outcomes}


def failed_pass(failed: ReleaseFailed[Any]) -> Record:
    """A failed pass's result: what it decided before, and the kind of its error."""
    return {
        "failed": type(failed.__cause__).__name__,
        "before": [outcome_record(o) for o in failed.outcomes],
    }

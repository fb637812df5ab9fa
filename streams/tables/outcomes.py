"""Joining a request's lifecycle events into its outcome, under at-least-once delivery.

Events of one request share its key (``request_id``), so one partition sees all of them,
in publication order per producer but not across producers (the gateway publishes the
start, another gateway or a retry may publish the end). The join therefore:

- changes nothing for an ``event_id`` it has already seen (a redelivery), but releases
  again what the request released before: a worker killed between writing the join state
  to its changelog and sending the outcomes it released would otherwise, replaying the
  event, find it seen and never send them. The tables count each outcome once, by its id;
- holds an end (completed, failed, cancelled, or refused by a DC's admission, which
  counts as failed there) until the request's arrival and its DC are known, then
  releases it; nothing is dropped for arriving early. A refusal before any DC took the
  request (its quota at the door, or no DC may run it) belongs to no DC's table. A
  cancellation on no instance names the DC whose pool held the request when its client
  left, a miss of that DC even where an earlier DC had taken it (a failure's DC may be
  one the request then left);
- marks a second completion of one request as a repeated execution;
- when a request is forgotten with ends still held (its start came later than a window
  and its grace, or never), counts them as late events (``unmatched``), not as nothing.

State is a plain JSON-able dict, so a Faust table can store it as it is.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from schemas import Envelope
from schemas.lifecycle import (
    CancelReason,
    RequestArrived,
    RequestCancelled,
    RequestCompleted,
    RequestFailed,
    RequestRejected,
    RequestRetried,
    RequestRouted,
)

log = logging.getLogger(__name__)

RequestState = dict[str, Any]
SEEN_LIMIT = 64
"""Event ids remembered per request; a request has far fewer events."""
OPEN_REQUEST_S = 3600.0
"""How long the join keeps a request that arrived and has not ended without hearing of it
(its deadline and a window's grace, where that is later): an hour, longer than an answer
runs (32,000 tokens at 50 ms a token take 27 minutes). Its first token and queueing
events do not touch its state, so a shorter horizon would forget a long answer while it
runs, and count its completion as a late event only."""


class OutcomeKind(StrEnum):
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"
    TIMED_OUT = "timed_out"


@dataclass(frozen=True)
class Outcome:
    """How one execution of a request ended, with what the tables need of its request."""

    request_id: str
    event_id: str
    """The id of the event that ended this execution: the outcome's own identity."""
    ts: float
    dc: str
    model: str
    task_class: str
    tenant: str
    kind: OutcomeKind
    input_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    ttft_s: float = 0.0
    tpot_s: float = 0.0
    e2e_s: float = 0.0
    deadline_s: float | None = None
    streamed: bool = True
    """False: a whole answer, judged on its end (``ClassObjective.met``)."""
    retries: int = 0
    repeated: bool = False
    unmatched: bool = False
    """An end whose request's start never came: counted as a late event only, and ``ts`` is
    when the request was given up."""
    source_region: str = ""
    """The region whose edge took the request ('': not known, as for an end whose start
    never came, or one joined by a worker from before 2026-12-05)."""

    def to_dict(self) -> dict[str, Any]:
        """Its fields as they are (all plain values): ``asdict`` took 29 µs an outcome,
        most of it asking the ``kind`` enum for dataclass fields, 0.8 µs this way."""
        return dict(self.__dict__)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Outcome:
        return cls(**{**data, "kind": OutcomeKind(data["kind"])})


def new_state() -> RequestState:
    return {
        "seen": [],
        "arrived": None,
        "dc": None,
        "retries": 0,
        "held": [],
        "ended": 0,
        "last_ts": float("-inf"),
        "released": [],
    }


_LIFECYCLE = (
    RequestArrived,
    RequestRouted,
    RequestRetried,
    RequestCompleted,
    RequestFailed,
    RequestCancelled,
    RequestRejected,
)


def request_of(envelope: Envelope) -> str | None:
    """The request a lifecycle event is about; None for any other event."""
    payload = envelope.payload
    return payload.request_id if isinstance(payload, _LIFECYCLE) else None


def apply(state: RequestState, envelope: Envelope) -> list[Outcome]:
    """Fold one event into its request's ``state`` (in place); return the outcomes it
    releases. A redelivered event changes nothing and returns every outcome released
    so far."""
    if envelope.event_id in state["seen"]:
        return [Outcome.from_dict(released) for released in state["released"]]
    state["seen"] = [*state["seen"][-(SEEN_LIMIT - 1) :], envelope.event_id]
    state["last_ts"] = max(state["last_ts"], envelope.ts)
    payload = envelope.payload
    if isinstance(payload, RequestArrived):
        state["arrived"] = {
            "model": payload.model,
            "task_class": payload.task_class.value,
            "tenant": payload.tenant,
            "source_region": payload.source_region,
            "deadline_s": payload.deadline_s,
        }
    elif isinstance(payload, RequestRouted):
        state["dc"] = payload.dc
    elif isinstance(payload, RequestRetried):
        state["retries"] += 1
    elif isinstance(payload, RequestCompleted | RequestFailed | RequestCancelled):
        if isinstance(payload, RequestCompleted):
            state["dc"] = state["dc"] or payload.dc
        elif isinstance(payload, RequestCancelled) and payload.instance_id is None and payload.dc:
            state["dc"] = payload.dc  # left while that DC's pool held it, past any DC before
        end = {"ts": envelope.ts, "event_id": envelope.event_id}
        state["held"].append(end | payload.model_dump(mode="json"))
    elif isinstance(payload, RequestRejected) and payload.dc is not None:
        state["dc"] = payload.dc  # where it ended, past any DC that failed it before
        end = {"ts": envelope.ts, "event_id": envelope.event_id, "refused": True}
        state["held"].append(end | payload.model_dump(mode="json"))
    elif isinstance(payload, RequestRejected):  # ended before any DC: in no DC's table
        state["closed"] = True
    return _release(state)


def _release(state: RequestState) -> list[Outcome]:
    arrived, dc = state["arrived"], state["dc"]
    if arrived is None or dc is None or not state["held"]:
        return []
    outcomes = []
    for end in sorted(state["held"], key=lambda e: e["ts"]):
        completed = _kind(end) is OutcomeKind.COMPLETED
        outcomes.append(
            _outcome(
                end,
                dc,
                arrived,
                ts=end["ts"],
                input_tokens=end.get("input_tokens", 0),
                cached_tokens=end.get("cached_tokens", 0),
                output_tokens=end.get("output_tokens", 0),
                ttft_s=end.get("ttft_s", 0.0),
                tpot_s=end.get("tpot_s", 0.0),
                e2e_s=end.get("e2e_s", 0.0),
                deadline_s=arrived["deadline_s"],
                streamed=end.get("streamed", True),
                retries=state["retries"],
                repeated=completed and state["ended"] > 0,
            )
        )
        state["ended"] += completed
    state["held"] = []
    released = state["released"] + [outcome.to_dict() for outcome in outcomes]
    state["released"] = released[-SEEN_LIMIT:]
    return outcomes


def quiet_limit_s(state: RequestState, settled_s: float) -> float:
    """How long ``state`` may go without an event before it is forgotten: ``settled_s`` (a
    window and its grace) once its end came (a refusal before any DC included), or while
    its start has not; while it may still run (it arrived, and no end came),
    ``OPEN_REQUEST_S`` or its deadline and ``settled_s``, whichever is later (batch work
    may wait in its pool until then)."""
    arrived = state["arrived"]
    if arrived is None or state["held"] or state["released"] or state.get("closed"):
        return settled_s
    return max(OPEN_REQUEST_S, (arrived["deadline_s"] or 0.0) + settled_s)


def unmatched(state: RequestState, at: float) -> list[Outcome]:
    """The ends a forgotten request still holds, as late events counted at ``at``, the
    time it is forgotten: the windows of their own times may be long gone. An end counts
    if it and its request name a DC and a class between them (a completion names both); an
    end that names no DC, of a request never seen routed, belongs to no DC's table, and
    is logged as left out instead."""
    arrived = state["arrived"] or {}
    counted = []
    for end in state["held"]:
        dc = state["dc"] or end.get("dc")
        if dc and (arrived or end.get("task_class")):
            counted.append(_outcome(end, dc, arrived, ts=at, unmatched=True))
        else:
            log.warning(
                "event %s ended request %s, which no event placed in a DC or class: "
                "left out of every table",
                end["event_id"],
                end["request_id"],
            )
    return counted


def _outcome(end: dict[str, Any], dc: str, arrived: dict[str, Any], **counted: Any) -> Outcome:
    """The outcome of one held ``end``; the class and tenant come from the request's
    arrival or, where it never came, from the end itself (a completion names them)."""
    return Outcome(
        request_id=end["request_id"],
        event_id=end["event_id"],
        dc=dc,
        model=arrived.get("model", ""),
        task_class=arrived.get("task_class") or end["task_class"],
        tenant=arrived.get("tenant") or end.get("tenant", ""),
        source_region=arrived.get("source_region", ""),
        kind=_kind(end),
        **counted,
    )


def _kind(end: dict[str, Any]) -> OutcomeKind:
    if end.get("refused"):  # as the simulator counts a refusal (``sim.control_loop``)
        return OutcomeKind.FAILED
    if "ttft_s" in end:
        return OutcomeKind.COMPLETED
    if "error" in end:
        return OutcomeKind.FAILED
    if end.get("reason") in (CancelReason.TIMEOUT, CancelReason.DEADLINE):
        return OutcomeKind.TIMED_OUT
    return OutcomeKind.CANCELLED

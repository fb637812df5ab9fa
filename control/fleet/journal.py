"""The journal of a gateway's DC choices, and their audit: a DC policy is pure, so a
decision's record (the request, every DC's view, the round trips and the answer) replays
it alone (``tokenfleet audit``)."""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from control.fleet.registry import DcPolicy
from control.fleet.view import DataCenterState, DcDecision, DcRequest, FleetState
from control.journal import Difference, Record, json_number

CHOOSE_DC = "choose_dc"
"""The call of a DC decision's record, in a gateway's DC journal."""


def dc_choice_record(request: DcRequest, fleet: FleetState, decision: DcDecision) -> Record:
    """A DC decision with its inputs: the DC policy is pure, so one record replays it."""
    return {
        "call": CHOOSE_DC,
        "request": {
            "request_id": request.request_id,
            "source_region": request.source_region,
            "source_dc": request.source_dc,
            "input_tokens": request.input_tokens,
            "tenant_dcs": None if request.tenant_dcs is None else sorted(request.tenant_dcs),
            "residency": sorted(request.residency),
            "version": request.version,
            "draw": request.draw,
        },
        "dcs": [_dc_record(dc) for dc in fleet.dcs],
        "round_trips_s": [[a, b, rtt] for (a, b), rtt in fleet.round_trips_s.items()],
        "decision": _dc_decision_record(decision),
    }


_DC_FLOATS = frozenset(
    {
        "utilisation",
        "predicted_wait_s",
        "weight",
        "class_room",
        "inflight_requests",
        "kv_use",
        "queue",
    }
)


def _dc_record(dc: DataCenterState) -> Record:
    record: Record = {}
    for f in fields(dc):
        value = getattr(dc, f.name)
        record[f.name] = json_number(value) if f.name in _DC_FLOATS and value is not None else value
    record["ready_versions"] = sorted(dc.ready_versions)
    record["versions"] = sorted(dc.versions)
    return record


def _dc_from(record: Record) -> DataCenterState:
    values: dict[str, Any] = {
        k: float(v) if k in _DC_FLOATS and v is not None else v for k, v in record.items()
    }
    values["ready_versions"] = frozenset(record["ready_versions"])
    values["versions"] = frozenset(record["versions"])
    return DataCenterState(**values)


def _dc_decision_record(decision: DcDecision) -> Record:
    return {
        "policy": decision.policy,
        "order": list(decision.order),
        "excluded": dict(decision.excluded),
        "costs": {
            dc: {part: json_number(value) for part, value in parts.items()}
            for dc, parts in decision.costs.items()
        },
    }


def replay_dc_choice(record: Record, policy: DcPolicy) -> Difference | None:
    """Make a recorded DC decision again with ``policy``; the difference, if any."""
    asked = record["request"]
    tenant_dcs = asked["tenant_dcs"]
    request = DcRequest(
        asked["request_id"],
        asked["source_region"],
        asked["source_dc"],
        asked["input_tokens"],
        None if tenant_dcs is None else frozenset(tenant_dcs),
        frozenset(asked["residency"]),
        asked["version"],
        asked["draw"],
    )
    dcs = tuple(_dc_from(d) for d in record["dcs"])
    fleet = FleetState(dcs, {(a, b): rtt for a, b, rtt in record["round_trips_s"]})
    replayed = _dc_decision_record(policy.choose(request, fleet))
    if replayed == record["decision"]:
        return None
    return Difference(record["seq"], CHOOSE_DC, record["decision"], replayed)

"""The record codec: snapshots, requests, routes, decisions, outcomes, quotas, peers'
load, slots, objectives and observations as JSON-able records, and back.

A record is plain JSON: floats that JSON cannot carry (infinities, NaN: an instance never
seen streaming, an ineligible candidate's score) are written as the strings ``"inf"``,
``"-inf"`` and ``"nan"``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from control.admission.request import AdmissionRequest
from control.admission.view import AdmissionDecision
from control.pipeline import ClassLoad, Outcome
from control.routing.snapshot import (
    DEFAULT_BLOCK_SIZE,
    SNAPSHOT_ARRAYS,
    Decision,
    FleetSnapshot,
    Observation,
    RouteRequest,
)
from schemas.base import TaskClass
from schemas.control import ClassQuota
from schemas.objectives import ClassObjective

Record = dict[str, Any]


def json_number(value: float) -> float | str:
    return value if math.isfinite(value) else str(value)


def _optional_number(value: float | None) -> float | str | None:
    return None if value is None else json_number(value)


def _array(values: np.ndarray) -> list[Any]:
    if values.dtype.kind == "f":
        return [json_number(v) for v in values.tolist()]
    return list(values.tolist())


def optional_array(values: np.ndarray | None) -> list[Any] | None:
    return None if values is None else _array(values)


def _floats(values: Sequence[Any]) -> np.ndarray:
    return np.array([float(v) for v in values], dtype=np.float64)


def snapshot_record(fleet: FleetSnapshot) -> Record:
    return {"ids": list(fleet.instance_ids)} | {
        name: _array(getattr(fleet, name)) for name in SNAPSHOT_ARRAYS
    }


def snapshot_from(record: Record) -> FleetSnapshot:
    unknown = [DEFAULT_BLOCK_SIZE] * len(record["ids"])
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
        # not in the journals written before 2026-12-06
        np.array(record.get("kv_block_size", unknown), dtype=np.int64),
    )


def route_record(route: RouteRequest) -> Record:
    return {
        "request_id": route.request_id,
        "input_tokens": route.input_tokens,
        "output_budget": route.output_budget,
        "prefix_blocks": list(route.prefix_blocks),
        "task_class": route.task_class,
        "known_matches": optional_array(route.known_matches),
    }


def route_from(record: Record) -> RouteRequest:
    matches = record["known_matches"]
    return RouteRequest(
        record["request_id"],
        record["input_tokens"],
        record["output_budget"],
        tuple(record["prefix_blocks"]),
        record["task_class"],
        None if matches is None else np.array(matches, dtype=np.int64),
    )


def request_record(request: AdmissionRequest) -> Record:
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


def request_from(record: Record) -> AdmissionRequest:
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
        "allowed": optional_array(decision.allowed),
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


def quotas_record(quotas: Mapping[TaskClass, ClassQuota]) -> Record:
    return {c.value: q.model_dump(mode="json") for c, q in quotas.items()}


def quotas_from(record: Record) -> dict[TaskClass, ClassQuota]:
    return {TaskClass(c): ClassQuota.model_validate(q) for c, q in record.items()}


def peers_record(peers: Mapping[TaskClass, ClassLoad]) -> Record:
    return {
        c.value: [p.inflight, p.decoding, p.held, p.drained_per_s, p.head_key]
        for c, p in peers.items()
    }


def peers_from(record: Record) -> dict[TaskClass, ClassLoad]:
    return {TaskClass(c): ClassLoad(*load) for c, load in record.items()}


def slots_record(slots: Mapping[TaskClass, int] | None) -> Record | None:
    return None if slots is None else {c.value: n for c, n in slots.items()}


def slots_from(record: Record | None) -> dict[TaskClass, int] | None:
    return None if record is None else {TaskClass(c): n for c, n in record.items()}


def objectives_record(objectives: Mapping[TaskClass, ClassObjective]) -> Record:
    return {c.value: o.model_dump(mode="json") for c, o in objectives.items()}


def objectives_from(record: Record) -> dict[TaskClass, ClassObjective]:
    return {TaskClass(c): ClassObjective.model_validate(o) for c, o in record.items()}


def observation_record(observation: Observation | None) -> list[Any] | None:
    if observation is None:
        return None
    o = observation
    return [o.request_id, o.instance, o.ttft_s, o.output_tokens]

"""Admission on the live path: the gateway hosts ``control.pipeline.Pipeline``, one per
model and DC, as the simulator does.

A request the policy holds waits here, on a future, until a release pass lets it go
(routed), its hold runs out (503), its client leaves (withdrawn from its pool) or the
gateway stops (503: a held request is always answered). Release passes run after each
first token and end, when capacity frees, and every ``tick_s`` besides (holds that run
out, policies that pace their releases). One pass decides against one snapshot of the
pool: the router's own count of what it sent keeps a pass's dispatches apart, as it does
a burst's arrivals.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from control.admission.registry import Admission
from control.admission.request import PRIORITY, AdmissionRequest
from control.admission.view import Verdict
from control.pipeline import Outcome, Pipeline
from control.routing import Decision, FleetSnapshot, Router, RouteRequest
from control.routing.snapshot import BoolArray
from gateway.inbound import Inbound
from gateway.metrics import GatewayMetrics
from schemas.base import TaskClass
from schemas.control import AdmissionQuotas, ClassQuota
from schemas.objectives import Objectives
from schemas.openai_api import ApiError

log = logging.getLogger(__name__)

Held = asyncio.Future["Outcome[Held]"]
Key = tuple[str, str]
"""A pipeline's model and DC."""

SHUTDOWN = "shutdown"
"""The reason a held request is answered when the gateway stops."""
REFUSED_RETRY_AFTER_S = 1.0
"""What a refusal tells the client to wait when its policy names no time."""


class GatewayAdmission:
    def __init__(
        self,
        make_admission: Callable[[str], Admission],
        router_for: Callable[[str, str], Router],
        snapshot_for: Callable[[str, str], Awaitable[FleetSnapshot]],
        objectives: Objectives,
        metrics: GatewayMetrics,
        tick_s: float = 0.05,
    ) -> None:
        """``snapshot_for(model, dc)``: the pool's snapshot now, for a release pass."""
        self._make_admission = make_admission
        self._router_for = router_for
        self._snapshot_for = snapshot_for
        self.objectives = objectives
        self.metrics = metrics
        self.tick_s = tick_s
        self._pipelines: dict[Key, Pipeline[Held]] = {}
        self._capacity_freed = asyncio.Event()
        self._closing = False

    def pipeline(self, model: str, dc: str) -> Pipeline[Held]:
        key = (model, dc)
        if key not in self._pipelines:
            self._pipelines[key] = Pipeline(
                self._make_admission(model), self._router_for(model, dc), self.objectives.classes
            )
        return self._pipelines[key]

    def arrive(
        self,
        inbound: Inbound,
        dc: str,
        route: RouteRequest,
        snapshot: FleetSnapshot,
        arrived: float,
        quotas: AdmissionQuotas | None,
    ) -> Admitted | Waiting:
        """The router's decision for a request admission lets start now, or its place in
        its pool; ApiError(429, with ``Retry-After``) for one refused."""
        pipeline = self.pipeline(inbound.model.name, dc)
        pipeline.quotas = _class_quotas(quotas)
        answer: Held = asyncio.get_running_loop().create_future()
        request = _admitting(inbound, arrived, self.objectives)
        outcome = pipeline.arrive(request, route, answer, snapshot, time.monotonic())
        self._count(outcome, inbound.model.name, dc)
        if outcome.admission.verdict is Verdict.HOLD:
            if self._closing:
                self.answer_held(SHUTDOWN)
            return Waiting(self, inbound.model.name, dc, inbound.request_id, answer)
        return _routed(outcome, waited=False)

    def upstream_body(self, inbound: Inbound, dc: str) -> bytes:
        """The body to send the instance: as the client sent it, but where the engines
        schedule by priority (vLLM's ``--scheduling-policy priority``), with the class's
        ``priority`` unless the client set one."""
        if inbound.by_load:  # never admitted: no pipeline of its own
            return inbound.body
        admission = self.pipeline(inbound.model.name, dc).admission
        if admission.engine_scheduling != "priority":
            return inbound.body
        body = json.loads(inbound.body)
        body.setdefault("priority", PRIORITY[inbound.task_class])
        return json.dumps(body).encode()

    def first_token(self, model: str, dc: str, request_id: str) -> None:
        self.pipeline(model, dc).first_token(request_id, time.monotonic())
        self._capacity_freed.set()

    def finished(self, model: str, dc: str, request_id: str, completed_tokens: int = 0) -> None:
        self.pipeline(model, dc).finished(
            request_id, time.monotonic(), completed_tokens=completed_tokens
        )
        self._capacity_freed.set()

    async def run(self) -> None:
        """Release passes until cancelled; every held request is answered on the way out."""
        try:
            while True:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._capacity_freed.wait(), self.tick_s)
                self._capacity_freed.clear()
                try:
                    await self.release_pass()
                except Exception:  # a bug in one pass must not leave every hold waiting
                    log.exception("admission release pass failed")
        finally:
            self.answer_held(SHUTDOWN)

    def close(self) -> None:
        """The gateway is stopping: answer every held request now, and any held later."""
        self._closing = True
        self.answer_held(SHUTDOWN)

    async def release_pass(self) -> None:
        """Offer each pipeline's pools the capacity there is now."""
        for (model, dc), pipeline in list(self._pipelines.items()):
            if not len(pipeline.pools):
                continue
            snapshot = await self._snapshot_for(model, dc)
            for outcome in pipeline.release(_always(snapshot), time.monotonic()):
                self._count(outcome, model, dc)
                _answer(outcome)

    def answer_held(self, reason: str) -> None:
        """Refuse every held request now (the gateway is stopping)."""
        for (model, dc), pipeline in self._pipelines.items():
            for outcome in pipeline.drain(reason):
                self._count(outcome, model, dc)
                _answer(outcome)

    def _count(self, outcome: Outcome[Held], model: str, dc: str) -> None:
        decision = outcome.admission
        self.metrics.admissions.labels(
            outcome.request.task_class.value, decision.verdict.value, decision.reason
        ).inc()
        self.pool_depths(model, dc)

    def pool_depths(self, model: str, dc: str) -> None:
        pools = self.pipeline(model, dc).pools
        for task_class in TaskClass:
            depth = pools.state(task_class, time.monotonic()).depth
            self.metrics.pool_depth.labels(model, dc, task_class.value).set(depth)


@dataclass(frozen=True)
class Waiting:
    """A request held in its pool."""

    host: GatewayAdmission
    model: str
    dc: str
    request_id: str
    answer: Held

    async def decision(self) -> Admitted:
        """The router's decision once the pool lets the request go; ApiError(503) when it
        can no longer meet its objective. A client that leaves meanwhile leaves its pool."""
        try:
            outcome = await self.answer
        except asyncio.CancelledError:
            pipeline = self.host.pipeline(self.model, self.dc)
            if not pipeline.withdraw(self.request_id):  # released as its client left
                pipeline.finished(self.request_id, time.monotonic())
            self.host.pool_depths(self.model, self.dc)
            raise
        return _routed(outcome, waited=True)


def _always(snapshot: FleetSnapshot) -> Callable[[], FleetSnapshot]:
    return lambda: snapshot


def _answer(outcome: Outcome[Held]) -> None:
    if not outcome.payload.done():  # its client may have left meanwhile
        outcome.payload.set_result(outcome)


@dataclass(frozen=True)
class Admitted:
    """A request admission let start: the router's decision, and the instances admission
    allowed (None: every ready one), which a decision made again must keep to."""

    route: Decision
    allowed: BoolArray | None


def _routed(outcome: Outcome[Held], *, waited: bool) -> Admitted:
    if outcome.admission.verdict is Verdict.REJECT:
        raise _refusal(outcome, waited=waited)
    assert outcome.route is not None
    return Admitted(outcome.route, outcome.admission.allowed)


def _refusal(outcome: Outcome[Held], *, waited: bool) -> ApiError:
    """429 for a request refused at the door, with ``Retry-After``; 503 for one that waited
    in its pool and can no longer meet its objective, or that the gateway's stop answered
    (that one may come straight back, to another replica)."""
    decision = outcome.admission
    task_class = outcome.request.task_class.value
    if decision.reason == SHUTDOWN:
        message = "The gateway is stopping; send the request again."
        return ApiError(503, message, retry_after_s=REFUSED_RETRY_AFTER_S)
    if waited:
        message = (
            f"This {task_class} request waited for capacity and can no longer meet its "
            f"objective ({decision.reason})."
        )
        return ApiError(503, message)
    message = (
        f"The fleet cannot take this {task_class} request now ({decision.reason}); retry later."
    )
    return ApiError(429, message, retry_after_s=decision.retry_after_s or REFUSED_RETRY_AFTER_S)


def _admitting(inbound: Inbound, arrived: float, objectives: Objectives) -> AdmissionRequest:
    deadline = inbound.deadline_s
    return AdmissionRequest(
        inbound.request_id,
        inbound.task_class,
        inbound.tenant.name,
        inbound.input_tokens,
        inbound.client_cap,
        arrived,
        None if deadline is None else arrived + deadline,
        objectives.of(inbound.task_class, inbound.tenant.name),
    )


def _class_quotas(quotas: AdmissionQuotas | None) -> dict[TaskClass, ClassQuota]:
    """The class-wide quotas (a tenant's own quota is its token bucket's, at the door)."""
    if quotas is None:
        return {}
    return {q.task_class: q for q in quotas.quotas if q.tenant is None}

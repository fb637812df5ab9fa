"""SLOMax: admit by class, hold in class pools, reserve interactive capacity, and reject
early what cannot meet its objective.

Each mechanism can be switched off (``SLOMaxParams``) so the benchmark can measure what
it adds. Requests that are running are never preempted: SLOMax decides only what starts.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated

from pydantic import Field

from control.admission.request import LONG_DOCUMENT_TOKENS, AdmissionRequest
from control.admission.view import (
    EXPIRED,
    MAX_HOLD,
    PREFILL_WAIT,
    SLOT_WAIT,
    AdmissionDecision,
    AdmissionView,
    Verdict,
)

if TYPE_CHECKING:
    from control.admission.registry import EngineScheduling
from control.routing.snapshot import BoolArray, PoolModel
from schemas.base import TaskClass
from schemas.control import ClassQuota
from schemas.objectives import ClassObjective


@dataclass(frozen=True)
class SLOMaxParams:
    class_pools: bool = True
    """Hold what cannot start now in its class's pool (off: reject it)."""
    early_rejection: bool = True
    """Reject a request whose predicted TTFT (best instance, plus its pool's expected wait)
    misses its class objective, or that would start after its deadline. A request that
    would miss its first-token objective even on an idle instance is not rejected for it
    (``_attainable``)."""
    interactive_reservation: bool = True
    """Start long documents and batch work only while the fleet's KV use, taken and
    promised (``AdmissionView.kv_use``), leaves ``reserved_kv_share`` free for
    interactive traffic, only on instances whose running
    and waiting sequences leave the same share of the engine's ``max_num_seqs`` (where
    the pool's model is known), and batch work only on instances with nothing waiting."""
    interference_bound: bool = True
    """A long prompt (``LONG_DOCUMENT_TOKENS`` or more) goes only to an instance with less
    than ``long_prefill_cap_tokens`` of prompt pending prefill, so a long document's
    prefill never stacks on another's."""
    long_documents_per_instance: Annotated[float, Field(gt=0)] = 4.0
    """Long documents in flight at once, per ready instance, until a quota names a number
    (its ``max_concurrency``, which the controller sets from goodput): their prefills, and
    the long contexts their decoding steps read, slow the chats beside them. Four, to
    start: on the 30-minute mixed workload at 16 instances (``tokenfleet bench admission``,
    SLOMax alone, before ``91da74f`` made each of the controller's steps move the limit by
    a request at least), starting at four gave a pooled goodput of 17,935 tokens/s and 91.2 %
    compliance (34.5 % of long documents in time); with long documents also kept to
    instances where nothing waits, 17,900 and 91.1 %, and starting at two as well, 17,822
    and 91.4 % (31.3 %). A limit on long documents awaiting their first token instead (one
    per instance) gave 18,305 and 86.9 %, but only 85.6 % of chats in time."""
    reserved_kv_share: Annotated[float, Field(ge=0, le=1)] = 0.15
    """The default interactive reservation, until a quota names one (its ``reserved_share``)."""
    long_prefill_cap_tokens: Annotated[int, Field(ge=1)] = LONG_DOCUMENT_TOKENS
    pool_depth: Annotated[int, Field(ge=1)] = 4096
    """Requests one class pool holds; past it, arrivals of the class are rejected."""
    retry_after_s: Annotated[float, Field(gt=0)] = 1.0
    """What a rejection tells the client to wait when nothing better is known."""
    max_hold_s: Annotated[float, Field(gt=0)] = 600.0
    """How long a request with neither a first-token objective nor a deadline (batch sent
    without one) is held at most: the OpenAI Python client's default timeout
    (``openai._constants.DEFAULT_TIMEOUT``, 600 s), past which its client has given up.
    Unbounded, such a request waited as long as no instance was ready or KV stayed over
    the reserve, its connection open."""


@dataclass(frozen=True)
class SLOMax:
    params: SLOMaxParams = SLOMaxParams()
    name: str = "slomax"
    pool: PoolModel | None = field(default=None, kw_only=True)
    """The pool's engine limits: with its ``max_num_seqs``, sequences are reserved too."""
    wants_prediction: bool = True
    needs_prediction: bool = False
    """Without a prediction it rejects nothing early, and does the rest."""
    release_rate_per_s: float | None = None
    engine_scheduling: EngineScheduling = "fcfs"

    def decide(
        self, request: AdmissionRequest, view: AdmissionView, *, held: bool = False
    ) -> AdmissionDecision:
        """Dispatch, hold or reject ``request``; ``held``: it is waiting in its pool (the
        host asks again as load falls, pool heads first)."""
        p = self.params
        pool = view.pool(request.task_class)
        kv_use = view.kv_use()
        blocked, allowed = self._gate(request, view, kv_use)
        if blocked is None and not held and p.class_pools and pool.depth > 0:
            blocked = "behind_pool"  # arrivals queue behind those already waiting
        joins_pool = blocked is not None and p.class_pools and not held
        wait = pool.expected_wait_s() if joins_pool else 0.0
        # held: the best of the ready instances, where it may start once load falls
        predicted = view.best_predicted_ttft_s(allowed if blocked is None else None)
        figures = {"kv_use": kv_use, "pool_wait_s": wait}
        if predicted is not None:
            figures["predicted_ttft_s"] = predicted
        objective = _attainable(view.objective(request), view.idle_ttft_s)
        if p.early_rejection and predicted is not None:
            late = _late(request, objective, view.now_s, predicted + wait)
            if late is not None:
                return self._reject(late, held, figures)
        if blocked is None:
            return AdmissionDecision(Verdict.DISPATCH, "admitted", allowed, figures=_items(figures))
        if not p.class_pools or (not held and pool.depth >= p.pool_depth):
            return self._reject(blocked if not p.class_pools else "pool_full", held, figures)
        until, expires_as = _hold_until(request, objective, predicted or 0.0, p.max_hold_s)
        return AdmissionDecision(
            Verdict.HOLD,
            blocked,
            hold_until_s=until,
            expires_as=expires_as,
            figures=_items(figures),
        )

    def concurrency_limit(
        self, task_class: TaskClass, quotas: Mapping[TaskClass, ClassQuota], ready: int
    ) -> int | None:
        """The requests of ``task_class`` a DC with ``ready`` instances runs at once under
        ``quotas`` (None: no limit): the quota's, else for long documents the default."""
        quota = quotas.get(task_class)
        limit = None if quota is None else quota.concurrency(ready)
        if limit is None and task_class is TaskClass.LONG_DOCUMENT:
            limit = math.ceil(self.params.long_documents_per_instance * ready)
        return limit

    def _gate(
        self, request: AdmissionRequest, view: AdmissionView, kv_use: float
    ) -> tuple[str | None, BoolArray]:
        """The first reason the request may not start now (None: it may), and the
        instances it may start on; ``kv_use``: the view's, taken and promised."""
        p, fleet, task_class = self.params, view.fleet, request.task_class
        allowed = fleet.ready.copy()
        limit = self.concurrency_limit(task_class, view.quotas, int(fleet.ready.sum()))
        if limit is not None and view.inflight.get(task_class, 0) >= limit:
            return "concurrency", allowed
        if limit is not None and task_class in view.out_of_slots:
            return SLOT_WAIT, allowed
        if p.interactive_reservation and task_class is not TaskClass.INTERACTIVE:
            reserved = self._interactive_reserve(view.quotas)
            if task_class is TaskClass.BATCH:  # batch fills what the others leave idle
                allowed &= fleet.waiting == 0
            most = None if self.pool is None else self.pool.max_num_seqs
            if most is not None:  # running and waiting: the seats taken and promised
                allowed &= view.sequences() < (1 - reserved) * most
            if kv_use >= 1 - reserved or not allowed.any():
                return "reservation", allowed
        if p.interference_bound and request.input_tokens >= LONG_DOCUMENT_TOKENS:
            allowed &= fleet.pending_prefill_tokens < p.long_prefill_cap_tokens
            if not allowed.any():
                return PREFILL_WAIT, allowed
        return (None if allowed.any() else "no_instance"), allowed

    def _interactive_reserve(self, quotas: Mapping[TaskClass, ClassQuota]) -> float:
        """The share held back for interactive requests: the interactive quota's, where it
        names one (a quota that sets only a bucket or a ceiling leaves the default)."""
        interactive = quotas.get(TaskClass.INTERACTIVE)
        named = None if interactive is None else interactive.reserved_share
        return self.params.reserved_kv_share if named is None else named

    def _reject(self, reason: str, held: bool, figures: dict[str, float]) -> AdmissionDecision:
        retry = None if held else self.params.retry_after_s
        return AdmissionDecision(
            Verdict.REJECT, reason, retry_after_s=retry, figures=_items(figures)
        )


def _attainable(objective: ClassObjective, idle_ttft_s: float | None) -> ClassObjective:
    """The objective admission holds a request to: its class's, without the first-token
    bound where even an idle instance would miss it (a prompt too long for its class; one
    past the model's context then reaches the engine, which refuses it). Waiting cannot
    help such a request, and rejecting it on its predicted TTFT told its client to retry
    a request that would be refused for ever (OpenAI's SDK retries a 429 by itself). It is
    admitted or held on load alone, as one of a class with no first-token objective; its
    outcome still counts as missed. An infinite prediction (no instance ready) tells
    nothing of the request: the bound stays, and a held request expires by it."""
    if objective.ttft_s is None or idle_ttft_s is None or not math.isfinite(idle_ttft_s):
        return objective
    if idle_ttft_s <= objective.ttft_s:
        return objective
    return objective.model_copy(update={"ttft_s": None})


def _late(
    request: AdmissionRequest, objective: ClassObjective, now_s: float, predicted_ttft_s: float
) -> str | None:
    """Why the request would miss its objective if its first token came after
    ``predicted_ttft_s`` more; None if it would not."""
    if (
        objective.ttft_s is not None
        and now_s - request.arrival_s + predicted_ttft_s > objective.ttft_s
    ):
        return "predicted_ttft"
    deadline = request.deadline_s
    if objective.use_deadline and deadline is not None and now_s + predicted_ttft_s > deadline:
        return "deadline"
    return None


def _hold_until(
    request: AdmissionRequest,
    objective: ClassObjective,
    predicted_ttft_s: float,
    max_hold_s: float,
) -> tuple[float, str]:
    """The last moment a held request can still start and meet its objective, as far as
    its predicted TTFT tells; a class with no such objective waits at most the deadline
    or, without one, ``max_hold_s`` from its arrival. With the reason it is answered with
    then."""
    limits = []
    if objective.ttft_s is not None:
        limits.append(request.arrival_s + objective.ttft_s - predicted_ttft_s)
    if objective.use_deadline and request.deadline_s is not None:
        limits.append(request.deadline_s - predicted_ttft_s)
    if limits:
        return min(limits), EXPIRED
    return request.arrival_s + max_hold_s, MAX_HOLD


def _items(figures: dict[str, float]) -> tuple[tuple[str, float], ...]:
    return tuple(figures.items())

"""Admission baselines: the schemes people run in front of their engines today, each as its
project's code ships it (the docstring names the file and commit it follows), seeing what
it sees upstream.

Classes map to priorities as an operator of each would set them
(``control.admission.request.PRIORITY``): interactive highest, then long documents, then
batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated

import numpy as np
from pydantic import Field

from control.admission.request import AdmissionRequest
from control.admission.view import MAX_HOLD, AdmissionDecision, AdmissionView, Verdict
from control.routing.snapshot import PoolModel
from schemas.base import TaskClass

if TYPE_CHECKING:
    from control.admission.registry import EngineScheduling


@dataclass(frozen=True)
class Fcfs:
    """Admit everything: the engines' own first-come-first-served queues decide, as vLLM's
    default ``--scheduling-policy fcfs`` does behind a gateway with no admission."""

    name: str = "fcfs"
    wants_prediction: bool = False
    needs_prediction: bool = False
    release_rate_per_s: float | None = None
    engine_scheduling: EngineScheduling = "fcfs"

    def decide(
        self, request: AdmissionRequest, view: AdmissionView, *, held: bool = False
    ) -> AdmissionDecision:
        return AdmissionDecision(Verdict.DISPATCH, "admitted")


@dataclass(frozen=True)
class VllmPriority(Fcfs):
    """Admit everything, each request carrying its class's priority, to engines started
    with ``--scheduling-policy priority`` (vllm-project/vllm ``vllm/v1/core/sched/
    scheduler.py`` at b4622cf9, ``request_queue.py`` at 0097c7ed): each engine's wait queue
    is ordered by (priority, arrival), and when a running request needs a KV block and none
    is free, the running request of lowest priority (latest arrival among equals) is
    preempted and recomputed later. Nothing running is preempted for a waiting request,
    and the queue's head blocks the rest, as upstream. The simulated engine does both
    (``sim.engine``); this policy only names the engines' mode."""

    name: str = "vllm_priority"
    engine_scheduling: EngineScheduling = "priority"


@dataclass(frozen=True)
class DynamoQueueParams:
    router_queue_threshold: Annotated[float, Field(ge=0)] = 16.0
    """A worker is busy while its active prefill tokens exceed this many times its
    ``max_num_batched_tokens``. Dynamo shipped 4.0, then 16.0 (``scheduling/config.rs`` at
    0243c51b, "Default: 16.0"), and since PR #11599 (2026-07-13) ships no threshold, which
    turns the queue off (then it is ``fcfs``); this runs it on, at its last default."""
    max_num_batched_tokens: Annotated[int, Field(ge=1)] = 8192
    """What each worker publishes of its engine (vLLM's default, as the profiles run)."""


@dataclass(frozen=True)
class DynamoRouterQueue:
    """Dynamo's KV-router request queue (ai-dynamo/dynamo ``lib/kv-router/src/scheduling/
    queue.rs`` at 00067c31, ``policy_queue.rs`` at 0bebf6de): a request waits while every
    eligible worker is prefill-busy (its active prefill tokens, the router's own count of
    uncached prompt tokens sent and not yet answered with a first token, above the
    threshold times ``max_num_batched_tokens``) or while its class has a backlog; the
    queue has no limit and no timeout. Held requests leave by strict-priority tier (here
    the class), first come first served within it (the default FCFS policy with no
    priority jump), only the head checked; the check runs as prefills and requests end.
    Nothing is refused: a client that waits too long gives up."""

    params: DynamoQueueParams = DynamoQueueParams()
    name: str = "dynamo_router_queue"
    wants_prediction: bool = False
    needs_prediction: bool = False
    engine_scheduling: EngineScheduling = "fcfs"
    release_rate_per_s: float | None = None
    """Its queue drains in a loop, each admission counted before the next check."""

    def decide(
        self, request: AdmissionRequest, view: AdmissionView, *, held: bool = False
    ) -> AdmissionDecision:
        fleet, p = view.fleet, self.params
        busy = fleet.pending_prefill_tokens > p.router_queue_threshold * p.max_num_batched_tokens
        backlog = not held and view.pool(request.task_class).depth > 0
        if backlog or not (fleet.ready & ~busy).any():
            return AdmissionDecision(Verdict.HOLD, "queue", hold_until_s=float("inf"))
        return AdmissionDecision(Verdict.DISPATCH, "admitted")


@dataclass(frozen=True)
class FlowControlParams:
    queue_depth_threshold: Annotated[int, Field(ge=1)] = 5
    kv_cache_util_threshold: Annotated[float, Field(gt=0)] = 0.8
    usage_limit: Annotated[float, Field(gt=0)] = 1.0
    """The static usage-limit policy's ceiling, the same for every band."""
    request_ttl_s: Annotated[float, Field(gt=0)] = 60.0
    band_max_requests: Annotated[int, Field(ge=1)] = 5000


@dataclass(frozen=True)
class LlmdFlowControl:
    """llm-d's flow control, its feature gate on (llm-d/llm-d-router at ebab6879,
    ``pkg/epp/flowcontrol``: ``controller/internal/processor.go``, ``registry/config.go``,
    ``controller/config.go``; the default saturation detector
    ``pkg/epp/framework/plugins/flowcontrol/saturationdetector/utilization``). One band per
    priority, first come first served within a band, the highest non-empty band first;
    nothing leaves while the pool's saturation is at or over the band's ceiling (1.0 for
    every band under the default static usage-limit policy), and a band's head blocks the
    rest. Saturation is the mean over endpoints of max(waiting / 5, KV use / 0.8), from
    the 50 ms scrape (metrics older than 200 ms would count 1.0; the scrape is never that
    old here). It lets held requests go at most one per millisecond. A request waits at
    most 60 s, then is refused with 503, as upstream answers one whose TTL ran out in its
    queue (``translateFlowControlOutcome`` in ``pkg/epp/requestcontrol/admission.go``:
    ``QueueOutcomeEvictedTTL`` is ``ServiceUnavailable``); a band holds at most 5,000, and
    an arrival past that is refused with 429 (``ResourceExhausted``).

    The chart ships the gate off; then only requests of negative priority are refused
    (429) while saturation is at or over 1.0, and everything else is admitted: for these
    classes, ``fcfs`` but for batch. The probabilistic admitter that sheds negative
    priorities with probability min(saturation^5 x 300, 1) is opt-in and not run here."""

    params: FlowControlParams = FlowControlParams()
    name: str = "llmd_flow_control"
    wants_prediction: bool = False
    needs_prediction: bool = False
    engine_scheduling: EngineScheduling = "fcfs"
    release_rate_per_s: float | None = 1000.0
    """Its processor dispatches at most one request per 1 ms tick of its dispatch loop
    (and one after each arrival), all against the last scrape."""

    def decide(
        self, request: AdmissionRequest, view: AdmissionView, *, held: bool = False
    ) -> AdmissionDecision:
        p = self.params
        depth = view.pool(request.task_class).depth
        if not held and depth >= p.band_max_requests:
            return AdmissionDecision(Verdict.REJECT, "pool_full")
        level = saturation(view, p)
        figures = (("saturation", level),)
        if (not held and depth > 0) or level >= p.usage_limit:
            until = view.now_s + p.request_ttl_s
            return AdmissionDecision(
                Verdict.HOLD, "saturated", hold_until_s=until, expires_as=MAX_HOLD, figures=figures
            )
        return AdmissionDecision(Verdict.DISPATCH, "admitted", figures=figures)


def saturation(view: AdmissionView, params: FlowControlParams) -> float:
    """llm-d's utilization detector: the mean over ready endpoints of the larger of their
    waiting queue over its threshold and their KV use over its threshold (1.0 with none)."""
    fleet = view.fleet
    ready = fleet.ready
    if not ready.any():
        return 1.0
    queue = fleet.waiting[ready] / params.queue_depth_threshold
    kv = fleet.kv_blocks_used[ready] / np.maximum(fleet.kv_blocks_total[ready], 1)
    return float(np.maximum(queue, kv / params.kv_cache_util_threshold).mean())


@dataclass(frozen=True)
class LitellmParams:
    rpm_per_instance: Annotated[float, Field(gt=0)] = 296.6
    """Each deployment's ``rpm`` as its operator would set it: what one instance serves, here
    the measured capacity of the 30-minute mixed workload on Llama-3.1-70B / 4xH100, 79.08
    requests/s at 16 instances (``tokenfleet bench admission`` at 91da74f), times 60."""
    tpm_per_instance: Annotated[float, Field(gt=0)] = 56_420.0
    """Each deployment's ``tpm``: the same capacity times the workload's mean output, 190.3
    tokens (LiteLLM counts output tokens by default)."""
    saturation_threshold: Annotated[float, Field(ge=0)] = 0.5
    weights: tuple[tuple[TaskClass, float], ...] = (
        (TaskClass.INTERACTIVE, 0.9),
        (TaskClass.BATCH, 0.05),
        (TaskClass.LONG_DOCUMENT, 0.05),
    )
    """``litellm.priority_reservation``, one priority per class, as LiteLLM's docs split
    production and development traffic (0.9 and 0.1): chats first. Weights by each class's
    share of the mixed workload's output tokens (0.6, 0.25, 0.15) did worse on it
    (``tokenfleet bench admission --policies litellm_priority`` at 08df416: 12,012 against
    12,933 tokens/s of pooled goodput, 49.7 % against 60.0 % of arrivals in time)."""


@dataclass(frozen=True)
class LitellmPriority:
    """LiteLLM proxy's priority reservations (BerriAI/litellm ``litellm/proxy/hooks/
    dynamic_rate_limiter_v3.py`` at 02ba835f; ``PriorityReservationSettings`` in
    ``litellm/types/utils.py``): the model's saturation is the larger of its requests and
    its output tokens in the current 60 s window over the model group's ``rpm`` and ``tpm``
    (the sums over its deployments, one per ready instance); the model's own limits hold
    for everyone, and from saturation 0.5 each priority is also held to its weight times
    them. Requests count when they are sent, tokens when a response completes. Over a
    limit the answer is 429 at once; nothing waits. The hook names no retry time (it
    raises ``litellm.RateLimitError``), so the decision names none either, and the
    gateway's 429 carries its default ``Retry-After`` of 1 s, as for every refusal that
    names no time (``gateway.refusals.REFUSED_RETRY_AFTER_S``).

    Departure: upstream reads saturation through a local cache that lives up to 60 s; here
    it is read fresh at every decision, which can only help it."""

    params: LitellmParams = LitellmParams()
    name: str = "litellm_priority"
    wants_prediction: bool = False
    needs_prediction: bool = False
    release_rate_per_s: float | None = None
    engine_scheduling: EngineScheduling = "fcfs"

    def decide(
        self, request: AdmissionRequest, view: AdmissionView, *, held: bool = False
    ) -> AdmissionDecision:
        p = self.params
        ready = int(view.fleet.ready.sum())
        rpm, tpm = p.rpm_per_instance * ready, p.tpm_per_instance * ready
        total = view.total_usage()
        level = max(total.requests / rpm, total.output_tokens / tpm) if ready else 1.0
        figures = (("saturation", level),)
        if not ready or total.requests >= rpm or total.output_tokens >= tpm:
            return AdmissionDecision(Verdict.REJECT, "model_limit", figures=figures)
        if level >= p.saturation_threshold:
            weight = dict(p.weights)[request.task_class]
            own = view.class_usage(request.task_class)
            if own.requests >= int(rpm * weight) or own.output_tokens >= int(tpm * weight):
                return AdmissionDecision(Verdict.REJECT, "priority_limit", figures=figures)
        return AdmissionDecision(Verdict.DISPATCH, "admitted", figures=figures)


@dataclass(frozen=True)
class MooncakeParams:
    decode_time_s: Annotated[float, Field(gt=0)] = 14.1
    """The uniform decoding time the paper assumes of every request (it gives no value):
    the mean time from first token to last of the mixed workload's first 6,000 requests at
    1.0 x capacity under ``fcfs`` behind TokenPilot, 14.1 s (median 8.6 s)."""
    tbt_limit_s: Annotated[float, Field(gt=0)] = 0.1
    """The one TBT limit Mooncake's Conductor holds the whole decoding pool to: 0.1 s per
    token, as on its real workload, and this fleet's interactive objective."""


@dataclass(frozen=True)
class MooncakeEarlyReject:
    """Mooncake's prediction-based early rejection (Qin et al., "Mooncake: A KVCache-centric
    Disaggregated Architecture for LLM Serving", arXiv 2407.00079 v4, sections 7.2-7.4;
    the FAST'25 paper keeps the rule, not the prediction): when a request arrives, the
    Conductor refuses it (429) if its predicted TTFT on the best instance exceeds its
    objective, or if the decoding load it would meet once its prefill ends exceeds the
    pool's TBT limit. That load is predicted at system level, not per request: every
    request is assumed to decode for a uniform ``decode_time_s``; at the moment this one
    would start decoding, the requests whose prefill is done by then are decoding, those
    that began more than ``decode_time_s`` before it have left, and the step time of the
    resulting batch per instance is the predicted TBT. Nothing waits; nothing is retried.

    Departures: Mooncake disaggregates prefill from decoding, where this fleet colocates
    them, so both predictions are of the same instances: the TTFT is TokenPilot's (the
    router's step model, as Mooncake's Conductor predicts with its own), the TBT the step
    model's at the predicted batch and the fleet's mean context per running request."""

    pool: PoolModel
    params: MooncakeParams = MooncakeParams()
    name: str = "mooncake_early_reject"
    wants_prediction: bool = True
    needs_prediction: bool = True
    """Without a TTFT prediction it refuses every request (``no_instance``)."""
    release_rate_per_s: float | None = None
    engine_scheduling: EngineScheduling = "fcfs"

    def decide(
        self, request: AdmissionRequest, view: AdmissionView, *, held: bool = False
    ) -> AdmissionDecision:
        ttft = view.best_predicted_ttft_s(None)
        if ttft is None:
            return AdmissionDecision(Verdict.REJECT, "no_instance")
        tbt = self.predicted_tbt_s(view, view.now_s + ttft)
        figures = (("predicted_ttft_s", ttft), ("predicted_tbt_s", tbt))
        objective = view.objective(request)
        if objective.ttft_s is not None and ttft > objective.ttft_s:
            return AdmissionDecision(Verdict.REJECT, "predicted_ttft", figures=figures)
        if tbt > self.params.tbt_limit_s:
            return AdmissionDecision(Verdict.REJECT, "predicted_tbt", figures=figures)
        return AdmissionDecision(Verdict.DISPATCH, "admitted", figures=figures)

    def predicted_tbt_s(self, view: AdmissionView, decode_start_s: float) -> float:
        """The time per output token of the batch this request would join at
        ``decode_start_s``: the requests still prefilling (done by then), those decoding
        that have not yet used up ``decode_time_s``, and itself, spread over the ready
        instances. Another host's decoding requests, whose start it does not know, count
        as staying."""
        fleet = view.fleet
        ready = max(int(fleet.ready.sum()), 1)
        leaving = decode_start_s - self.params.decode_time_s
        staying = int(np.count_nonzero(view.decoding_since_s() > leaving))
        staying += view.decoding_elsewhere
        decoders = view.awaiting_first_token() + staying + 1
        per_instance = -(-decoders // ready)
        running = max(int(fleet.running[fleet.ready].sum()), 1)
        context = int(fleet.kv_tokens_used[fleet.ready].sum()) / running
        step_time = self.pool.step_time
        step = step_time.step_s(0, 0, per_instance, int(per_instance * context))
        return step + step_time.token_overhead_s

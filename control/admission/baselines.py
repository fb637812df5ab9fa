"""Admission baselines: the schemes people run in front of their engines today, each as its
project's code ships it (the docstring names the file and commit it follows), seeing what
it sees upstream.

Classes map to priorities as an operator of each would set them: interactive highest,
then long documents, then batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

import numpy as np
from pydantic import Field

from control.admission.request import AdmissionRequest
from control.admission.view import AdmissionDecision, AdmissionView, Verdict


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
    most 60 s, then gets 429; a band holds at most 5,000.

    The chart ships the gate off; then only requests of negative priority are refused
    (429) while saturation is at or over 1.0, and everything else is admitted: for these
    classes, ``fcfs`` but for batch. The probabilistic admitter that sheds negative
    priorities with probability min(saturation^5 x 300, 1) is opt-in and not run here."""

    params: FlowControlParams = FlowControlParams()
    name: str = "llmd_flow_control"
    wants_prediction: bool = False
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
            return AdmissionDecision(Verdict.HOLD, "saturated", hold_until_s=until, figures=figures)
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

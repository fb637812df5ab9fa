"""The gateway's Prometheus metrics, one registry per app (tests build several)."""

from __future__ import annotations

import collections
from collections.abc import Iterable
from typing import Literal, get_args

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector

from schemas import Envelope

_ADDED_BUCKETS = (
    *(0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25),
    *(0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0),
)
"""The gateway's own work takes a millisecond or so; a request admission holds, or that an
instance or DC failed first, waits seconds (a batch request up to its deadline)."""
_TTFT_BUCKETS = (
    *(0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0),
    *(7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0),
)
_DURATION_BUCKETS = (
    *(0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0),
    *(120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0),
)
"""vLLM's own buckets (its V1 engine's ``vllm:time_to_first_token_seconds`` and
``vllm:e2e_request_latency_seconds``), so that a panel can set the engine's figure beside
the client's."""


UpstreamStage = Literal[
    "connect", "status", "body", "before_first_token", "after_first_token", "refused"
]
"""Where an upstream call failed (``refused``: the instance answered that the request was
at fault)."""
DropReason = Literal["buffer_full", "shutdown", "too_large", "journal_write"]
"""Why lifecycle events (or a journal line) were given up."""
FALLBACK_WHYS = ("Refused", "DcFailed")


class GatewayMetrics:
    """``instance_ids`` and ``dcs``: the fleet's, whose error counters start at 0, so that
    ``rate()`` and ``increase()`` see a rare error's first count (a series first seen at 1
    has no increase)."""

    def __init__(self, instance_ids: Iterable[str] = (), dcs: Iterable[str] = ()) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        ProcessCollector(registry=r)  # process_cpu_seconds_total, memory, open files
        self.requests = Counter(
            "tokenfleet_gateway_requests",
            "Requests answered, by model and HTTP status.",
            ("model", "status"),
            registry=r,
        )
        self.decisions = Counter(
            "tokenfleet_gateway_decisions",
            "Routing decisions, by policy and chosen instance (its id in the fleet file).",
            ("policy", "instance_id"),
            registry=r,
        )
        self.in_progress = Gauge(
            "tokenfleet_gateway_requests_in_progress",
            "Requests this gateway is serving now.",
            registry=r,
        )
        self.upstream_errors = Counter(
            "tokenfleet_gateway_upstream_errors",
            "Failed upstream calls, by instance (its id in the fleet file) and stage (where "
            "it failed; `refused`: the instance answered that the request was at fault).",
            ("instance_id", "stage"),
            registry=r,
        )
        self.retries = Counter(
            "tokenfleet_gateway_retries", "Requests retried on another instance.", registry=r
        )
        self.dc_fallbacks = Counter(
            "tokenfleet_gateway_dc_fallbacks",
            "Requests passed to the next DC, by the DC that refused (Refused) or failed "
            "(DcFailed) them before their first token.",
            ("dc", "why"),
            registry=r,
        )
        self.replans = Counter(
            "tokenfleet_gateway_replans",
            "Decisions made again because another request was routed since their view.",
            registry=r,
        )
        self.cancellations = Counter(
            "tokenfleet_gateway_cancellations", "Requests the client abandoned.", registry=r
        )
        self.added_latency = Histogram(
            "tokenfleet_gateway_added_latency_seconds",
            "Time from a request's arrival to its upstream call: the gateway's own work, "
            "and for a request admission held, or that an instance or DC failed first, "
            "that wait too.",
            registry=r,
            buckets=_ADDED_BUCKETS,
        )
        self.events_dropped = Counter(
            "tokenfleet_gateway_events_dropped",
            "Lifecycle events not published, by reason.",
            ("reason",),
            registry=r,
        )
        self.events_published = Counter(
            "tokenfleet_gateway_events_published",
            "Lifecycle events the bus has taken, by type (the schema name).",
            ("event",),
            registry=r,
        )
        self.events_queued = Gauge(
            "tokenfleet_gateway_events_queued",
            "Lifecycle events waiting for the bus.",
            registry=r,
        )
        self.state_fallbacks = Counter(
            "tokenfleet_gateway_shared_state_fallbacks",
            "Shared-state calls answered locally because Redis failed or is away.",
            registry=r,
        )
        self.token_lag = Gauge(
            "tokenfleet_gateway_token_lag_seconds",
            "How late TokenPilot takes this gateway to see an instance's step end: the "
            "configured least, or more where first tokens showed it later.",
            ("model", "dc"),
            registry=r,
        )
        self.control_defaults = Gauge(
            "tokenfleet_gateway_control_defaults",
            "1 while a control kind (quotas, weights) is missing or expired and its safe "
            "default applies.",
            ("kind",),
            registry=r,
        )
        self.admissions = Counter(
            "tokenfleet_gateway_admissions",
            "Admission decisions, by class, verdict (dispatch, hold, reject) and reason; a "
            "held request counts again when it leaves its pool.",
            ("task_class", "verdict", "reason"),
            registry=r,
        )
        self.pool_depth = Gauge(
            "tokenfleet_gateway_pool_depth",
            "Requests this gateway holds in each class pool.",
            ("model", "dc", "task_class"),
            registry=r,
        )
        self.ttft = Histogram(
            "tokenfleet_gateway_time_to_first_token_seconds",
            "Time to first token of streamed requests, from their arrival, as the client sees "
            "it: a wait in an admission pool, a retry and a trip to another DC included, "
            "which the engine's own histogram leaves out. Observed at the first token, as "
            "vLLM observes its own: a stream its client leaves later counts too.",
            ("model", "task_class"),
            registry=r,
            buckets=_TTFT_BUCKETS,
        )
        self.request_duration = Histogram(
            "tokenfleet_gateway_request_duration_seconds",
            "Time from a completed request's arrival to the end of its answer.",
            ("model", "task_class"),
            registry=r,
            buckets=_DURATION_BUCKETS,
        )
        self.output_tokens = Counter(
            "tokenfleet_gateway_output_tokens",
            "Output tokens of completed requests, by class and whether the request met its "
            "class's objective (met: the goodput).",
            ("task_class", "met"),
            registry=r,
        )
        self._start_at_zero(list(instance_ids), list(dcs))

    def _start_at_zero(self, instance_ids: list[str], dcs: list[str]) -> None:
        for instance_id in instance_ids:
            for stage in get_args(UpstreamStage):
                self.upstream_errors.labels(instance_id, stage)
        for dc in dcs:
            for why in FALLBACK_WHYS:
                self.dc_fallbacks.labels(dc, why)
        for reason in get_args(DropReason):
            self.events_dropped.labels(reason)

    def upstream_failed(self, instance_id: str, stage: UpstreamStage) -> None:
        self.upstream_errors.labels(instance_id, stage).inc()

    def events_given_up(self, reason: DropReason, count: int = 1) -> None:
        self.events_dropped.labels(reason).inc(count)

    def first_token(self, model: str, task_class: str, ttft_s: float) -> None:
        """A streamed request's first token (an answer not streamed shows its first token
        only with its end)."""
        self.ttft.labels(model, task_class).observe(ttft_s)

    def completed(self, model: str, task_class: str, e2e_s: float) -> None:
        """A request answered whole."""
        self.request_duration.labels(model, task_class).observe(e2e_s)

    def count_published(self, batch: Iterable[Envelope]) -> None:
        """Count a batch of lifecycle events the bus has taken, by type."""
        types = collections.Counter(envelope.payload.schema_name for envelope in batch)
        for event, count in types.items():
            self.events_published.labels(event).inc(count)

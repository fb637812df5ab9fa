"""The gateway's Prometheus metrics, one registry per app (tests build several)."""

from __future__ import annotations

import collections
from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector

from schemas import Envelope

_ADDED_BUCKETS = (
    *(0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25),
    *(0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0),
)
"""The gateway's own work takes a millisecond or so; a request admission holds, or that an
instance or DC failed first, waits seconds (a batch request up to its deadline)."""


class GatewayMetrics:
    def __init__(self) -> None:
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
        self.output_tokens = Counter(
            "tokenfleet_gateway_output_tokens",
            "Output tokens of completed requests, by class and whether the request met its "
            "class's objective (met: the goodput).",
            ("task_class", "met"),
            registry=r,
        )

    def count_published(self, batch: Iterable[Envelope]) -> None:
        """Count a batch of lifecycle events the bus has taken, by type."""
        types = collections.Counter(envelope.payload.schema_name for envelope in batch)
        for event, count in types.items():
            self.events_published.labels(event).inc(count)

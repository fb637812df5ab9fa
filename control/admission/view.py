"""What an admission policy sees, and what it answers.

A policy gets one frozen ``AdmissionView`` (the clock, the instances' load, its class
pools, the latest quotas, the objectives) and a request, and returns an
``AdmissionDecision`` with its reason. The host keeps the pools and the counts; the
policy keeps nothing, so a decision can be replayed from its view.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum

import numpy as np

from control.admission.request import AdmissionRequest
from control.routing.inflight import InFlight
from control.routing.snapshot import BoolArray, FleetSnapshot, FloatArray, IntArray
from schemas.base import TaskClass
from schemas.control import ClassQuota
from schemas.objectives import DEFAULT_OBJECTIVES, ClassObjective

EXPIRED = "expired"
"""The reason a held request is answered once its hold ran out: it could no longer meet
its objective."""

MAX_HOLD = "max_hold"
"""The reason a held request is answered once it waited the longest its policy holds one,
whatever its objective (SLOMax's ``max_hold_s`` for a request with neither a first-token
objective nor a deadline; llm-d flow control's TTL): not a missed objective but a fleet
that found no room for it meanwhile."""


class Verdict(StrEnum):
    DISPATCH = "dispatch"
    """Route it now (to one of ``allowed``)."""
    HOLD = "hold"
    """Keep it in its class's pool until ``hold_until_s``; decide again as load falls."""
    REJECT = "reject"
    """Answer now: 429 with ``retry_after_s`` when it was never admitted, 503 when it
    waited in a pool and can no longer meet its objective (or has none, and waited the
    longest a request is held)."""


@dataclass(frozen=True)
class AdmissionDecision:
    verdict: Verdict
    reason: str
    """Why, as a short name: ``admitted``, ``reservation``, ``prefill_cap``, ``concurrency``,
    ``pool_full``, ``predicted_ttft``, ``deadline``, ``expired``, ``max_hold``,
    ``behind_pool``, ``no_instance``, ``slots`` (``SLOT_WAIT``)."""
    allowed: BoolArray | None = None
    """For a dispatch: the instances the router may use (None: every ready one)."""
    hold_until_s: float | None = None
    """For a hold: when the request is answered if it is still waiting."""
    expires_as: str = EXPIRED
    """For a hold: the reason it is answered with then. ``expired``: it could no longer
    meet its objective; ``max_hold`` (``MAX_HOLD``): it waited as long as its policy holds
    a request."""
    retry_after_s: float | None = None
    """For a rejection of a request never admitted: when the client may try again."""
    figures: tuple[tuple[str, float], ...] = ()
    """The numbers the decision rested on, for the decision record."""


@dataclass(frozen=True, slots=True)
class PoolState:
    """One class pool as the host knows it."""

    depth: int = 0
    drained_per_s: float = 0.0
    """Requests the pool released per second lately (0: none, or not measured yet)."""

    def expected_wait_s(self) -> float:
        """How long a request joining the pool now should expect to wait, at the rate the
        pool drained lately; 0 while that rate is unmeasured (no release in the window),
        where the hold's own end answers a request that waits too long."""
        return self.depth / self.drained_per_s if self.drained_per_s > 0 else 0.0


PREFILL_WAIT = "prefill_cap"
"""The reason a long prompt is held while no instance has room for its prefill (SLOMax's
interference bound): a wait of its own, which the short prompts behind it in their pool
do not share (``Pipeline.release`` steps past it)."""


SLOT_WAIT = "slots"
"""The reason a request is held while its class's ceiling has room but its host's slots
of that ceiling do not (``AdmissionView.out_of_slots``): it waits for the host's next
grant, a pass, not for the pool to drain."""


@dataclass(frozen=True, slots=True)
class Usage:
    """What one class used in the host's current counting window."""

    requests: int = 0
    """Requests dispatched."""
    output_tokens: int = 0
    """Output tokens of requests that completed."""

    def __add__(self, other: Usage) -> Usage:
        return Usage(self.requests + other.requests, self.output_tokens + other.output_tokens)


USAGE_WINDOW_S = 60.0
"""How long the host counts usage before it starts again from zero: a fixed window that
opens at the first request after the last one closed, as LiteLLM's rate limiter counts
(``LITELLM_RATE_LIMIT_WINDOW_SIZE``, 60 s by default)."""


@dataclass(frozen=True)
class AdmissionView:
    now_s: float
    fleet: FleetSnapshot
    """The instances' load as the router sees it (``control.routing.snapshot``)."""
    predicted_ttft_s: FloatArray | None = None
    """The router's TTFT prediction for this request on each instance (None: it makes
    none, and no decision rests on a prediction)."""
    pools: Mapping[TaskClass, PoolState] = field(default_factory=dict)
    inflight: Mapping[TaskClass, int] = field(default_factory=dict)
    """Requests of each class dispatched and not yet finished, by every host of the pool."""
    quotas: Mapping[TaskClass, ClassQuota] = field(default_factory=dict)
    """The latest quota of each class that has one (the controller's, or configuration)."""
    usage: Mapping[TaskClass, Usage] = field(default_factory=dict)
    """Each class's usage in the current window (``USAGE_WINDOW_S``)."""
    first_tokens: Mapping[str, float] = field(default_factory=dict)
    """When each request in flight that has its first token got it, by request id (the
    host's own record, read only: a policy that wants it as an array builds one)."""
    decoding_elsewhere: int = 0
    """Requests in flight from the pool's other hosts that have their first token (when,
    this host does not know)."""
    out_of_slots: frozenset[TaskClass] = frozenset()
    """Classes whose ceiling this host shares with the pool's other hosts, each holding
    slots of it apart (gateway replicas), and whose slots this host has all in use: it
    starts no more of them, whatever the ceiling leaves."""
    seated: InFlight = field(default_factory=InFlight)
    """This host's requests in flight on each instance (sent, not yet ended there): a
    scrape older than they are does not show them. Read only."""
    objectives: Mapping[TaskClass, ClassObjective] = field(
        default_factory=lambda: dict(DEFAULT_OBJECTIVES)
    )
    idle_ttft_s: float | None = None
    """The router's TTFT prediction for this request on the best ready instance were it
    idle: what no wait shortens (None with ``predicted_ttft_s``)."""

    def awaiting_first_token(self) -> int:
        """Requests in flight still in their queue or prefill."""
        return sum(self.inflight.values()) - len(self.first_tokens) - self.decoding_elsewhere

    def decoding_since_s(self) -> FloatArray:
        """When each request in flight that has its first token got it."""
        times = self.first_tokens.values()
        return np.fromiter(times, np.float64, len(self.first_tokens))

    def objective(self, request: AdmissionRequest) -> ClassObjective:
        """What ``request`` is held to: its tenant's objective, else its class's."""
        return request.objective or self.objectives[request.task_class]

    def pool(self, task_class: TaskClass) -> PoolState:
        return self.pools.get(task_class, PoolState())

    def class_usage(self, task_class: TaskClass) -> Usage:
        return self.usage.get(task_class, Usage())

    def total_usage(self) -> Usage:
        return sum(self.usage.values(), Usage())

    def sequences(self) -> IntArray:
        """Each instance's sequences, running and waiting: as scraped, or as many as this
        host has in flight there where that is more (sent since the scrape; a release
        pass's, or a burst of arrivals between two scrapes)."""
        return np.maximum(self.fleet.requests, self.seated.counts(len(self.fleet)))

    def kv_use(self) -> float:
        """The ready instances' share of KV taken and promised, in tokens (engines' blocks
        need not be the same size): in use as last scraped, and what the prompts routed
        there and not yet prefilled will take (the hosts' pending prefill). The scrape
        alone is stale: between two, and within a release pass, the requests let go would
        not count, and a burst could start past a reserve. A prompt part-prefilled at the
        scrape counts its computed part twice."""
        fleet, ready = self.fleet, self.fleet.ready
        total = int(fleet.kv_tokens_total[ready].sum())
        if not total:
            return 1.0
        used = int(fleet.kv_tokens_used[ready].sum())
        return (used + float(fleet.pending_prefill_tokens[ready].sum())) / total

    def best_predicted_ttft_s(self, allowed: BoolArray | None) -> float | None:
        """The lowest predicted TTFT among the instances the request may use."""
        if self.predicted_ttft_s is None:
            return None
        usable = self.fleet.ready if allowed is None else allowed
        if not usable.any():
            return None
        return float(np.min(self.predicted_ttft_s[usable]))

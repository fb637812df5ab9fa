"""What the edge knows of a DC's load, and the two figures DC policies price it by:
utilisation (how close to capacity it runs) and backlog (how long a new request waits).

Two sources, fresh to different degrees:

- the DC's tables, published every few seconds and late by the pipeline that builds
  them: requests running, requests queued (in the engines' queues and in the DC's
  admission pools), the share of KV in use, requests completed per second;
- the edge's own counts, fresh: the requests it sent there lately and those not yet
  finished (every answer passes back through it).

A DC's rate at capacity is the operator's figure for the model's traffic (Google Cloud's
``maxRatePerInstance``, times the ready instances), or unknown.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from control.fleet.view import DataCenterState

RATE_WINDOW_S = 10.0
"""The span over which the edge counts its own sends."""
ASSUMED_RPS_PER_INSTANCE = 1.0
"""What an instance is taken to serve where the operator gives no figure: one request a
second, so that the backlog reads the edge's requests in flight per ready instance (what
SkyServe's balancer counts) as seconds, and a queue whose drain the tables did not see
(none completed there lately, or no fresh table) as the same. ``tokenfleet bench fleet --policies
fleetmind_without_rps_per_instance``, seeds 0 to 6 (``docs/fleetmind.md``, the load
model): mean goodput 6,376 tokens/s and the hotspot's chats' TTFT P95 0.52 s, against
6,217 and 0.78 s pricing the tables' queue alone, and 6,377 and 0.50 s with the operator's
figure (4.9 requests a second on seed 0). 5 here made 6,384 and 0.54 s (before a queue's
unseen drain was taken at this rate too): the round trips weigh more beside a smaller
backlog, and the choice is much the same."""


@dataclass(frozen=True)
class DcLoad:
    running: int = 0
    queued: int = 0
    """Requests waiting in the DC: in its engines' queues and in its admission pools."""
    kv_use: float = 0.0
    completed_per_s: float = 0.0
    sent_per_s: float = 0.0
    """Requests the edge sent to the DC per second, lately (its own count, and on a
    gateway what the replicas beside it last shared of theirs)."""
    inflight: int = 0
    """Requests the edge sent to the DC that have not finished, those its admission holds
    included (counted as ``sent_per_s`` is)."""
    capacity_rps: float | None = None
    """Requests per second the DC serves at capacity (None: not known)."""
    ready_instances: int = 0
    """The DC's instances ready to serve (what an assumed rate per instance scales by)."""

    @property
    def utilisation(self) -> float:
        """Demand over capacity: the edge's recent rate into the DC over the DC's rate at
        capacity. Where that is not known, 1 while the tables show a queue, else the
        share of KV in use."""
        if self.capacity_rps:
            return self.sent_per_s / self.capacity_rps
        return 1.0 if self.queued else self.kv_use

    @property
    def backlog_s(self) -> float:
        """Seconds of work ahead of a request sent now: what the edge has in flight there
        over the rate the DC completes requests at capacity (Little's law). Where that is
        not known, the same at ``ASSUMED_RPS_PER_INSTANCE``, or the tables' queue over the
        rate they saw it drain at (at least that) where that is more: a queue of other
        edges' requests, which the edge's count misses."""
        if self.capacity_rps:
            return self.inflight / self.capacity_rps
        assumed = max(self.ready_instances, 1) * ASSUMED_RPS_PER_INSTANCE
        queue_s = self.queued / max(self.completed_per_s, assumed)
        return max(self.inflight / assumed, queue_s)


@dataclass
class Rate:
    """Events per second over the last ``window_s``."""

    window_s: float = RATE_WINDOW_S
    _times: deque[float] = field(default_factory=deque)

    def add(self, now: float) -> None:
        self._forget_before(now)  # a rate no one reads keeps only its window
        self._times.append(now)

    def per_s(self, now: float) -> float:
        self._forget_before(now)
        return len(self._times) / self.window_s

    def _forget_before(self, now: float) -> None:
        while self._times and self._times[0] <= now - self.window_s:
            self._times.popleft()


def class_room(inflight: int, limit: int | None) -> float | None:
    """The share of a class's concurrency limit still free (None: no limit)."""
    if limit is None:
        return None
    return 1 - inflight / limit if limit > 0 else 0.0


def dc_state(
    name: str,
    region: str,
    *,
    instances: int,
    versions: frozenset[str],
    ready_versions: frozenset[str],
    ready_instances: int,
    load: DcLoad,
    weight: float | None = None,
    warm_tokens: int = 0,
    class_room: float | None = None,
) -> DataCenterState:
    """A DC as the policies see it, from what the edge knows of its pool and its load."""
    return DataCenterState(
        name,
        region,
        ready_instances,
        ready_versions,
        versions,
        utilisation=load.utilisation,
        predicted_wait_s=load.backlog_s,
        weight=weight,
        warm_tokens=warm_tokens,
        class_room=class_room,
        instances=instances,
        inflight_requests=load.inflight,
        kv_use=load.kv_use,
        queue=load.queued / ready_instances if ready_instances else 0.0,
    )

"""The decision path: admit -> choose the DC -> choose the instance.

A tenant's token bucket first (``quota_taken``, given back where the request is refused),
then the DC (``choose_dcs``: the DC policy, FleetMind by default, on this edge's view of
the DCs), then the pipeline of ``control/pipeline.py`` (``gateway.admission``): the
admission policy (SLOMax by default) and the routing policy (TokenPilot by default), on a
snapshot built from last-known telemetry and the shared accounting.

Safe defaults when control is silent (no snapshot, or past its TTL):

- **quotas**: no bucket, and the admission policy's own defaults;
- **weights**: every DC counted on whole (weight 1): the DC policy prices load from the
  telemetry and the admission pools alone.
"""

from __future__ import annotations

import contextlib
import random
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass

import numpy as np

from control.admission.rate_quota import BucketDraw, bucket_draw
from control.admission.registry import Admission
from control.controllers.fleetmind import weights_of
from control.fleet.fleetmind import FleetMind
from control.fleet.journal import dc_choice_record
from control.fleet.load import DcLoad, class_room, dc_state
from control.fleet.locality import PrefixLocality
from control.fleet.registry import DcPolicy
from control.fleet.view import DcRequest, FleetState
from control.routing.prefix_index import sampled_blocks
from control.routing.registry import Router
from control.routing.snapshot import (
    BoolArray,
    Decision,
    FleetSnapshot,
    FloatArray,
    RouteRequest,
)
from control.routing.tokenpilot import INDEX_STRIDE, TokenPilot
from control.tokens import BLOCK_TOKENS
from gateway.admission import GatewayAdmission, Waiting
from gateway.failures import DcFailed
from gateway.fleet_view import FleetView, LastKnown, Pool
from gateway.inbound import Inbound
from gateway.journal import Journals
from gateway.metrics import GatewayMetrics
from gateway.refusals import LONGEST_RETRY_AFTER_S, Refused
from gateway.state import SharedState, SharedView
from schemas.base import TaskClass
from schemas.control import AdmissionQuotas, RoutingWeights
from schemas.fleet import TenantConfig
from schemas.lifecycle import RejectReason
from schemas.objectives import Objectives
from schemas.openai_api import ApiError

CONTROLS = frozenset({"quotas", "weights"})
"""The controls a gateway decides on: the quota controller's and FleetMind's weights."""
LEAST_LOADED = "least_loaded"
"""The policy name of a pick by load (embeddings)."""
LOCALITY_BLOCKS = 1 << 17
"""Sampled prefix blocks whose DC the edge remembers (``PrefixLocality``): about 15 MB,
the prompts of the last several thousand requests (a 2,000-token prompt keeps 15)."""

OnWay = tuple[str, str, TaskClass]
"""A request on its way to a DC's admission: its model, the DC and its class."""


@dataclass(frozen=True)
class Plan:
    """A routed request: where it goes first, and where a retry goes."""

    dc: str
    pool: Pool
    decision: Decision
    order: list[int]
    """Rows of ``pool``, best first."""
    cached_tokens: FloatArray
    """The prefix each row's instance is expected to hold, in tokens (a retry's instance
    may hold less of it than the first choice: it is charged its own)."""
    index_blocks: tuple[int, ...]
    """The request's blocks as the shared prefix index keeps them."""
    version: int = 0
    """The shared state's version the decision was made on."""
    admitted: bool = True
    """Whether the pipeline decided it (and keeps its books); False for a pick by load."""
    allowed: BoolArray | None = None
    """The instances admission let it use (None: every ready one)."""

    def predicted_ttft_s(self, row: int) -> float | None:
        """The router's TTFT prediction for ``row``, if it makes one."""
        predicted = self.decision.predicted_ttft_s
        return None if predicted is None else float(predicted[row])

    def cached_tokens_at(self, row: int) -> float:
        """The prefix ``row``'s instance is expected to hold, in tokens: what it is charged
        and reports for a request sent there."""
        return float(self.cached_tokens[row])


class Decider:
    def __init__(
        self,
        view: FleetView,
        state: SharedState,
        make_router: Callable[[str], Router],
        local_dc: str,
        metrics: GatewayMetrics,
        make_admission: Callable[[str], Admission],
        objectives: Objectives,
        dc_policy: DcPolicy | None = None,
        journals: Journals | None = None,
        controls: frozenset[str] = CONTROLS,
    ) -> None:
        """``dc_policy``: FleetMind unless named; ``journals``: where decisions are
        journaled (None: nowhere); ``controls``: those a controller publishes, each
        watched by a gauge that reads 1 while its safe default applies."""
        self.view = view
        self.state = state
        self.local_dc = local_dc
        self._regions = {dc.name: dc.region for dc in view.fleet.dcs}
        self.region = self._regions[local_dc]
        self.dc_policy = dc_policy or FleetMind()
        self._journals = journals
        self._round_trips = view.fleet.round_trips_s()
        self._draws = random.Random()
        """For the DC policies that split traffic at random (Envoy's priority levels)."""
        self.metrics = metrics
        self.quotas: LastKnown[AdmissionQuotas] = LastKnown()
        self.weights: LastKnown[RoutingWeights] = LastKnown()
        # Read at each scrape: set per request, the gauge stood still while no request came.
        on_defaults = {
            "quotas": lambda: self.quotas.current(local_dc) is None,
            "weights": lambda: self.weights.current(local_dc) is None,
        }
        for kind in controls:
            metrics.control_defaults.labels(kind).set_function(on_defaults[kind])
        self._make_router = make_router
        self._routers: dict[tuple[str, str], Router] = {}
        self._turn = 0
        self._on_way: dict[str, OnWay] = {}
        """Requests sent to a DC that its admission has not counted yet, by request id."""
        self._on_way_count: Counter[OnWay] = Counter()
        self._locality = PrefixLocality(LOCALITY_BLOCKS)
        self.admission = GatewayAdmission(
            make_admission,
            self.router,
            self._pool_snapshot,
            objectives,
            metrics,
            state.admission_loads,
            None if journals is None else journals.pool,
            pool_now=self._pool_now,
        )

    @contextlib.asynccontextmanager
    async def quota_taken(self, inbound: Inbound) -> AsyncIterator[None]:
        """Take the request's tokens from its quota's bucket (ApiError(429) if empty) for
        what runs within, and give them back where that answers the request with an error
        before it ran (refused by the DC policy, a DC's admission or the gateway's stop;
        failed by every instance tried before its first token, 502): its client's retry
        takes them again, so it must not cost them twice. A whole answer generated and
        then unreadable (``DcFailed.answered``) ran, and keeps them. The bucket is the one
        replicas share (in Redis), given back to atomically."""
        draw = self._bucket_draw(inbound)
        if draw is None:
            yield
            return
        wait = await self.state.take(draw.bucket, draw.rate_per_s, draw.burst_tokens, draw.tokens)
        if wait > 0:
            raise ApiError(
                429,
                f"Quota for {inbound.task_class.value} requests is exhausted; retry later.",
                retry_after_s=wait if wait != float("inf") else LONGEST_RETRY_AFTER_S,
            )
        try:
            yield
        except (Refused, DcFailed) as error:
            if not isinstance(error, DcFailed) or not error.answered:
                await self.state.give_back(
                    draw.bucket, draw.rate_per_s, draw.burst_tokens, draw.tokens
                )
            raise

    @contextlib.contextmanager
    def on_its_way(self, inbound: Inbound, dc: str) -> Iterator[None]:
        """Count the request in ``dc``'s load from when it is sent there (its first DC, or
        the next after a refusal or a failure) until that DC's admission counts it
        (``decide``), or it ends first. In between it may wait for the decision lock, or
        for Redis, and the requests choosing their DCs meanwhile must see it: the
        simulator's edge counts a request from when it sends it."""
        key = (inbound.model.name, dc, inbound.task_class)
        self._on_way[inbound.request_id] = key
        self._on_way_count[key] += 1
        try:
            yield
        finally:
            self._arrived(inbound.request_id)

    def _arrived(self, request_id: str) -> None:
        key = self._on_way.pop(request_id, None)
        if key is not None:
            self._on_way_count[key] -= 1

    def _bucket_draw(self, inbound: Inbound) -> BucketDraw | None:
        """What the request takes from which bucket (None: its quota sets no bucket)."""
        quotas = self.quotas.current(self.local_dc)
        if quotas is None:
            return None
        tokens = inbound.input_tokens + inbound.output_budget
        tenant = inbound.tenant.name
        return bucket_draw(quotas, self.local_dc, inbound.task_class, tenant, tokens)

    def choose_dcs(
        self,
        model: str,
        tenant: TenantConfig | None = None,
        residency: tuple[str, ...] = (),
        input_tokens: int = 0,
        task_class: TaskClass = TaskClass.INTERACTIVE,
        request_id: str = "",
        prefix_blocks: tuple[int, ...] = (),
    ) -> tuple[str, ...]:
        """The DCs to try, best first, as the DC policy orders them on this edge's view
        (``prefix_blocks``: the prompt's, for the DCs it went to lately); ApiError(503)
        saying why when no DC may run the request."""
        config = self.view.fleet.model(model)
        request = DcRequest(
            request_id,
            self.region,
            self.local_dc,
            input_tokens,
            None if tenant is None or tenant.dcs is None else frozenset(tenant.dcs),
            frozenset(residency),
            None if config is None else config.version,
            self._draws.random(),
        )
        per_instance = None if config is None else config.rps_per_instance
        warm = self._locality.warm_tokens(prefix_blocks)
        fleet = self._dc_view(model, task_class, warm, per_instance)
        decision = self.dc_policy.choose(request, fleet)
        if self._journals is not None:
            self._journals.dc_choice(dc_choice_record(request, fleet, decision))
        if decision.chosen is None:
            reasons = decision.excluded
            why = ", ".join(f"{dc} ({reason})" for dc, reason in reasons.items())
            kept_out = reasons and set(reasons.values()) <= {"permission", "residency"}
            raise Refused(
                503,
                f"No data center may run this request for `{model}`: {why or 'none serves it'}.",
                RejectReason.RESIDENCY if kept_out else RejectReason.NO_CAPACITY,
            )
        return decision.order

    def _dc_view(
        self, model: str, task_class: TaskClass, warm: dict[str, int], per_instance: float | None
    ) -> FleetState:
        """The DCs serving ``model`` as this edge sees them: instances (a standby one only
        while it serves, as the simulator counts those placed and loaded), versions and
        load (``_dc_load``, with the operator's ``per_instance`` figure), the room its
        admission leaves ``task_class``, the controller's weights, and how much of the
        prompt went there lately (``warm``)."""
        weights = self.weights.current(self.local_dc)
        weight = weights_of(weights, model, task_class)
        states = []
        for dc in self.view.dcs_serving(model):
            pool = self.view.pool(model, dc)
            assert pool is not None
            ready = [i for i in pool.instances if self.view.ready(i.id)]
            load, unfinished = self._dc_load(model, dc, pool, len(ready), per_instance)
            limit = self.admission.concurrency_limit(
                model, dc, task_class, len(ready), self.quotas.current(dc)
            )
            states.append(
                dc_state(
                    dc,
                    self._regions[dc],
                    instances=sum(not i.standby for i in pool.instances)
                    + sum(i.standby for i in ready),
                    versions=frozenset(i.version for i in pool.instances),
                    ready_versions=frozenset(i.version for i in ready),
                    ready_instances=len(ready),
                    load=load,
                    weight=weight.get(dc),
                    warm_tokens=warm.get(dc, 0),
                    class_room=class_room(unfinished[task_class], limit),
                )
            )
        return FleetState(tuple(states), self._round_trips)

    def _dc_load(
        self, model: str, dc: str, pool: Pool, ready: int, per_instance: float | None
    ) -> tuple[DcLoad, dict[TaskClass, int]]:
        """The DC's load, and its requests sent and not finished by class (in flight or
        held in the admission pools of every replica, or on their way to them, as the
        simulator's edge counts what it sent): queues and KV from telemetry, the pace it
        completes requests at from its goodput table, the rate every replica sends there
        (the others' as last shared), the operator's figure of what an instance serves
        (``per_instance``)."""
        telemetry = self.view.load(pool)
        inflight, held, sent_per_s = self.admission.pool_load(model, dc)
        unfinished = {
            c: inflight[c] + held[c] + self._on_way_count[(model, dc, c)] for c in TaskClass
        }
        load = DcLoad(
            running=telemetry.requests,
            queued=round(telemetry.waiting * ready) + sum(held.values()),
            kv_use=telemetry.kv_use,
            completed_per_s=self.view.completed_per_s(model, dc),
            sent_per_s=sent_per_s,
            inflight=sum(unfinished.values()),
            capacity_rps=per_instance * ready if per_instance and ready else None,
            ready_instances=ready,
        )
        return load, unfinished

    async def decide(self, inbound: Inbound, dc: str, arrived: float) -> Plan | Awaitable[Plan]:
        """Admit the request and pick its instance: the plan, or, for a request held in its
        pool, what to await for it (outside any lock: it waits for capacity). ApiError 429
        when admission refuses it, 503 when none of the pool is ready; awaited, 503 when
        it can no longer meet its objective."""
        if inbound.by_load:  # no admission counts it: not on its way to one
            self._arrived(inbound.request_id)
            return await self.least_loaded(inbound.model.name, dc)
        pool, sampled, shared, request = await self._prepare(inbound, dc)
        snapshot = self.view.snapshot(pool, shared)
        await self.admission.open_pool(inbound.model.name, dc)
        quotas = self.quotas.current(dc)
        self._arrived(inbound.request_id)
        self._locality.sent(inbound.blocks, dc)
        admitted = self.admission.arrive(inbound, dc, request, snapshot, arrived, quotas)
        if isinstance(admitted, Waiting):
            return self._plan_when_released(admitted, inbound, dc, pool, sampled, shared)
        return self._plan(inbound, dc, pool, sampled, shared, admitted.route, admitted.allowed)

    async def _plan_when_released(
        self,
        waiting: Waiting,
        inbound: Inbound,
        dc: str,
        pool: Pool,
        sampled: tuple[int, ...],
        shared: SharedView,
    ) -> Plan:
        """The plan of a held request once released (decided on the pool as it was then;
        the shared accounting it read on arrival is older, so its charge makes the router
        decide again on a fresh view)."""
        admitted = await waiting.decision()
        return self._plan(inbound, dc, pool, sampled, shared, admitted.route, admitted.allowed)

    async def reroute(self, inbound: Inbound, dc: str, allowed: BoolArray | None = None) -> Plan:
        """Pick the instance again, on a fresh view, for a request already admitted (the
        router forgets its first pick); ApiError(503) when none of the pool is ready."""
        pool, sampled, shared, request = await self._prepare(inbound, dc)
        snapshot = self.view.snapshot(pool, shared)
        pipeline = self.admission.pipeline(inbound.model.name, dc)
        decision = pipeline.reroute(request, snapshot, time.monotonic(), allowed)
        return self._plan(inbound, dc, pool, sampled, shared, decision, allowed)

    async def _prepare(
        self, inbound: Inbound, dc: str
    ) -> tuple[Pool, tuple[int, ...], SharedView, RouteRequest]:
        """The pool, the request's blocks as the shared index keeps them, the shared
        accounting and index match, and the request as the router sees it. The view is
        speculative where the charge will check it (``Exchange._reserve``)."""
        pool = self.view.pool(inbound.model.name, dc)
        assert pool is not None  # choose_dcs only returns DCs serving the model
        sampled = tuple(sampled_blocks(inbound.blocks, INDEX_STRIDE))
        checked = self.admission.reroutes(inbound, dc)
        shared = await self.state.view(pool.ids, sampled, speculative=checked)
        request = RouteRequest(
            inbound.request_id,
            inbound.input_tokens,
            inbound.client_cap,
            inbound.blocks,
            inbound.task_class.value,
            known_matches=shared.matched_blocks * INDEX_STRIDE,
        )
        return pool, sampled, shared, request

    def _plan(
        self,
        inbound: Inbound,
        dc: str,
        pool: Pool,
        sampled: tuple[int, ...],
        shared: SharedView,
        decision: Decision,
        allowed: BoolArray | None = None,
    ) -> Plan:
        if decision.chosen is None:
            raise _none_ready(pool)
        predicted = decision.cached_tokens  # None: the shared index's match stands in
        matched = shared.matched_blocks * float(INDEX_STRIDE * BLOCK_TOKENS)
        cached_tokens: FloatArray = np.minimum(
            matched if predicted is None else predicted, float(inbound.input_tokens)
        )
        self.metrics.decisions.labels(decision.policy, pool.ids[decision.chosen]).inc()
        order = decision.ranked()
        version = shared.version
        return Plan(dc, pool, decision, order, cached_tokens, sampled, version, True, allowed)

    def _pool_now(self, model: str, dc: str) -> tuple[int, AdmissionQuotas | None]:
        """The pool's ready instances and its DC's quotas now, for admission's ceilings."""
        pool = self.view.pool(model, dc)
        ready = 0 if pool is None else sum(self.view.ready(i.id) for i in pool.instances)
        return ready, self.quotas.current(dc)

    async def _pool_snapshot(self, model: str, dc: str) -> FleetSnapshot:
        pool = self.view.pool(model, dc)
        assert pool is not None  # pipelines exist only for pools that served a request
        return self.view.snapshot(pool, await self.state.view(pool.ids, []))

    async def least_loaded(
        self,
        model: str,
        dc: str | None = None,
        tenant: TenantConfig | None = None,
        residency: tuple[str, ...] = (),
    ) -> Plan:
        """The ready instance of ``model`` in ``dc`` (None: ``choose_dcs``' first for the
        ``tenant`` and ``residency``) with the fewest tokens in flight through the
        gateways, ties taken in turn (an idle pool shares its embeddings out evenly): for
        requests with no prefix to reuse and nothing to generate (embeddings,
        ``/tokenize``)."""
        pool = self.view.pool(model, dc or self.choose_dcs(model, tenant, residency)[0])
        assert pool is not None  # only DCs serving the model are asked for
        shared = await self.state.view(pool.ids, [])
        ready = [row for row, i in enumerate(pool.instances) if self.view.ready(i.id)]
        if not ready:
            raise _none_ready(pool)
        self._turn += 1
        load = shared.inflight_tokens
        order = sorted(ready, key=lambda row: (load[row], (row - self._turn) % len(pool.instances)))
        scores = np.full(len(pool.instances), np.nan)
        scores[ready] = load[ready]
        decision = Decision(LEAST_LOADED, order[0], scores)
        self.metrics.decisions.labels(LEAST_LOADED, pool.ids[order[0]]).inc()
        nothing = np.zeros(len(pool.instances))
        return Plan(pool.dc, pool, decision, order, nothing, (), shared.version, admitted=False)

    def router(self, model: str, dc: str) -> Router:
        key = (model, dc)
        if key not in self._routers:
            router = self._routers[key] = self._make_router(model)
            if isinstance(router, TokenPilot):
                lag = router.token_lag
                self.metrics.token_lag.labels(model, dc).set_function(lambda: lag.lag_s)
        return self._routers[key]


def _none_ready(pool: Pool) -> Refused:
    """The DC's refusal of a request none of its pool can take now: the edge passes it to
    the next DC it may run in (an instance that failed a moment ago, or telemetry that
    says not ready, between the DC's choice and its decision)."""
    message = f"No instance of `{pool.model}` is ready in {pool.dc}."
    return Refused(503, message, RejectReason.NO_CAPACITY)

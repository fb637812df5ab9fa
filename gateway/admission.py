"""Admission on the live path: the gateway hosts ``control.pipeline.Pipeline``, one per
model and DC, as the simulator does.

A request the policy holds waits here, on a future, until a release pass lets it go
(routed), its hold runs out (503), its client leaves (withdrawn from its pool) or the
gateway stops (503: a held request is always answered). Release passes run after each
first token and end, when capacity frees, and every ``tick_s`` besides (holds that run
out, policies that pace their releases). One pass decides against one snapshot of the
pool: the router's own count of what it sent keeps a pass's dispatches apart, as it does
a burst's arrivals. Arrivals that start or join a pool wake the loop too, so that other
replicas hear of them (where none holds a request, within ``IDLE_SHARE_EVERY_S`` or a tick).

Replicas side by side share their pools through the shared state: before each pass (where
no replica holds a request, every ``IDLE_SHARE_EVERY_S`` at most, or at the tick) a replica
publishes its load per pool and class (requests in flight, held, how fast its pool
drains, where its first held request stands, but for those its passes step past), reads
the others' and claims slots of the class ceilings (``SharedState.admission_loads``: a
Redis round trip per pass, off the request's path). A replica that heard of no other at
its last share shares once a tick instead, so a replica that starts beside it is heard of
within a tick, and is counted from then on. Arrivals then queue behind any replica's held
ones, and a held request waits while another replica holds one of its class from before
it, so the pools drain in one order; what a replica reads of the others is as old as
their last pass and a round trip.

A ceiling is kept by slots, since the others' counts may be a pass old: each replica
starts a class's requests only in the slots it holds, and the slots are granted in one
atomic step, the live replicas' together never more than the ceiling. A replica alone
claims the whole ceiling, so that one starting beside it gets slots only once the first
has heard of it and given back what it does not run (``join`` hears of the others before
the first request). Side by side, a replica claims what it runs and what it needs next
(``_needed``), so that a request of a limited class may wait a pass for its slot even when
the ceiling has room; the first request of a pool claims before it is admitted
(``open_pool``, on the request's path once per pool). A replica that dies stops counting,
and its slots free, within the shared state's time to live (one that stops leaves at
once); its held clients lose their connection with it. A replica whose shares fail keeps
what it last heard a little less long (``heard_for_s``), then decides alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass

from control.admission.registry import Admission
from control.admission.request import PRIORITY, AdmissionRequest
from control.admission.slomax import SLOMax
from control.admission.view import Verdict
from control.journal import Journal, JournaledPipeline, Record
from control.pipeline import ClassLoad, Outcome, Pipeline, ReleaseFailed
from control.routing import Decision, FleetSnapshot, Router, RouteRequest
from control.routing.snapshot import BoolArray, Observation
from gateway.admission_loads import decoded, encoded, summed
from gateway.inbound import Inbound
from gateway.metrics import GatewayMetrics
from gateway.refusals import LONGEST_RETRY_AFTER_S, SHUTDOWN, refusal
from gateway.state import LEAVE, AdmissionLoads, SlotClaim
from schemas.base import TaskClass
from schemas.control import AdmissionQuotas, ClassQuota
from schemas.objectives import Objectives

log = logging.getLogger(__name__)

Held = asyncio.Future["Outcome[Held]"]
Key = tuple[str, str]
"""A pipeline's model and DC."""
Claims = dict[str, tuple[tuple[str, TaskClass], SlotClaim]]
"""This replica's slot claims by name, each with the pool (``_pool_name``) and class it
is of."""

LEAVING_S = 1.0
"""How long a stopping replica tries to give its slots back (a share on its way first)."""
IDLE_SHARE_EVERY_S = 0.02
"""Beside other replicas, where none holds a request (as last heard), how often at most a
replica shares its load before a pass; a pass with no share due leaves it to the next
pass or the tick, so a change reaches the others within ``tick_s``. Every first token and
end wakes a pass: shared before each, two replicas on one Redis made 1.1 load shares a
request (2.64 Redis calls a request in all, against 1.2 for a replica alone; two
gateways on one Redis at about 280 requests a second, 2026-12-07). What such a share
tells the others is this replica's counts in flight, which their admission reads as class
totals; ceilings are kept by slots. While any replica holds a request (one that waits
for a slot among them), every replica shares before every pass, as before."""


class GatewayAdmission:
    def __init__(
        self,
        make_admission: Callable[[str], Admission],
        router_for: Callable[[str, str], Router],
        snapshot_for: Callable[[str, str], Awaitable[FleetSnapshot]],
        objectives: Objectives,
        metrics: GatewayMetrics,
        loads: Callable[[str, Mapping[str, SlotClaim]], Awaitable[AdmissionLoads]],
        journal_for: Callable[[str, str], tuple[Journal, Record]] | None = None,
        tick_s: float = 0.05,
        *,
        pool_now: Callable[[str, str], tuple[int, AdmissionQuotas | None]],
        heard_for_s: float = 1.5,
    ) -> None:
        """``snapshot_for(model, dc)``: the pool's snapshot now, for a release pass;
        ``loads``: publish this replica's admission load, read the others' and claim
        ceiling slots (``SharedState.admission_loads``); ``journal_for(model, dc)``: a
        new pool's journal and recipe (None: pipelines keep none); ``pool_now(model,
        dc)``: the pool's ready instances and its DC's quotas now, which its ceilings are
        claimed by (every replica reads them from the same telemetry and control);
        ``heard_for_s``: how long, from the start of its last share that succeeded, what
        the replica heard stands while its shares fail: 1.5 s, as long as the others count
        it (``RedisState.load_ttl_s``, 2 s from that share's script) less one call's
        timeout (0.5 s), which the failing share that finds it over may take."""
        self._make_admission = make_admission
        self._router_for = router_for
        self._snapshot_for = snapshot_for
        self.objectives = objectives
        self.metrics = metrics
        self.tick_s = tick_s
        self._loads = loads
        self._pool_now = pool_now
        self._journal_for = journal_for
        self._pipelines: dict[Key, Pipeline[Held]] = {}
        self._peers: dict[str, dict[TaskClass, ClassLoad]] = {}
        """The other replicas' load, by pool (``_pool_name``)."""
        self._slots: dict[str, dict[TaskClass, int]] = {}
        """This replica's slots of each pool's class ceilings, as last granted."""
        self._served: set[Key] = set()
        """The pools this replica served (a pipeline may be made for a DC's view alone)."""
        self.replicas = 1
        """The replicas sharing the pools, this one included, as last heard: those that
        serve a pool (a replica that has served none yet has nothing to tell, and hears
        of the others at its own ticks; until the others hear of its pools, they claim
        as if alone, the whole of each ceiling, and it waits for its slots)."""
        self._changed = asyncio.Event()
        self._sharing = asyncio.Lock()
        self.heard_for_s = heard_for_s
        self._heard_at = -float("inf")
        """When a share last succeeded."""
        self._failing = False
        self._shared_at = -float("inf")
        self._published_holding = False
        """Whether the load this replica last shared held requests: the others wait on
        them until a share says they are gone."""
        self._closing = False

    def pipeline(self, model: str, dc: str) -> Pipeline[Held]:
        key = (model, dc)
        if key not in self._pipelines:
            admission, router = self._make_admission(model), self._router_for(model, dc)
            objectives, name = self.objectives.classes, _pool_name(key)
            peers, slots = self._peers.get(name, {}), self._slots_of(name)
            if self._journal_for is None:
                pipeline: Pipeline[Held] = Pipeline(
                    admission, router, objectives, peers=peers, slots=slots
                )
            else:
                journal, recipe = self._journal_for(model, dc)
                pipeline = JournaledPipeline(
                    admission,
                    router,
                    objectives,
                    peers=peers,
                    slots=slots,
                    journal=journal,
                    recipe=recipe,
                )
            self._pipelines[key] = pipeline
        return self._pipelines[key]

    async def open_pool(self, model: str, dc: str) -> None:
        """Before a pool's first request here, beside other replicas: claim its ceiling
        slots now, a round trip once per pool with a ceiling, so that the request need
        not wait a pass in the pool for one."""
        key = (model, dc)
        if key in self._served or self.replicas == 1 or self._closing:
            return
        self._served.add(key)
        if self._pool_claims(key, self.pipeline(model, dc)):
            await self._shared_loads()

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
        self._served.add((inbound.model.name, dc))
        answer: Held = asyncio.get_running_loop().create_future()
        request = _admitting(inbound, arrived, self.objectives)
        outcome = pipeline.arrive(request, route, answer, snapshot, time.monotonic())
        self._count(outcome, inbound.model.name, dc)
        if outcome.admission.verdict is not Verdict.REJECT:
            self.wake()  # the other replicas hear of it at once
        if outcome.admission.verdict is Verdict.HOLD:
            if self._closing:
                self.answer_held(SHUTDOWN)
            return Waiting(self, inbound.model.name, dc, inbound.request_id, answer)
        if outcome.admission.verdict is Verdict.REJECT:
            pool = pipeline.pool_state(request.task_class, time.monotonic())
            stalled = bool(pool.depth) and not snapshot.ready.any()
            wait_s = LONGEST_RETRY_AFTER_S if stalled else pool.expected_wait_s()
            raise refusal(outcome, waited=False, pool_wait_s=wait_s)
        return _routed(outcome, waited=False)

    def upstream_body(self, inbound: Inbound, dc: str, engine: str) -> bytes:
        """The body to send an instance of ``engine``: as the client sent it, but where
        the engines schedule by priority (vLLM's ``--scheduling-policy priority``), with
        the class's ``priority`` in place of any the client set: a tenant kept to batch
        must not send ``-100`` and run ahead of every chat, preempting them when KV runs
        out. vLLM runs low values first; SGLang, by default, high values first (its
        ``--schedule-low-priority-values-first`` is off), so it is sent the negated value:
        sent as is, its batch requests ran ahead of the chats."""
        if inbound.by_load:  # never admitted: no pipeline of its own
            return inbound.body
        admission = self.pipeline(inbound.model.name, dc).admission
        if admission.engine_scheduling != "priority":
            return inbound.body
        body = json.loads(inbound.body)
        priority = PRIORITY[inbound.task_class]
        body["priority"] = -priority if engine == "sglang" else priority
        return json.dumps(body).encode()

    def reroutes(self, inbound: Inbound, dc: str) -> bool:
        """Whether the request's router can forget a pick, so that it may pick again."""
        return not inbound.by_load and self.pipeline(inbound.model.name, dc).reroutes

    def first_token(self, inbound: Inbound, dc: str) -> None:
        """The books of admission and the router, which a request routed by load is in
        neither of (here and below)."""
        if not inbound.by_load:
            self.pipeline(inbound.model.name, dc).first_token(inbound.request_id, time.monotonic())
            self.wake()

    def left_instance(self, inbound: Inbound, dc: str) -> None:
        if not inbound.by_load:
            self.pipeline(inbound.model.name, dc).left_instance(inbound.request_id)

    def finished(
        self,
        inbound: Inbound,
        dc: str,
        completed_tokens: int = 0,
        observation: Observation | None = None,
        *,
        cancelled: bool = False,
    ) -> None:
        if inbound.by_load:
            return
        self.pipeline(inbound.model.name, dc).finished(
            inbound.request_id,
            time.monotonic(),
            completed_tokens=completed_tokens,
            observation=observation,
            cancelled=cancelled,
        )
        self.wake()

    def wake(self) -> None:
        """A pass is due now, not at the next tick: capacity freed, or a request came."""
        self._changed.set()

    async def join(self) -> None:
        """Hear of the replicas already sharing the pools, before the first request: a
        replica that counted itself alone would keep the whole of each ceiling itself
        until its first pass."""
        await self._shared_loads()

    async def run(self) -> None:
        """Release passes until cancelled; every held request is answered on the way out."""
        try:
            while True:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._changed.wait(), self.tick_s)
                self._changed.clear()
                if self._sharing_due():
                    await self._shared_loads()
                try:
                    if await self.release_pass() and self.replicas > 1:
                        await self._shared_loads()
                except Exception:  # a bug in one pass must not leave every hold waiting
                    log.exception("admission release pass failed")
        finally:
            self.answer_held(SHUTDOWN)
            with contextlib.suppress(Exception):  # the others stop counting this replica
                async with asyncio.timeout(LEAVING_S), self._sharing:
                    await self._loads(LEAVE, {name: SlotClaim(0, 0, 0) for name in self._claims()})

    def _sharing_due(self) -> bool:
        """Before every pass while other replicas share the pools and any of them holds
        requests (``_anyone_holds``); where none does, before a pass every
        ``IDLE_SHARE_EVERY_S`` at most, else at the next tick; alone as last heard, once a
        tick, which is how soon it hears of a replica that starts (a round trip per pass,
        most of a lone replica's calls to Redis, would tell no one)."""
        since = time.monotonic() - self._shared_at
        if self.replicas == 1:
            return since >= self.tick_s
        return self._anyone_holds() or since >= IDLE_SHARE_EVERY_S

    def _anyone_holds(self) -> bool:
        """Whether a request is held here, in the load last shared, or by another replica
        in a pool this one serves, as last heard: while one is, the pools' order and the
        slots move at each pass."""
        served = {_pool_name(key) for key in self._served}
        peers = any(load.held for name in served for load in self._peers.get(name, {}).values())
        return self._holding_here() or peers or self._published_holding

    def _holding_here(self) -> bool:
        return any(len(pipeline.pools) for pipeline in self._pipelines.values())

    async def _shared_loads(self) -> None:
        """``share_loads``, one at a time (a grant read after a later one would undo it).
        A failure never stops the releases: the replica keeps the others' loads and its
        slots as last heard for ``heard_for_s``, as long as the others count it after its
        last share, then decides alone until a share succeeds again."""
        async with self._sharing:
            self._shared_at = time.monotonic()
            try:
                await self.share_loads()
            except Exception as exc:
                if not self._failing:  # said once a run of failures; a bug with its trace
                    away = isinstance(exc, ConnectionError | TimeoutError)
                    log.warning("sharing admission load failed: %r", exc, exc_info=not away)
                    self._failing = True
                if time.monotonic() - self._heard_at > self.heard_for_s:
                    self.replicas = 1
                    self._give_slots({})
                    self._take_peers({})
            else:  # the others count this replica from when its share began, at the latest
                self._failing, self._heard_at = False, self._shared_at

    def close(self) -> None:
        """The gateway is stopping: answer every held request now, and any held later."""
        self._closing = True
        self.answer_held(SHUTDOWN)

    @property
    def closing(self) -> bool:
        """Whether the gateway is stopping (``close``)."""
        return self._closing

    async def release_pass(self) -> int:
        """Offer each pipeline's pools the capacity there is now; how many held requests
        it answered."""
        answered = 0
        for (model, dc), pipeline in list(self._pipelines.items()):
            if not len(pipeline.pools):
                continue
            pipeline.quotas = _class_quotas(self._pool_now(model, dc)[1])  # renewed meanwhile
            snapshot = await self._snapshot_for(model, dc)
            try:
                outcomes = pipeline.release(_always(snapshot), time.monotonic())
            except ReleaseFailed as failed:  # what it decided is answered, the rest held
                log.error("%s@%s: a release pass failed", model, dc, exc_info=failed.__cause__)
                outcomes = failed.outcomes
            for outcome in outcomes:
                self._count(outcome, model, dc)
                _answer(outcome)
                answered += 1
        return answered

    async def share_loads(self) -> None:
        """Publish this replica's load on each pool, take in the other replicas' (on
        pools this replica has not served yet too, for its first request there), and the
        ceiling slots granted to it."""
        now, wall = time.monotonic(), time.time()
        own = {
            _pool_name(key): encoded(pipeline.load(now), wall - now)
            for key, pipeline in self._pipelines.items()
        }
        claims = self._claims()
        self._keep_within(claims)
        holding = self._holding_here()
        self._published_holding |= holding  # a call that fails may have been stored
        shared = await self._loads(json.dumps(own), {n: c for n, (_, c) in claims.items()})
        self._published_holding = holding
        others = [load for raw in shared.others if (load := decoded(raw, now - wall)) is not None]
        self.replicas = 1 + sum(1 for other in others if other)
        names = {name for other in others for name in other}
        slots: dict[str, dict[TaskClass, int]] = {}
        for claim, granted in shared.granted.items():
            pool, task_class = claims[claim][0]
            slots.setdefault(pool, {})[task_class] = granted
        self._give_slots(slots)
        self._take_peers({name: summed([o[name] for o in others if name in o]) for name in names})

    def _claims(self) -> Claims:
        """The slots this replica claims of each class ceiling of the pools it served, by
        claim name, with the pool and class each is of."""
        claims: Claims = {}
        for key in self._served:
            claims |= self._pool_claims(key, self._pipelines[key])
        return claims

    def _pool_claims(self, key: Key, pipeline: Pipeline[Held]) -> Claims:
        """The pool's claims: alone, the whole of each ceiling; beside others, the slots
        it runs and those it needs next (``_needed``). Ceilings as they are now."""
        ready, quotas = self._pool_now(*key)
        name, claims = _pool_name(key), Claims()
        for task_class in TaskClass:
            limit = self._limit(pipeline, task_class, ready, _class_quotas(quotas))
            if limit is None:
                continue
            running = pipeline.inflight[task_class]
            wanted = limit if self.replicas == 1 else running + _needed(pipeline, task_class)
            claim = SlotClaim(running, wanted, limit)
            claims[f"{name}/{task_class.value}"] = ((name, task_class), claim)
        return claims

    def _keep_within(self, claims: Claims) -> None:
        """While its claim is on its way, a replica beside others starts no more of a
        class than the claim asks for: a request started meanwhile in a slot the claim
        gives back would be in no replica's grant."""
        if self.replicas == 1:
            return
        slots = {pool: dict(held) for pool, held in self._slots.items()}
        for (pool, task_class), claim in claims.values():
            held = slots.setdefault(pool, {})
            held[task_class] = min(held.get(task_class, 0), claim.wanted)
        self._give_slots(slots)

    def _give_slots(self, slots: dict[str, dict[TaskClass, int]]) -> None:
        """This replica's slots from now on, by pool, in each pipeline (none while it is
        alone: ``_slots_of``)."""
        self._slots = slots
        for key, pipeline in self._pipelines.items():
            pipeline.slots = self._slots_of(_pool_name(key))

    def _slots_of(self, pool: str) -> dict[TaskClass, int] | None:
        """This replica's slots of ``pool``'s ceilings (None: it is alone and keeps them
        itself; none granted yet: none)."""
        return None if self.replicas == 1 else self._slots.get(pool, {})

    def pool_load(
        self, model: str, dc: str
    ) -> tuple[dict[TaskClass, int], dict[TaskClass, int], float]:
        """The pool's requests in flight and held, by class, and sent into it per second,
        across the replicas (the others' as they last shared them)."""
        pipeline = self._pipelines.get((model, dc))
        peers = self._peers.get(_pool_name((model, dc)), {})
        now = time.monotonic()
        inflight, held = {}, {}
        for c in TaskClass:
            peer = peers.get(c, ClassLoad())
            inflight[c] = (pipeline.inflight[c] if pipeline else 0) + peer.inflight
            held[c] = (pipeline.pools.state(c, now).depth if pipeline else 0) + peer.held
        sent = pipeline.arrived_per_s(now) if pipeline else 0.0
        return inflight, held, sent + sum(p.arrived_per_s for p in peers.values())

    def concurrency_limit(
        self, model: str, dc: str, task_class: TaskClass, ready: int, quotas: AdmissionQuotas | None
    ) -> int | None:
        """How many requests of ``task_class`` the pool's admission runs at once (None: no
        limit, or an admission policy that sets none)."""
        pipeline = self.pipeline(model, dc)
        return self._limit(pipeline, task_class, ready, _class_quotas(quotas))

    @staticmethod
    def _limit(
        pipeline: Pipeline[Held],
        task_class: TaskClass,
        ready: int,
        quotas: Mapping[TaskClass, ClassQuota],
    ) -> int | None:
        """The class ceiling of the pipeline's admission with ``ready`` instances, under
        ``quotas``."""
        admission = pipeline.admission
        if not isinstance(admission, SLOMax):
            return None
        return admission.concurrency_limit(task_class, quotas, ready)

    def _take_peers(self, peers: dict[str, dict[TaskClass, ClassLoad]]) -> None:
        """The other replicas' load from now on, by pool."""
        self._peers = peers
        for key, pipeline in self._pipelines.items():
            pipeline.peers = peers.get(_pool_name(key), {})

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
                pipeline.finished(self.request_id, time.monotonic(), cancelled=True)
            self.host.pool_depths(self.model, self.dc)
            self.host.wake()  # a pass, whose share tells the others it is gone
            raise
        return _routed(outcome, waited=True)


def _pool_name(key: Key) -> str:
    model, dc = key
    return f"{model}/{dc}"


def _needed(pipeline: Pipeline[Held], task_class: TaskClass) -> int:
    """The slots of ``task_class`` a replica beside others claims beyond those it runs:
    one per request it holds, if its first stands before the first the others hold (as
    last heard), so that slots go where the pool order says the next request is; one for
    the next arrival where no replica holds any, so that it need not wait a pass; else
    none."""
    head = pipeline.pools.head(task_class)
    if head is None:
        peer = pipeline.peers.get(task_class)
        return 1 if peer is None or peer.held == 0 else 0
    if pipeline.peer_first(head.request):
        return 0
    return pipeline.pools.state(task_class, time.monotonic()).depth


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
        raise refusal(outcome, waited=waited)
    assert outcome.route is not None
    return Admitted(outcome.route, outcome.admission.allowed)


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

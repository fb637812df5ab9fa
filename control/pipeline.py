"""The request path in one DC, admit -> choose the instance, as one object that the
simulator and the gateway both host.

The pipeline keeps what the decisions need between requests (the class pools, each
class's requests in flight, the latest quotas) and nothing of the host's I/O: the host
hands it requests and snapshots, and acts on the outcomes. It also keeps the router's
books: the host tells the pipeline of each first token, end and cancellation, and the
pipeline tells admission and the router, as far as the router wants to know
(``FollowsRequests``, ``Learner``, ``Withdrawing``). A pipeline serves one DC's pool: the
DC is chosen before it (``control.fleet``), since admission's pools and ceilings are each
DC's own.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Generic, TypeVar, cast

import numpy as np

from control.admission.pools import ClassPools, Waiting, order_key
from control.admission.registry import Admission
from control.admission.request import AdmissionRequest
from control.admission.view import (
    PREFILL_WAIT,
    SLOT_WAIT,
    USAGE_WINDOW_S,
    AdmissionDecision,
    AdmissionView,
    PoolState,
    Usage,
    Verdict,
)
from control.fleet.load import Rate
from control.routing import (
    Decision,
    FleetSnapshot,
    FollowsRequests,
    Learner,
    PredictsTtft,
    ReadsKvEvents,
    Router,
    RouteRequest,
    Withdrawing,
)
from control.routing.inflight import InFlight
from control.routing.registry import implements
from control.routing.snapshot import BoolArray, FloatArray, IntArray, KvEvent, Observation
from schemas.base import TaskClass
from schemas.control import ClassQuota
from schemas.objectives import DEFAULT_OBJECTIVES, ClassObjective
from schemas.openai_api import DEFAULT_CHAT_TOKENS

Payload = TypeVar("Payload")

RELEASE_ORDER = (TaskClass.INTERACTIVE, TaskClass.LONG_DOCUMENT, TaskClass.BATCH)
"""The order pools are offered freed capacity in: the class with the tightest objective
first."""


@dataclass(frozen=True)
class Outcome(Generic[Payload]):
    """What became of a request: admission's decision and, if it was dispatched, the
    router's (whose ``chosen`` is None when no allowed instance was ready)."""

    request: AdmissionRequest
    payload: Payload
    admission: AdmissionDecision
    route: Decision | None = None

    @property
    def instance(self) -> int | None:
        return None if self.route is None else self.route.chosen


ROUTING_FAILED = "routing_failed"
"""The reason of a held request refused because its admission policy or its router
failed on it."""


class ReleaseFailed(Exception, Generic[Payload]):
    """A release pass that failed part way (its cause chained): ``outcomes`` are what it
    decided before, and the request it failed on, refused (``ROUTING_FAILED``), which the
    host must answer; the requests it had not reached are held still, for a later pass or
    their expiry. Raised whole, the pass's error lost the requests it had taken out
    (expired ones, and heads already let go): their clients were never answered, and those
    let go counted in flight for good."""

    def __init__(self, outcomes: list[Outcome[Payload]]) -> None:
        super().__init__(f"a release pass failed after {len(outcomes)} outcomes")
        self.outcomes = outcomes

    def __reduce__(self) -> tuple[type[ReleaseFailed[Payload]], tuple[list[Outcome[Payload]]]]:
        return type(self), (self.outcomes,)  # from a worker process, outcomes and all


def check_pairing(admission: Admission, router: Router) -> None:
    """ValueError where ``admission`` cannot decide behind ``router``: one that needs a TTFT
    prediction behind a router that makes none would refuse every request."""
    if admission.needs_prediction and not implements(router, PredictsTtft):
        raise ValueError(
            f"admission {admission.name!r} needs a router that predicts TTFT, as tokenpilot "
            f"does; behind {router.name!r} it would refuse every request"
        )


@dataclass(frozen=True, slots=True)
class Charge:
    """What a routed request counts on its instance in its host's books (the simulator's
    arrays, a gateway's shared state), defined once so that both hosts count alike: the
    prompt tokens the router did not expect cached, pending prefill until the first token,
    and the prompt and output budget, in flight until the request ends."""

    pending_prefill: float
    inflight_tokens: int

    @classmethod
    def of(cls, input_tokens: int, output_budget: int, expected_cached: float) -> Charge:
        """The charge of a request routed where ``expected_cached`` of its prompt tokens
        were expected cached (at most the prompt)."""
        pending = input_tokens - min(expected_cached, input_tokens)
        return cls(pending, input_tokens + output_budget)

    @classmethod
    def routed(
        cls, input_tokens: int, client_cap: int | None, route: Decision, index: int
    ) -> Charge:
        """The charge of a request ``route`` sent to instance ``index``, as the simulator
        books it: nothing expected cached where the router predicts nothing (the whole
        prompt), and a chat's default budget where the client set no cap."""
        cached = 0.0 if route.cached_tokens is None else float(route.cached_tokens[index])
        return cls.of(input_tokens, client_cap or DEFAULT_CHAT_TOKENS, cached)


@dataclass(frozen=True)
class ClassLoad:
    """One class's load on one host of a pool that several hosts share (gateway replicas
    side by side): what the others count in, so that ceilings and pool order hold across
    all of them."""

    inflight: int = 0
    decoding: int = 0
    """Of those in flight, the ones that have their first token."""
    held: int = 0
    drained_per_s: float = 0.0
    head_key: float | None = None
    """Where the host's first held request stands in the pool's order (``order_key``, on
    the reader's clock), leaving out those its passes step past (``ClassPools.lead``):
    the others would wait behind a request that waits only for room of its own; None
    when it holds none but those."""
    arrived_per_s: float = 0.0
    """Requests of the class that came to the host's pipeline lately (``RATE_WINDOW_S``),
    admitted or not: the rate the host sends into the pool's DC."""

    def __add__(self, other: ClassLoad) -> ClassLoad:
        heads = [k for k in (self.head_key, other.head_key) if k is not None]
        return ClassLoad(
            self.inflight + other.inflight,
            self.decoding + other.decoding,
            self.held + other.held,
            self.drained_per_s + other.drained_per_s,
            min(heads) if heads else None,
            self.arrived_per_s + other.arrived_per_s,
        )


@dataclass
class _Held(Generic[Payload]):
    route: RouteRequest
    payload: Payload


@dataclass
class Pipeline(Generic[Payload]):
    admission: Admission
    router: Router
    objectives: Mapping[TaskClass, ClassObjective] = field(
        default_factory=lambda: dict(DEFAULT_OBJECTIVES)
    )
    quotas: Mapping[TaskClass, ClassQuota] = field(default_factory=dict)
    """The latest quota per class; the host replaces it when the controller publishes."""
    peers: Mapping[TaskClass, ClassLoad] = field(default_factory=dict)
    """The other hosts' load on the same pool, summed (none: this host is alone); the host
    replaces it as it hears from them. Admission counts it in, and a held request waits
    while a peer holds one of its class that stands before it and that the peer's passes
    do not step past (``ClassLoad.head_key``)."""
    slots: Mapping[TaskClass, int] | None = None
    """This host's slots of each class ceiling, where the pool's hosts hold the slots of
    one ceiling apart (gateway replicas side by side; a class not named has none); None:
    the host keeps the ceilings itself. The host replaces it as slots are granted."""
    pools: ClassPools[_Held[Payload]] = field(default_factory=ClassPools)
    inflight: Counter[TaskClass] = field(default_factory=Counter)
    usage: dict[TaskClass, Usage] = field(default_factory=dict)
    """Each class's usage in the current window (``USAGE_WINDOW_S``)."""
    _window_opened_at: float = -math.inf
    _first_tokens: dict[str, float] = field(default_factory=dict)
    """Requests in flight that have their first token, and when it came (in that order)."""
    _classes: dict[str, TaskClass] = field(default_factory=dict)
    _seated: InFlight = field(default_factory=InFlight)
    """Requests in flight on each instance (``AdmissionView.seated``)."""
    _released_at: float = 0.0
    _arrivals: dict[TaskClass, Rate] = field(default_factory=dict)
    _follows: FollowsRequests | None = field(init=False)
    _learner: Learner | None = field(init=False)
    _forgets: Withdrawing | None = field(init=False)
    _kv_reader: ReadsKvEvents | None = field(init=False)

    def __post_init__(self) -> None:
        check_pairing(self.admission, self.router)
        router = self.router
        self._follows = (
            cast(FollowsRequests, router) if implements(router, FollowsRequests) else None
        )
        self._learner = cast(Learner, router) if implements(router, Learner) else None
        self._forgets = cast(Withdrawing, router) if implements(router, Withdrawing) else None
        reads_kv = implements(router, ReadsKvEvents)
        self._kv_reader = cast(ReadsKvEvents, router) if reads_kv else None

    def arrive(
        self,
        request: AdmissionRequest,
        route: RouteRequest,
        payload: Payload,
        fleet: FleetSnapshot,
        now: float,
    ) -> Outcome[Payload]:
        """Decide a new request: dispatched (routed), held in its pool, or rejected."""
        self._arrivals.setdefault(request.task_class, Rate()).add(now)
        decision = self._admit(request, route, fleet, now, held=False)
        if decision.verdict is Verdict.HOLD:
            assert decision.hold_until_s is not None
            drains = decision.reason != SLOT_WAIT
            alone = _steps_past(decision, request.task_class)
            if not self.pools:  # a paced loop's idle ticks let nothing go: none are saved
                self._released_at = max(self._released_at, now)
            held = _Held(route, payload)
            waiting = Waiting(
                request, held, decision.hold_until_s, drains, alone, decision.expires_as
            )
            self.pools.hold(waiting)
            return Outcome(request, payload, decision)
        if decision.verdict is Verdict.REJECT:
            return Outcome(request, payload, decision)
        return self._dispatch(request, route, payload, decision, fleet, now)

    def release(self, fleet: Callable[[], FleetSnapshot], now: float) -> list[Outcome[Payload]]:
        """What the pools let go now: held requests whose time ran out (rejected, with the
        reason their hold named: ``expired``, ``max_hold``), then each pool's heads while
        admission lets them start (``fleet`` gives the snapshot as the host's books stand,
        to which the pass adds the charges of its own dispatches: the host books them only
        once it has the outcomes). A long prompt at a head that waits for prefill room of
        its own keeps its place, and the pass goes on past it; the pool's other hosts do
        not wait behind it (``load``)."""
        outcomes = [
            Outcome(w.request, w.payload.payload, AdmissionDecision(Verdict.REJECT, w.expires_as))
            for w in self.pools.expired(now)
        ]
        aside: list[Waiting[_Held[Payload]]] = []
        try:
            self._release_heads(fleet, now, aside, outcomes)
        except Exception as exc:
            raise ReleaseFailed(outcomes) from exc
        finally:  # held again, even where the pass failed: else no later one would see them
            for waiting in aside:
                self.pools.hold(waiting)
        return outcomes

    def _release_heads(
        self,
        fleet: Callable[[], FleetSnapshot],
        now: float,
        aside: list[Waiting[_Held[Payload]]],
        outcomes: list[Outcome[Payload]],
    ) -> None:
        """Add to ``outcomes`` the pools' heads this pass lets go, in ``RELEASE_ORDER``;
        the heads it steps past go to ``aside``, for the caller to hold again."""
        budget = self._release_budget(now)
        charges = _PassCharges()
        for task_class in RELEASE_ORDER:
            while budget > 0 and (head := self.pools.head(task_class)) is not None:
                if self.peer_first(head.request):
                    break
                budget -= 1
                snapshot = charges.on(fleet())
                held = head.payload
                try:
                    decision = self._admit(head.request, held.route, snapshot, now, held=True)
                except Exception:
                    self.pools.release(task_class, now)
                    outcomes.append(_failed_on(head))
                    raise
                if decision.verdict is Verdict.HOLD:
                    head.waits_alone = _steps_past(decision, task_class)
                    if not head.waits_alone:
                        break
                    aside.append(self.pools.set_aside(task_class))
                    continue
                self.pools.release(task_class, now)
                if decision.verdict is Verdict.REJECT:
                    outcomes.append(Outcome(head.request, held.payload, decision))
                    continue
                try:
                    dispatched = self._dispatch(
                        head.request, held.route, held.payload, decision, snapshot, now
                    )
                except Exception:
                    outcomes.append(_failed_on(head))
                    raise
                outcomes.append(dispatched)
                charges.add(dispatched, len(snapshot))

    def load(self, now: float) -> dict[TaskClass, ClassLoad]:
        """This host's load, per class, for the other hosts of the pool."""
        loads = {}
        decoding = Counter(self._classes[r] for r in self._first_tokens)
        for task_class in TaskClass:
            pool = self.pools.state(task_class, now)
            lead = self.pools.lead(task_class)
            loads[task_class] = ClassLoad(
                self.inflight[task_class],
                decoding[task_class],
                pool.depth,
                pool.drained_per_s,
                None if lead is None else order_key(lead.request),
                self.arrived_per_s(now, task_class),
            )
        return loads

    def arrived_per_s(self, now: float, task_class: TaskClass | None = None) -> float:
        """Requests of ``task_class`` (None: of every class) that came to this host's
        pipeline per second lately (``RATE_WINDOW_S``)."""
        classes = TaskClass if task_class is None else (task_class,)
        return sum(self._arrivals[c].per_s(now) for c in classes if c in self._arrivals)

    def peer_first(self, request: AdmissionRequest) -> bool:
        """Whether a peer holds a request of the class that stands before ``request``."""
        peer = self.peers.get(request.task_class)
        return peer is not None and peer.head_key is not None and peer.head_key < order_key(request)

    def drain(self, reason: str) -> list[Outcome[Payload]]:
        """Answer every held request now (rejected with ``reason``): the host is stopping,
        and a request must not wait for an answer that will never come."""
        answer = AdmissionDecision(Verdict.REJECT, reason)
        return [Outcome(w.request, w.payload.payload, answer) for w in self.pools.take_all()]

    def _release_budget(self, now: float) -> float:
        """How many held requests this pass may take out: any number, unless the policy
        paces its releases (one per tick of its dispatch loop since the pools last held
        nothing or the last pass, the ticks whole: a tick begun before this pass is the
        next pass's; a tick a pass found blocked is spent)."""
        rate = self.admission.release_rate_per_s
        if rate is None:
            return math.inf
        budget = math.floor((now - self._released_at) * rate)
        self._released_at += budget / rate
        return budget

    def withdraw(self, request_id: str) -> bool:
        """A held request's client went away: drop it from its pool; False if it was not
        held (dispatched already, or answered)."""
        return self.pools.withdraw(request_id) is not None

    @property
    def reroutes(self) -> bool:
        """Whether the router can forget a decision, so that the host may decide again."""
        return self._forgets is not None

    def reroute(
        self, route: RouteRequest, fleet: FleetSnapshot, now: float, allowed: BoolArray | None
    ) -> Decision:
        """Decide again, on a fresher snapshot, for a request admission let start (on the
        instances it ``allowed``, None: any ready one); the router forgets its first
        decision. Only where ``reroutes``."""
        assert self._forgets is not None
        self._forgets.withdraw(route.request_id)
        decision = self.router.route(route, _within(fleet, allowed), now)
        if decision.chosen is None:
            self._seated.ended(route.request_id)
        else:
            self._seated.dispatched(route.request_id, decision.chosen)
        return decision

    def first_token(self, request_id: str, now: float) -> None:
        """A dispatched request's first token came."""
        if request_id in self._classes:
            self._first_tokens[request_id] = now
        if self._follows is not None:
            self._follows.first_token(request_id)

    def kv_events(self, instance: int, events: Sequence[KvEvent]) -> None:
        """An instance's KV events reached the host: for routers that read them."""
        if self._kv_reader is not None:
            self._kv_reader.kv_events(instance, events)

    def left_instance(self, request_id: str) -> None:
        """The request left the instance the router chose for it (ended, failed or was
        cancelled there), though it may go on on another."""
        self._left(request_id)

    def _left(self, request_id: str) -> None:
        self._seated.ended(request_id)
        if self._follows is not None:
            self._follows.ended(request_id)

    def finished(
        self,
        request_id: str,
        now: float,
        *,
        completed_tokens: int = 0,
        observation: Observation | None = None,
        cancelled: bool = False,
    ) -> None:
        """A dispatched request ended: completed with ``completed_tokens`` of output (and
        an ``observation`` for the router to learn from, where the host saw one), failed,
        or ``cancelled`` (the router forgets the work it counted for it)."""
        self._first_tokens.pop(request_id, None)
        task_class = self._classes.pop(request_id, None)
        if task_class is not None:
            self.inflight[task_class] -= 1
            self._count(task_class, Usage(output_tokens=completed_tokens), now)
        self._left(request_id)
        if observation is not None and self._learner is not None:
            self._learner.observe(observation)
        if cancelled and self._forgets is not None:
            self._forgets.withdraw(request_id)

    def _count(self, task_class: TaskClass, used: Usage, now: float) -> None:
        if now >= self._window_opened_at + USAGE_WINDOW_S:
            self.usage.clear()
            self._window_opened_at = now
        self.usage[task_class] = self.usage.get(task_class, Usage()) + used

    def _admit(
        self,
        request: AdmissionRequest,
        route: RouteRequest,
        fleet: FleetSnapshot,
        now: float,
        *,
        held: bool,
    ) -> AdmissionDecision:
        predicted = None
        if self.admission.wants_prediction and implements(self.router, PredictsTtft):
            predicted = cast(PredictsTtft, self.router).predict_ttft(route, fleet, now)
        view = AdmissionView(
            now,
            fleet,
            None if predicted is None else predicted.on_each,
            {c: self.pool_state(c, now) for c in TaskClass},
            self._inflight(),
            self.quotas,
            self._current_usage(now),
            MappingProxyType(self._first_tokens),
            sum(p.decoding for p in self.peers.values()),
            self._out_of_slots(),
            self._seated,
            objectives=self.objectives,
            idle_ttft_s=None if predicted is None else predicted.idle_s,
        )
        return self.admission.decide(request, view, held=held)

    def _inflight(self) -> Counter[TaskClass]:
        """Each class's requests in flight from every host of the pool."""
        if not self.peers:
            return self.inflight
        return self.inflight + Counter({c: p.inflight for c, p in self.peers.items()})

    def _out_of_slots(self) -> frozenset[TaskClass]:
        if self.slots is None:
            return frozenset()
        return frozenset(c for c in TaskClass if self.inflight[c] >= self.slots.get(c, 0))

    def pool_state(self, task_class: TaskClass, now: float) -> PoolState:
        """The class's pool as all its hosts hold it."""
        own = self.pools.state(task_class, now)
        peer = self.peers.get(task_class, ClassLoad())
        return PoolState(own.depth + peer.held, own.drained_per_s + peer.drained_per_s)

    def _current_usage(self, now: float) -> dict[TaskClass, Usage]:
        """The window's counts, empty once it has closed (the next count opens a new one)."""
        return self.usage if now < self._window_opened_at + USAGE_WINDOW_S else {}

    def _dispatch(
        self,
        request: AdmissionRequest,
        route: RouteRequest,
        payload: Payload,
        decision: AdmissionDecision,
        fleet: FleetSnapshot,
        now: float,
    ) -> Outcome[Payload]:
        routed = self.router.route(route, _within(fleet, decision.allowed), now)
        if routed.chosen is not None:
            self._seated.dispatched(request.request_id, routed.chosen)
            self.inflight[request.task_class] += 1
            self._classes[request.request_id] = request.task_class
            self._count(request.task_class, Usage(requests=1), now)
        return Outcome(request, payload, decision, routed)


def _failed_on(head: Waiting[_Held[Payload]]) -> Outcome[Payload]:
    """A held request its admission policy or router failed on, refused: held again, first
    in its pool, it would fail every pass and hold the rest of its pool and every class
    after it."""
    refused = AdmissionDecision(Verdict.REJECT, ROUTING_FAILED)
    return Outcome(head.request, head.payload.payload, refused)


def _steps_past(hold: AdmissionDecision, task_class: TaskClass) -> bool:
    """Whether a release pass goes on past a pool head that ``hold`` keeps waiting: where
    it waits for prefill room of its own, a long prompt in a pool of short ones (a chat
    whose client sent a long document as interactive). In the long-document pool every
    request waits for the same room, so the ones behind it would too."""
    return hold.reason == PREFILL_WAIT and task_class is not TaskClass.LONG_DOCUMENT


@dataclass
class _PassCharges:
    """The charges of a release pass's dispatches so far, per instance, as the simulator
    books them once it has the pass's outcomes (``Charge.routed``). A gateway books a
    little otherwise (the shared index's match where the router expects nothing, the
    API's own default budget) and later (when each released request's task runs): near
    enough for the checks of one pass."""

    pending_prefill: FloatArray | None = None
    inflight_tokens: IntArray | None = None

    def add(self, outcome: Outcome[Payload], instances: int) -> None:
        index, request, route = outcome.instance, outcome.request, outcome.route
        if index is None or route is None:
            return
        if self.pending_prefill is None or self.inflight_tokens is None:
            self.pending_prefill = np.zeros(instances)
            self.inflight_tokens = np.zeros(instances, dtype=np.int64)
        charge = Charge.routed(request.input_tokens, request.output_budget, route, index)
        self.pending_prefill[index] += charge.pending_prefill
        self.inflight_tokens[index] += charge.inflight_tokens

    def on(self, fleet: FleetSnapshot) -> FleetSnapshot:
        """``fleet`` with these charges on its instances (none where its instances are not
        the ones they were counted on)."""
        pending, inflight = self.pending_prefill, self.inflight_tokens
        if pending is None or inflight is None or len(fleet) != len(pending):
            return fleet
        return replace(
            fleet,
            pending_prefill_tokens=fleet.pending_prefill_tokens + pending,
            inflight_tokens=fleet.inflight_tokens + inflight,
        )


def _within(fleet: FleetSnapshot, allowed: BoolArray | None) -> FleetSnapshot:
    """The snapshot with only the ``allowed`` instances ready (None: as it is)."""
    return fleet if allowed is None else replace(fleet, ready=fleet.ready & allowed)

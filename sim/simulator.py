"""A discrete-event simulator of a cluster of engines behind a router, in virtual time.

Three kinds of events drive it: a request arrives (the router picks its instance), a
request enters an engine's wait queue (after the step model's admission delay), and an
engine's step ends (its results apply and the next step is planned). Arrivals are read in
order from the workload; the rest (clients' second attempts among them) sit in one heap,
where a retry due at the same moment as a trace arrival comes after it. Ties break by
insertion order, so a run is a deterministic function of its inputs and seed. A router
that reads KV events gets each engine's stored and evicted blocks as the host would:
``token_lag_s`` after the end of the step that stored or evicted them, before its next
decision. A router that follows its requests hears of each one's first token and end.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

import numpy as np

from control.admission.baselines import Fcfs
from control.admission.registry import Admission
from control.admission.request import PRIORITY, AdmissionRequest
from control.admission.view import Verdict
from control.pipeline import Charge, Outcome, Pipeline
from control.routing import (
    Decision,
    FleetSnapshot,
    KvEvent,
    Observation,
    ReadsKvEvents,
    Router,
    RouteRequest,
    implements,
)
from sim.clients import ClientModel
from sim.cluster import Cluster
from sim.control_loop import QuotaLoop
from sim.engine import DecodeRun, Engine, Plan, Sequence, StepPlan
from sim.records import RequestRecord
from sim.workload import TraceRequest

_ENTER, _STEP_END, _HOLD_ENDS, _GIVE_UP, _CONTROL, _RETRY = 0, 1, 2, 3, 4, 5


@dataclass
class _Instance:
    instance_id: str
    dc: str
    engine: Engine
    plan: Plan | None = None
    version: int = 0
    """Bumped whenever the plan's end moves; step-end events of older versions are void."""
    entering: int = 0
    """Requests routed here still in their admission delay."""


Event = Sequence | int | str | TraceRequest
"""What a heap event carries: the sequence entering an engine, a plan's version, the id
of a request whose client gives up, or a client's second attempt."""

HOST_TOKEN_LAG_S = 0.002
"""How late the simulated host sees a step's streamed tokens, unless told otherwise."""


class Simulation:
    """``decode_runs`` lets engines plan decode-only stretches as one event (the results
    are the same; tests compare both ways); switch it off to step one step at a time.
    ``token_lag_s``: how long after a step's end the host sees its streamed tokens."""

    def __init__(
        self,
        cluster: Cluster,
        router: Router,
        *,
        decode_runs: bool = True,
        scrape_interval_s: float = 0.05,
        token_lag_s: float = HOST_TOKEN_LAG_S,
        admission: Admission | None = None,
        clients: ClientModel | None = None,
        control: QuotaLoop | None = None,
    ) -> None:
        self.token_lag_s = token_lag_s
        self.decode_runs = decode_runs
        self.scrape_interval_s = scrape_interval_s
        self._scraped_at = -math.inf
        self.cluster = cluster
        self.router = router
        self.pipeline: Pipeline[TraceRequest] = Pipeline(admission or Fcfs(), router)
        self.clients = clients
        self.control = control
        self._placed: dict[str, tuple[int, Sequence]] = {}
        """Dispatched requests not yet completed: their instance and sequence."""
        self._open: dict[str, TraceRequest] = {}
        """Requests whose clients may still give up: arrived, and not yet ended."""
        self._kv_events = implements(router, ReadsKvEvents)
        self._kv_in_transit: deque[tuple[float, int, list[KvEvent]]] = deque()
        scheduling = self.pipeline.admission.engine_scheduling
        self.instances = [
            _Instance(
                f"{dc.name}/{n}",
                dc.name,
                Engine(
                    replace(dc.profile.engine, scheduling_policy=scheduling),
                    dc.profile.step_time,
                    kv_events=self._kv_events,
                ),
            )
            for dc in cluster.data_centers
            for n in range(dc.instances + dc.standby)
        ]
        size = len(self.instances)
        self._ids = tuple(i.instance_id for i in self.instances)
        self._ready = np.array(
            [
                n < dc.instances
                for dc in cluster.data_centers
                for n in range(dc.instances + dc.standby)
            ],
            dtype=np.bool_,
        )
        self._waiting = np.zeros(size, dtype=np.int64)
        self._running = np.zeros(size, dtype=np.int64)
        self._inflight = np.zeros(size, dtype=np.int64)
        self._kv_used = np.zeros(size, dtype=np.int64)
        self._kv_total = np.array([i.engine.config.num_blocks for i in self.instances])
        self._kv_block_size = np.array([i.engine.config.block_size for i in self.instances])
        self._kv_block_size.flags.writeable = False  # fixed: every snapshot shares it
        self._pending_prefill = np.zeros(size, dtype=np.float64)
        self._charges: dict[str, Charge] = {}
        """Each dispatched request's charge on its instance until it ends, its pending
        prefill settled (to zero) at its first token."""
        self._token_steps = np.full((size, 2), -np.inf)
        """Each engine's last two ends of a step that streamed tokens: older, newer."""
        self._heap: list[tuple[float, int, int, int, Event]] = []
        self._order = 0
        self.records: list[RequestRecord] = []
        self.now = 0.0
        self.arrivals_pending = False
        """Whether requests are still to arrive from outside (the control loop runs on)."""
        self.reenter: Callable[[TraceRequest], None] | None = None
        """Where a client's second attempt goes (None: back to this host): a fleet's
        edge, which chooses its DC again."""
        self.fall_back: Callable[[TraceRequest], bool] | None = None
        """Offered each request this host refuses, before any token: True when it took
        the request elsewhere (a fleet's edge, trying the next DC), so it is no refusal."""

    def run(self, requests: Iterable[TraceRequest]) -> list[RequestRecord]:
        """Serve every request to the end; records come in completion order."""
        arrivals = iter(requests)
        upcoming = next(arrivals, None)
        if upcoming is not None:
            self.start(upcoming.arrival_s)
        while upcoming is not None or self._heap:
            self.arrivals_pending = upcoming is not None
            if upcoming is not None and upcoming.arrival_s <= self.next_event_s():
                self.arrive(upcoming, upcoming.arrival_s)
                upcoming = next(arrivals, None)
                continue
            self.step()
        self.finish()
        return self.records

    def start(self, first_arrival_s: float) -> None:
        """Schedule the control loop's first pass, one period after the first arrival."""
        if self.control is not None:
            self._push(first_arrival_s + self.control.period_s, _CONTROL, -1, 0)

    def next_event_s(self) -> float:
        """When the next event in the simulation's own heap is due (inf: none is)."""
        return self._heap[0][0] if self._heap else math.inf

    def arrive(self, request: TraceRequest, now: float) -> None:
        """A request reaches the host at ``now``: admission and routing decide it."""
        self.now = now
        self._arrive(request)

    def step(self) -> None:
        """Handle the next event of the heap; ``arrivals_pending`` tells the control loop
        whether to schedule its next pass when the heap is otherwise empty."""
        self.now, _, kind, index, payload = heapq.heappop(self._heap)
        if kind == _ENTER:
            assert isinstance(payload, Sequence)
            self._enter(index, payload)
        elif kind == _HOLD_ENDS:
            self._release()
        elif kind == _CONTROL:
            self._reconcile()
        elif kind == _RETRY:
            assert isinstance(payload, TraceRequest)
            (self.reenter or self._arrive)(payload)
        elif kind == _GIVE_UP:
            assert isinstance(payload, str)
            self._give_up(payload, first_token_only=bool(index))
        elif payload == self.instances[index].version:
            self._end_step(index)
            self._release()

    def finish(self) -> None:
        """Deliver what was still on its way once nothing is left to run."""
        self._deliver_kv_events(until=math.inf)

    def set_ready(self, index: int, ready: bool) -> None:
        """An instance starts taking requests (its replica loaded) or stops (drained:
        what runs there finishes)."""
        self._ready[index] = ready

    @property
    def ready_engines(self) -> list[tuple[str, Engine]]:
        """The instances taking requests, as the collector reports them."""
        ready = zip(self.instances, self._ready, strict=True)
        return [(i.instance_id, i.engine) for i, ok in ready if ok]

    def _reconcile(self) -> None:
        assert self.control is not None
        engines = self.ready_engines
        if (quotas := self.control.tick(self.records, engines, self.now)) is not None:
            self.pipeline.quotas = quotas
        if self.arrivals_pending or self._heap:
            self._push(self.now + self.control.period_s, _CONTROL, -1, 0)

    @property
    def engines(self) -> list[Engine]:
        return [i.engine for i in self.instances]

    def fleet(self) -> FleetSnapshot:
        return FleetSnapshot(
            self._ids,
            self._ready.copy(),
            self._waiting.copy(),
            self._running.copy(),
            self._inflight.copy(),
            self._kv_used.copy(),
            self._kv_total.copy(),
            self._pending_prefill.copy(),
            self._last_step_ends(),
            self._kv_block_size,
        )

    def _last_step_ends(self) -> np.ndarray:
        """When the host saw each engine's last step end that streamed a token other than
        a first one (as the gateway counts them), ``token_lag_s`` after it; a decode run's
        steps end on a schedule known in advance."""
        seen_by = self.now - self.token_lag_s
        newer, older = self._token_steps[:, 1], self._token_steps[:, 0]
        ends = np.where(newer <= seen_by, newer, np.where(older <= seen_by, older, -np.inf))
        for index, instance in enumerate(self.instances):
            plan = instance.plan
            if isinstance(plan, DecodeRun) and (ended := plan.steps_ended_by(seen_by)):
                ends[index] = plan.ends_s[ended - 1]
        return ends + self.token_lag_s

    def _tokens_streamed(self, index: int) -> None:
        self._token_steps[index] = (self._token_steps[index, 1], self.now)

    def _arrive(self, request: TraceRequest) -> None:
        self._look()
        if self.clients is not None and (gives_up := self.clients.gives_up_at(request)):
            at, first_token_only = gives_up
            self._open[request.request_id] = request
            self._push(at, _GIVE_UP, int(first_token_only), request.request_id)
        route = RouteRequest(
            request.request_id,
            request.input_tokens,
            request.max_tokens,  # what a gateway knows of the length: the client's cap
            request.prefix_blocks,
            request.task_class.value,
        )
        self._settle(
            self.pipeline.arrive(_admitting(request), route, request, self.fleet(), self.now)
        )

    def _look(self) -> None:
        """Bring the host's view up to now: a scrape if the last is stale, and the KV
        events that have arrived."""
        if self.now - self._scraped_at >= self.scrape_interval_s:
            self._scrape()
        self._deliver_kv_events()

    def _release(self) -> None:
        """Offer the class pools what capacity there is now (after a step ends, and when a
        held request's time runs out)."""
        if len(self.pipeline.pools):
            self._look()
            for outcome in self.pipeline.release(self.fleet, self.now):
                self._settle(outcome)

    def _settle(self, outcome: Outcome[TraceRequest]) -> None:
        """Act on the pipeline's outcome: dispatch the request to its instance, remember
        when its hold ends, or record its rejection."""
        request, index = outcome.payload, outcome.instance
        until = outcome.admission.hold_until_s
        if outcome.admission.verdict is Verdict.HOLD:
            if until is not None and math.isfinite(until):
                self._push(max(until, self.now), _HOLD_ENDS, -1, 0)
            return
        if index is None or not self.instances[index].engine.accepts(request):
            self._open.pop(request.request_id, None)
            self.pipeline.finished(request.request_id, self.now)
            if self.fall_back is not None and self.fall_back(request):
                return
            self.records.append(RequestRecord.rejected(request, self.now))
            self.come_back(request, self.now, outcome.admission.retry_after_s)
            return
        assert outcome.route is not None
        self._dispatch(index, request, outcome.route)

    def _dispatch(self, index: int, request: TraceRequest, decision: Decision) -> None:
        instance = self.instances[index]
        self._charge(index, request, decision)
        delay = instance.engine.step_time.admission_delay_s(request.input_tokens)
        instance.entering += 1
        sequence = Sequence(request, self.now, priority=PRIORITY[request.task_class])
        if request.request_id in self._open:
            self._placed[request.request_id] = (index, sequence)
        self._push(self.now + delay, _ENTER, index, sequence)

    def _give_up(self, request_id: str, *, first_token_only: bool) -> None:
        """The client stops waiting: a held request leaves its pool, a dispatched one is
        cancelled on its engine (unless its first token came, when that was all the
        client waited for); the client may come back once."""
        request = self._open.pop(request_id, None)
        if request is None:
            return  # it ended already
        placed = self._placed.get(request_id)
        if placed is None:
            if not self.pipeline.withdraw(request_id):
                return
            self.records.append(RequestRecord.cancelled(request, self.now, None, None))
            self.come_back(request, self.now, None)
            return
        index, sequence = placed
        plan = self.instances[index].plan
        if isinstance(plan, DecodeRun):  # its steps up to now, which may finish it
            self._apply_run(index, plan)
        if sequence.finished_s is not None:
            return
        if first_token_only and sequence.first_token_s is not None:
            return
        self._cancel(index, sequence)
        self.come_back(request, self.now, None)

    def _cancel(self, index: int, sequence: Sequence) -> None:
        """Stop a sequence on its engine and settle the host's books for it."""
        instance = self.instances[index]
        request_id = sequence.request.request_id
        del self._placed[request_id]
        instance.engine.cancel(sequence)
        plan = instance.plan
        if isinstance(plan, DecodeRun):  # the batch changed: its later steps are replanned
            instance.engine.cut(plan)
            self._schedule_end(index, plan.end_s)
        self._uncharge(index, request_id)
        where = (instance.instance_id, instance.dc)
        self.records.append(RequestRecord.cancelled(sequence.request, self.now, where, sequence))
        self.pipeline.finished(request_id, self.now, cancelled=True)

    def come_back(self, request: TraceRequest, at_s: float, retry_after_s: float | None) -> None:
        """A client refused or giving up at ``at_s`` tries once more, if it is one that does
        (through ``reenter`` where that is set: an edge refusal's retry is the edge's
        too)."""
        if self.clients is None:
            return
        retry = self.clients.retry(request, at_s, retry_after_s)
        if retry is not None:
            self._push(retry.arrival_s, _RETRY, -1, retry)

    def _charge(self, index: int, request: TraceRequest, decision: Decision) -> None:
        """Count a routed request on its instance, as the gateway does (``Charge``)."""
        charge = Charge.routed(request.input_tokens, request.max_tokens, decision, index)
        self._pending_prefill[index] += charge.pending_prefill
        self._inflight[index] += charge.inflight_tokens
        self._charges[request.request_id] = charge

    def _uncharge(self, index: int, request_id: str) -> None:
        """Take an ended request's charge off its instance."""
        charge = self._charges.pop(request_id)
        self._inflight[index] -= charge.inflight_tokens
        self._pending_prefill[index] -= charge.pending_prefill

    def _first_tokens(self, index: int, plan: StepPlan) -> None:
        """Settle the pending prefill of the sequences whose first token the step made."""
        for sequence, _ in plan.scheduled:
            if sequence.first_token_s == self.now:
                request_id = sequence.request.request_id
                charge = self._charges[request_id]
                self._pending_prefill[index] -= charge.pending_prefill
                self._charges[request_id] = replace(charge, pending_prefill=0.0)
                self.pipeline.first_token(request_id, self.now)

    def _enter(self, index: int, sequence: Sequence) -> None:
        instance = self.instances[index]
        instance.entering -= 1
        if sequence.cancelled:  # its client gave up during the admission delay
            return
        instance.engine.add(sequence)
        plan = instance.plan
        if plan is None:
            self._start_next(index)
            return
        if isinstance(plan, DecodeRun):  # the newcomer joins after the step in flight
            self._apply_run(index, plan)
            instance.engine.cut(plan)
            self._schedule_end(index, plan.end_s)

    def _scrape(self) -> None:
        """Read every engine's metrics now, as a periodic scrape would."""
        for index, instance in enumerate(self.instances):
            if isinstance(instance.plan, DecodeRun):
                self._apply_run(index, instance.plan)
            engine = instance.engine
            self._waiting[index] = len(engine.waiting) + instance.entering
            self._running[index] = len(engine.running)
            self._kv_used[index] = engine.pool.used_blocks
        self._scraped_at = self.now

    def _apply_run(self, index: int, run: DecodeRun) -> None:
        for sequence in self.instances[index].engine.advance(run, self.now):
            self._complete(index, sequence)
        self._publish_kv_events(index)

    def _start_next(self, index: int) -> None:
        instance = self.instances[index]
        plan = instance.engine.plan(self.now, runs=self.decode_runs)
        instance.plan = plan
        if plan is not None:
            end = plan.end_s if isinstance(plan, DecodeRun) else self.now + plan.duration_s
            self._schedule_end(index, end)

    def _schedule_end(self, index: int, end_s: float) -> None:
        instance = self.instances[index]
        instance.version += 1
        self._push(end_s, _STEP_END, index, instance.version)

    def _end_step(self, index: int) -> None:
        instance = self.instances[index]
        plan = instance.plan
        if isinstance(plan, DecodeRun):
            self._apply_run(index, plan)
            self._tokens_streamed(index)
        elif plan is not None:
            finished = instance.engine.finish_step(plan, self.now)
            self._first_tokens(index, plan)
            if any(sequence.generated > 1 for sequence, _ in plan.scheduled):
                self._tokens_streamed(index)
            for sequence in finished:
                self._complete(index, sequence)
            self._publish_kv_events(index)
        self._start_next(index)

    def _publish_kv_events(self, index: int) -> None:
        """The KV events of the steps that have ended, as vLLM publishes a step's events
        with its output: blocks they stored, and blocks they evicted to make room. (A
        decode run's steps are applied when the run is read or ends, so their events come
        out then.)"""
        if not self._kv_events:
            return
        events = self.instances[index].engine.pool.take_events()
        if events:
            self._kv_in_transit.append((self.now + self.token_lag_s, index, events))

    def _deliver_kv_events(self, until: float | None = None) -> None:
        """The KV events that reached the host by now (or ``until``), in the order they
        were published."""
        until = self.now if until is None else until
        while self._kv_in_transit and self._kv_in_transit[0][0] <= until:
            _, index, events = self._kv_in_transit.popleft()
            self.pipeline.kv_events(index, events)

    def _complete(self, index: int, sequence: Sequence) -> None:
        instance = self.instances[index]
        request = sequence.request
        self._uncharge(index, request.request_id)
        step_time = instance.engine.step_time
        network = self.cluster.network_s(request.region, instance.dc, request.input_tokens)
        ttft_overhead = step_time.ttft_overhead_s + network
        record = RequestRecord.completed(
            sequence,
            instance.instance_id,
            instance.dc,
            ttft_overhead_s=ttft_overhead,
            token_overhead_s=step_time.token_overhead_s,
        )
        self.records.append(record)
        self._open.pop(request.request_id, None)
        self._placed.pop(request.request_id, None)
        assert sequence.first_token_s is not None  # learned at completion, not at first token
        # from when it was sent to the instance, as a gateway sees it: a request held in
        # its pool waited there before the router's prediction was made
        sent_ttft = sequence.first_token_s - sequence.enqueued_s + ttft_overhead
        self.pipeline.finished(
            request.request_id,
            self.now,
            completed_tokens=request.output_tokens,
            observation=Observation(request.request_id, index, sent_ttft, request.output_tokens),
        )

    def _push(self, time: float, kind: int, index: int, payload: Event) -> None:
        self._order += 1
        heapq.heappush(self._heap, (time, self._order, kind, index, payload))


def _admitting(request: TraceRequest) -> AdmissionRequest:
    """The request as admission sees it; a trace's deadline is seconds from arrival."""
    deadline = request.deadline_s
    return AdmissionRequest(
        request.request_id,
        request.task_class,
        request.tenant,
        request.input_tokens,
        request.max_tokens,
        request.arrival_s,
        None if deadline is None else request.arrival_s + deadline,
    )

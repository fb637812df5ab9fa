"""Several data centers at once, each with its own admission and router, behind an edge
that chooses the DC from what a live edge would know.

Each DC is a ``Simulation`` of its own pool (its pipeline, SLOMax or another admission in
front of TokenPilot or another router, and its quota loop), so a prefix warm in one DC is
cold in another. The fleet runs them on one clock: the next trace arrival, the next event
of any DC (ties to the DC first in the layout) or the next table publication, whichever
is due first.

The edge sees each DC through its tables, published every ``view_period_s`` and reaching
it ``view_delay_s`` later (requests running and queued, in the engines and in the DC's
admission pools; KV in use; completions per second over the tables' window; whether the
model is ready there; the first reaches it with the first request), and through its own
counts, fresh: requests it sent to each DC lately and those not finished, and where
each prompt's blocks went (so a prompt's warm DC is known, a prefix warm in one DC being
cold in the others). A DC is
deployed from the start and ready from its site's ``ready_at_s`` (a warm-up). Every
``weights_every`` publications, FleetMind's weights controller reads each DC's goodput
table (built from the DC's records by the live stream processors' logic) and its weights,
one set per entry region (as a live controller publishes one per edge), travel to the
edge with the next tables. Clients' second attempts come back through the
edge. A request no DC may take is refused there.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from functools import partial

from control.admission.registry import CONTROLLED, make_admission
from control.admission.slomax import SLOMax
from control.controllers.fleetmind import WeightController, WeightKey, take_in, weight_for
from control.controllers.placement import DcReplicas, PlacementController
from control.fleet.load import DcLoad, Rate, class_room, dc_state
from control.fleet.locality import PrefixLocality
from control.fleet.registry import DcPolicy
from control.fleet.view import DcDecision, DcRequest, FleetState
from control.routing import make_router
from schemas.base import TaskClass
from sim.clients import ClientModel
from sim.cluster import Cluster, DataCenter, InstanceProfile
from sim.control_loop import QuotaLoop, RecordTables
from sim.records import RequestRecord
from sim.simulator import Simulation
from sim.workload import TraceRequest
from streams.tables.windows import WindowSpec

VERSION = "v1"
PLACEMENT_WINDOW_S = 60.0
"""The long cycle judges a DC's demand over the last minute."""


@dataclass(frozen=True)
class Site:
    name: str
    region: str
    instances: int
    ready_at_s: float | None = None
    """When the model becomes ready here; before, it is deployed and warming up (None:
    ready all along)."""
    standby: int = 0
    """GPUs for more replicas, idle until the placement loop puts a replica on them."""

    def ready(self, now: float) -> bool:
        return self.ready_at_s is None or now >= self.ready_at_s


@dataclass(frozen=True)
class FleetLayout:
    sites: tuple[Site, ...]
    round_trips_s: Mapping[tuple[str, str], float]
    """Round trips between regions, by (region, region) in both orders."""
    home: Mapping[str, str]
    """Each entry region's home DC: the DC whose gateway takes the requests entering there."""
    tenant_dcs: Mapping[str, frozenset[str]] = field(default_factory=dict)
    """The DCs each restricted tenant may use (tenants not named: any)."""

    def rtt_s(self, source: str, target: str) -> float:
        return 0.0 if source == target else self.round_trips_s.get((source, target), 0.0)


@dataclass
class _Dc:
    site: Site
    simulation: Simulation
    seen_records: int = 0
    sent: Rate = field(default_factory=Rate)
    inflight: dict[str, TaskClass] = field(default_factory=dict)
    """The edge's requests in flight there, and their classes."""
    completions: Rate = field(default_factory=lambda: Rate(WindowSpec().size_s))
    """Requests completed here, over the tables' window, as a live DC's goodput table
    counts them for the gateways (``FleetView.completed_per_s``)."""
    demand: Rate = field(default_factory=lambda: Rate(PLACEMENT_WINDOW_S))
    """What the edge sent here over the placement loop's window."""
    deployed: int = 0
    """Replicas serving or loading the model here."""
    warming: list[tuple[float, int]] = field(default_factory=list)
    """Replicas loading the model: when each is ready, and its instance."""

    def ready_instances(self, now: float) -> int:
        if not self.site.ready(now):
            return 0
        return len(self.simulation.ready_engines)


@dataclass(frozen=True)
class PublishedLoad:
    """What one DC's tables said when published."""

    published_s: float
    ready: bool
    running: int
    queued: int
    kv_use: float
    completed_per_s: float
    limits: Mapping[TaskClass, int] = field(default_factory=dict)
    """The requests of each limited class the DC's admission runs at once."""
    ready_instances: int = 0
    deployed: int = 0
    """Replicas serving or loading the model."""
    loading: int = 0
    """Of those, the replicas still loading it: not yet instances of the DC, as a gateway
    counts a standby instance only once it serves."""


Observer = Callable[["FleetSimulation"], None]
RegionWeights = dict[str, dict[WeightKey, float]]
"""(DC, class) weights by the entry region whose requests they are for."""


@dataclass(frozen=True)
class EdgeChoice:
    """One decision of the edge, for the benchmark's figures."""

    at_s: float
    request: TraceRequest
    chosen: str | None
    fallback: bool = False
    """Whether it tried the next DC after the first refused the request."""


class FleetSimulation:
    """``capacity_rps_per_instance``: the operator's figure of what one instance serves of
    the traffic (None: not known, and utilisation is read off queues and KV)."""

    def __init__(
        self,
        layout: FleetLayout,
        profile: InstanceProfile,
        dc_policy: DcPolicy,
        *,
        router: str = "tokenpilot",
        admission: str = "slomax",
        seed: int = 0,
        clients: ClientModel | None = None,
        capacity_rps_per_instance: float | None = None,
        view_period_s: float = 1.0,
        view_delay_s: float = 1.0,
        weights: WeightController | None = None,
        weights_every: int = 5,
        placement: PlacementController | None = None,
        placement_every: int = 60,
        warmup_s: float = 60.0,
        observe: Observer | None = None,
    ) -> None:
        """``placement``: FleetMind's long cycle, every ``placement_every`` publications; a
        replica it places is ready ``warmup_s`` later. ``observe``: called after every
        publication of the tables (a live view)."""
        self.layout = layout
        self.observe = observe
        self.placement = placement
        self.placement_every = placement_every
        self.warmup_s = warmup_s
        self.weights = weights
        self.weights_every = weights_every
        self.policy = dc_policy
        self.capacity_rps_per_instance = capacity_rps_per_instance
        self.view_period_s = view_period_s
        self.view_delay_s = view_delay_s
        regions = {region for pair in layout.round_trips_s for region in pair} | set(layout.home)
        self._dcs = [
            _Dc(
                site,
                self._simulation(site, profile, regions, router, admission, seed, clients),
                deployed=site.instances,
            )
            for site in layout.sites
        ]
        self._by_name = {dc.site.name: dc for dc in self._dcs}
        self._fallbacks: dict[str, list[str]] = {}
        """The DCs each request may still fall back to."""
        self._draws = random.Random(f"edge:{seed}")
        self._tables: dict[str, PublishedLoad] = {}
        self._in_transit: deque[tuple[float, dict[str, PublishedLoad], RegionWeights]] = deque()
        self._record_tables = {site.name: RecordTables(site.name) for site in layout.sites}
        self._weights: RegionWeights = {region: {} for region in sorted(layout.home)}
        """Each entry region's (DC, class) weights as the controller last published them."""
        self._placed_at: dict[str, float] = {}
        self._edge_weights: RegionWeights = {}
        self._weights_changed_at: RegionWeights = {region: {} for region in self._weights}
        self.weight_steps: list[tuple[float, dict[str, float]]] = []
        """The weights after each pass of the controller, by entry region and DC (and class:
        "region:dc/class")."""
        self.placement_steps: list[tuple[float, dict[str, int]]] = []
        """The replicas deployed in each DC after each pass of the long cycle."""
        self._locality = PrefixLocality()
        """Where each prompt went (every prompt of the run: a gateway keeps the latest)."""
        self.choices: list[EdgeChoice] = []
        self.tables: list[dict[str, PublishedLoad]] = []
        """Every publication of the DCs' tables, in order."""
        self.refused: list[RequestRecord] = []
        self.now = 0.0

    def _simulation(
        self,
        site: Site,
        profile: InstanceProfile,
        regions: set[str],
        router: str,
        admission: str,
        seed: int,
        clients: ClientModel | None,
    ) -> Simulation:
        pool = profile.pool_model()
        cluster = Cluster(
            (DataCenter(site.name, site.instances, profile, site.standby),),
            {(region, site.name): self.layout.rtt_s(region, site.region) for region in regions},
        )
        simulation = Simulation(
            cluster,
            make_router(router, seed, pool),
            admission=make_admission(admission, pool),
            clients=clients,
            control=QuotaLoop(dc=site.name) if admission in CONTROLLED else None,
        )
        simulation.reenter = self._route
        simulation.fall_back = partial(self._fall_back, site.name)
        return simulation

    @property
    def simulations(self) -> list[Simulation]:
        return [dc.simulation for dc in self._dcs]

    def weights_now(self, region: str) -> dict[WeightKey, float]:
        """Each (DC, class) weight for requests entering at ``region`` as last published
        (one not named counts whole)."""
        return dict(self._weights.get(region, {}))

    def run(self, requests: Iterable[TraceRequest]) -> list[RequestRecord]:
        """Serve every request to the end; every DC's records, then the edge's refusals."""
        arrivals = iter(requests)
        upcoming = next(arrivals, None)
        if upcoming is None:
            return []
        for dc in self._dcs:
            dc.simulation.start(upcoming.arrival_s)
        next_table_s = upcoming.arrival_s - self.view_delay_s  # the fleet ran before
        while True:
            due_s, index = min(
                ((dc.simulation.next_event_s(), i) for i, dc in enumerate(self._dcs)),
                default=(float("inf"), -1),
            )
            if upcoming is None and due_s == float("inf"):
                break
            arrival_s = upcoming.arrival_s if upcoming is not None else float("inf")
            if next_table_s <= min(arrival_s, due_s):
                self.now = next_table_s
                self._publish_tables()
                next_table_s += self.view_period_s
            elif upcoming is not None and arrival_s <= due_s:
                self.now = arrival_s
                self._route(upcoming)
                upcoming = next(arrivals, None)
            else:
                self.now = due_s
                for dc in self._dcs:
                    dc.simulation.arrivals_pending = upcoming is not None
                self._dcs[index].simulation.step()
                self._count_ends(self._dcs[index])
        for dc in self._dcs:
            dc.simulation.finish()
        return [r for dc in self._dcs for r in dc.simulation.records] + self.refused

    def _route(self, request: TraceRequest) -> None:
        """The edge's decision for a request (a first arrival or a client's second
        attempt): the DC the policy puts first, or a refusal when it puts none."""
        decision = self.decide(request)
        self.choices.append(EdgeChoice(self.now, request, decision.chosen))
        if decision.chosen is None:
            self.refused.append(RequestRecord.rejected(request, self.now))
            # Its client tries again as one refused in a DC does (any DC's queue times it).
            self._dcs[0].simulation.come_back(request, self.now, None)
            return
        self._fallbacks[request.request_id] = list(decision.order[1:])
        self._send(request, decision.chosen)

    def _fall_back(self, refused_by: str, request: TraceRequest) -> bool:
        """A DC refused ``request`` before its first token: the edge sends it to the next
        DC of its decision's order, if any is left."""
        self._by_name[refused_by].inflight.pop(request.request_id, None)
        left = self._fallbacks.get(request.request_id)
        if not left:
            return False
        chosen = left.pop(0)
        self.choices.append(EdgeChoice(self.now, request, chosen, fallback=True))
        self._send(request, chosen)
        return True

    def _send(self, request: TraceRequest, name: str) -> None:
        dc = self._by_name[name]
        dc.sent.add(self.now)
        dc.demand.add(self.now)
        dc.inflight[request.request_id] = request.task_class
        self._locality.sent(request.prefix_blocks, name)
        dc.simulation.arrive(request, self.now)
        self._count_ends(dc)

    def decide(self, request: TraceRequest) -> DcDecision:
        """The policy's answer for ``request`` on the edge's view now."""
        self._receive_tables()
        dc_request = DcRequest(
            request.request_id,
            request.region,
            self.layout.home.get(request.region),
            request.input_tokens,
            self.layout.tenant_dcs.get(request.tenant),
            frozenset(request.residency),
            None,
            self._draws.random(),
        )
        return self.policy.choose(dc_request, self.view(request))

    def view(self, request: TraceRequest) -> FleetState:
        """Every DC as the edge sees it now for ``request``: its last tables, the edge's
        own counts, how much of the prompt went there lately and the room for its class."""
        warm = self._locality.warm_tokens(request.prefix_blocks)
        weights = self._edge_weights.get(request.region, {})
        states = []
        for dc in self._dcs:
            table = self._tables.get(dc.site.name)
            ready = table.ready_instances if table and table.ready else 0
            capacity = self.capacity_rps_per_instance
            load = DcLoad(
                table.running if table else 0,
                table.queued if table else 0,
                table.kv_use if table else 0.0,
                table.completed_per_s if table else 0.0,
                dc.sent.per_s(self.now),
                len(dc.inflight),
                capacity * ready if capacity and ready else None,
                ready,
            )
            states.append(
                dc_state(
                    dc.site.name,
                    dc.site.region,
                    instances=table.deployed - table.loading if table else dc.site.instances,
                    versions=frozenset({VERSION}),
                    ready_versions=frozenset({VERSION}) if ready else frozenset(),
                    ready_instances=ready,
                    load=load,
                    weight=weight_for(weights, dc.site.name, request.task_class),
                    warm_tokens=warm.get(dc.site.name, 0),
                    class_room=_room(dc, table, request.task_class),
                )
            )
        return FleetState(tuple(states), self.layout.round_trips_s)

    def _count_ends(self, dc: _Dc) -> None:
        """The requests of ``dc`` that ended since last looked: the edge saw them end."""
        records = dc.simulation.records
        for record in records[dc.seen_records :]:
            dc.inflight.pop(record.request_id, None)
            if record.outcome == "completed":
                dc.completions.add(self.now)
        dc.seen_records = len(records)

    def _publish_tables(self) -> None:
        """Each DC's tables as of now, on their way to the edge (replicas whose warm-up
        ended are ready first)."""
        tables = {}
        for dc in self._dcs:
            self._warmed(dc)
            simulation = dc.simulation
            ready = dc.ready_instances(self.now)
            engines = [engine for _, engine in simulation.ready_engines] or simulation.engines
            waiting = sum(len(e.waiting) for e in simulation.engines)
            admission = simulation.pipeline.admission
            limits = {}
            if isinstance(admission, SLOMax) and ready:
                for task_class in TaskClass:
                    limit = admission.concurrency_limit(
                        task_class, simulation.pipeline.quotas, ready
                    )
                    if limit is not None:
                        limits[task_class] = limit
            tables[dc.site.name] = PublishedLoad(
                self.now,
                dc.site.ready(self.now),
                sum(len(e.running) for e in simulation.engines),
                waiting + len(simulation.pipeline.pools),
                sum(e.pool.used_blocks / e.config.num_blocks for e in engines) / len(engines),
                dc.completions.per_s(self.now),
                limits,
                ready,
                dc.deployed,
                len(dc.warming),
            )
        self.tables.append(tables)
        if self.weights is not None and len(self.tables) % self.weights_every == 0:
            self._reconcile_weights()
        if self.placement is not None and len(self.tables) % self.placement_every == 0:
            self._place(tables)
        in_force = {region: dict(weights) for region, weights in self._weights.items()}
        self._in_transit.append((self.now + self.view_delay_s, tables, in_force))
        if self.observe is not None:
            self.observe(self)

    def _place(self, tables: Mapping[str, PublishedLoad]) -> None:
        """A pass of FleetMind's long cycle: replicas placed on standby GPUs load for
        ``warmup_s``; replicas taken away stop taking requests at once."""
        assert self.placement is not None
        capacity = self.capacity_rps_per_instance or 1.0
        replicas = {
            dc.site.name: DcReplicas(
                tables[dc.site.name].ready_instances,
                dc.deployed,
                dc.site.instances,
                dc.site.instances + dc.site.standby,
                dc.demand.per_s(self.now),
            )
            for dc in self._dcs
            if dc.site.ready(self.now)
        }
        targets = self.placement.targets(replicas, capacity, self._placed_at, self.now)
        for name, (target, _) in targets.items():
            dc = self._by_name[name]
            for index in range(dc.deployed, target):
                dc.warming.append((self.now + self.warmup_s, index))
            for index in range(target, dc.deployed):
                dc.simulation.set_ready(index, False)
            dc.warming = [w for w in dc.warming if w[1] < target]  # never to serve now
            dc.deployed = target
            self._placed_at[name] = self.now
        self.placement_steps.append((self.now, {dc.site.name: dc.deployed for dc in self._dcs}))

    def _warmed(self, dc: _Dc) -> None:
        for ready_at, index in [w for w in dc.warming if w[0] <= self.now]:
            dc.simulation.set_ready(index, True)
            dc.warming.remove((ready_at, index))

    def _reconcile_weights(self) -> None:
        """A pass of FleetMind's weights controller on each DC's goodput table."""
        assert self.weights is not None
        goodput = {}
        for dc in self._dcs:
            simulation = dc.simulation
            engines = [(i.instance_id, i.engine) for i in simulation.instances]
            goodput[dc.site.name] = self._record_tables[dc.site.name].update(
                simulation.records, engines, self.now
            )[0]
        named = {}
        for region, current in self._weights.items():
            changed_at = self._weights_changed_at[region]
            changed = self.weights.reconcile(goodput, current, changed_at, self.now, region)
            take_in(current, changed_at, changed or {}, self.now)
            for (name, c), weight in current.items():
                named[f"{region}:{name}" if c is None else f"{region}:{name}/{c.value}"] = weight
        self.weight_steps.append((self.now, named))

    def _receive_tables(self) -> None:
        while self._in_transit and self._in_transit[0][0] <= self.now:
            _, self._tables, self._edge_weights = self._in_transit.popleft()


def _room(dc: _Dc, table: PublishedLoad | None, task_class: TaskClass) -> float | None:
    """The share of ``task_class``'s limit in ``dc`` that the edge's requests leave free."""
    limit = table.limits.get(task_class) if table else None
    return class_room(sum(c is task_class for c in dc.inflight.values()), limit)

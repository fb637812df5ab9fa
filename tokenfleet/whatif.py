"""Re-simulate the recorded arrivals under another policy stack: ``tokenfleet whatif``.

The arrivals come from ``tf.requests`` (what the gateways knew of each request when it
arrived: its class, tenant, prompt length and blocks, budget, deadline), each in the DC
its ``tf.request.routed`` event names (or, for one the DC's admission refused or held
until its client left, its rejection's or cancellation's), with the output length its
completion recorded (its budget where it has none). Each DC's arrivals are simulated
twice on its instances from the fleet file, with the model's calibrated profile: under
the stack the gateways run (the fleet file's routing policy, SLOMax) and under the one
asked about; the difference is the policy's, both sides simulated alike. What the
clients actually got is reported beside them, from the completions, as a check of the
simulation.

``whatif_fleet`` re-makes the choice of DC as well: every recorded arrival enters at the
region of the gateway that took it, and the multi-DC simulator (``sim.fleet_sim``) runs
the whole fleet under each DC policy asked about, each DC behind SLOMax and the fleet's
routing policy, as the live edge would have.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from control.controllers.fleetmind import WeightController
from control.fleet.registry import make_dc_policy
from control.fleet.view import FleetState
from schemas import Envelope
from schemas.fleet import FleetConfig
from schemas.lifecycle import (
    RequestArrived,
    RequestCancelled,
    RequestCompleted,
    RequestRejected,
    RequestRouted,
)
from sim.fleet_bench import region_figures
from sim.fleet_sim import FleetLayout, FleetSimulation, Site
from sim.metrics import latency_stats
from sim.profiles import DEFAULT_PROFILE, profile
from sim.records import RequestRecord
from sim.run import RunConfig, simulate_run
from sim.workload import TraceRequest

WHATIF_TOPICS = ("tf.requests", "tf.completions", "tf.cancellations")


@dataclass(frozen=True)
class Stack:
    """A routing policy and an admission policy, by the names ``tokenfleet sim`` takes."""

    policy: str
    admission: str

    @property
    def name(self) -> str:
        return f"{self.policy} + {self.admission}"


@dataclass(frozen=True)
class Recorded:
    """The recorded arrivals per DC, and what the clients got."""

    workloads: dict[str, list[TraceRequest]]
    measured: dict[str, dict[str, float]]
    unrouted: int
    """Arrivals no DC ran (refused at the edge): left out of every simulation per DC."""
    arrivals: list[TraceRequest]
    """Every arrival, routed or not, entering at its gateway's region: the fleet's
    workload."""


def recorded(events: Iterable[Envelope]) -> Recorded:
    """The arrivals of ``events`` (the lifecycle topics' envelopes) per DC."""
    arrived: dict[str, tuple[float, RequestArrived]] = {}
    routed: dict[str, str] = {}
    turned_away: dict[str, str] = {}
    completed: dict[str, RequestCompleted] = {}
    for envelope in events:
        payload = envelope.payload
        if isinstance(payload, RequestArrived):
            arrived.setdefault(payload.request_id, (envelope.ts, payload))
        elif isinstance(payload, RequestRouted):
            routed[payload.request_id] = payload.dc
        elif isinstance(payload, RequestRejected | RequestCancelled) and payload.dc:
            turned_away[payload.request_id] = payload.dc
        elif isinstance(payload, RequestCompleted):
            completed[payload.request_id] = payload
    routed = turned_away | routed  # refused, or held until its client left, in that DC
    start = min((ts for ts, _ in arrived.values()), default=0.0)
    workloads: dict[str, list[TraceRequest]] = {}
    arrivals = []
    for request_id, (ts, request) in sorted(arrived.items(), key=lambda item: item[1][0]):
        trace = _trace_request(request, ts - start, completed.get(request_id))
        arrivals.append(trace)
        if request_id in routed:
            workloads.setdefault(routed[request_id], []).append(trace)
    measured = {dc: _measured(work, completed) for dc, work in workloads.items()}
    unrouted = len(arrived) - len(routed.keys() & arrived.keys())
    return Recorded(workloads, measured, unrouted, arrivals)


def _trace_request(
    request: RequestArrived, arrival_s: float, done: RequestCompleted | None
) -> TraceRequest:
    return TraceRequest(
        request_id=request.request_id,
        arrival_s=arrival_s,
        input_tokens=request.input_tokens,
        output_tokens=max(1, done.output_tokens if done else request.output_budget),
        prefix_blocks=tuple(request.prefix_blocks),
        task_class=request.task_class,
        tenant=request.tenant,
        deadline_s=request.deadline_s,
        max_tokens=request.output_budget or None,
        region=request.source_region,
        residency=request.residency,
    )


def _measured(
    workload: Sequence[TraceRequest], completed: dict[str, RequestCompleted]
) -> dict[str, float]:
    """What the clients of these requests got: completions and TTFT (streamed ones)."""
    done = [completed[r.request_id] for r in workload if r.request_id in completed]
    ttfts = [c.ttft_s for c in done if c.streamed]
    return {"requests": len(workload), "completed": len(done)} | latency_stats("ttft", ttfts)


def whatif(
    record: Recorded, fleet: FleetConfig, stacks: Sequence[Stack], dcs: Collection[str] = ()
) -> dict[str, dict[str, Any]]:
    """Per DC (``dcs``: only these), each stack's simulated figures on the DC's recorded
    arrivals, beside what its clients got."""
    out: dict[str, dict[str, Any]] = {}
    for dc, workload in sorted(record.workloads.items()):
        instances = [i for i in fleet.instances if i.dc == dc]
        if not instances or (dcs and dc not in dcs):
            continue
        model = fleet.model(instances[0].model)
        profile = (model.profile if model else None) or DEFAULT_PROFILE
        out[dc] = {"measured": record.measured[dc], "instances": len(instances)}
        for stack in stacks:
            config = RunConfig(
                trace="recorded",
                instances=len(instances),
                policy=stack.policy,
                profile=profile,
                admission=stack.admission,
            )
            result, _ = simulate_run(config, workload=workload)
            out[dc][stack.name] = _figures(result["summary"])
    return out


def _figures(summary: dict[str, Any]) -> dict[str, float]:
    classes = summary["classes"].values()
    requests = sum(c["requests"] for c in classes)
    return {
        "goodput_tok_s": summary["goodput_tok_s"],
        "compliance": sum(c["met"] for c in classes) / requests if requests else 1.0,
        "completed": summary["completed"],
        "ttft_p50_s": summary["ttft_p50_s"],
        "ttft_p95_s": summary["ttft_p95_s"],
    }


def fleet_layout(fleet: FleetConfig, entry_regions: Collection[str]) -> FleetLayout:
    """``fleet`` as the multi-DC simulator lays it out: each DC's instances (standby
    ones as idle GPUs for the long cycle), the round trips between every two regions
    (pairs the fleet file does not name: the edge's default), each entry region's home
    (the first DC in it, else the nearest), and the tenants' DCs."""
    sites = []
    for dc in fleet.dcs:
        mine = [i for i in fleet.instances if i.dc == dc.name]
        if mine:
            standby = sum(i.standby for i in mine)
            sites.append(Site(dc.name, dc.region, len(mine) - standby, standby=standby))
    trips = FleetState((), fleet.round_trips_s())
    regions = {site.region for site in sites} | set(entry_regions)
    home = {
        region: min(
            sites, key=lambda site: (site.region != region, trips.rtt_s(region, site.region))
        ).name
        for region in entry_regions
    }
    return FleetLayout(
        sites=tuple(sites),
        round_trips_s={(a, b): trips.rtt_s(a, b) for a in regions for b in regions if a != b},
        home=home,
        tenant_dcs={t.name: frozenset(t.dcs) for t in fleet.tenants if t.dcs is not None},
    )


def whatif_fleet(
    record: Recorded, fleet: FleetConfig, dc_policies: Sequence[str]
) -> dict[str, dict[str, Any]]:
    """Each DC policy's simulated figures on every recorded arrival, the whole fleet at
    once. The multi-DC simulator has one model: a fleet of several is refused
    (ValueError), since the simulation would send requests where their model is not."""
    if len(fleet.models) > 1:
        names = ", ".join(m.name for m in fleet.models)
        raise ValueError(f"the fleet what-if simulates one model; the fleet file has {names}")
    arrivals = record.arrivals
    layout = fleet_layout(fleet, {r.region for r in arrivals})
    model = fleet.model(fleet.instances[0].model)
    chosen = profile((model.profile if model else None) or DEFAULT_PROFILE)
    span_s = max((r.arrival_s for r in arrivals), default=0.0) + 1.0
    regions = {r.request_id: r.region for r in arrivals}
    out = {}
    for name in dc_policies:
        simulation = FleetSimulation(
            layout,
            chosen,
            make_dc_policy(name),
            router=fleet.routing.policy,
            capacity_rps_per_instance=model.rps_per_instance if model else None,
            weights=WeightController() if name == "fleetmind" else None,
        )
        records = simulation.run(arrivals)
        out[name] = _fleet_figures(records, layout, regions, span_s)
    return out


def _fleet_figures(
    records: Sequence[RequestRecord], layout: FleetLayout, regions: dict[str, str], span_s: float
) -> dict[str, Any]:
    ran = [r for r in records if r.dc is not None]
    abroad = sum(r.dc != layout.home[regions[r.request_id]] for r in ran)
    return region_figures(records, span_s) | {
        "cross_dc_share": abroad / len(ran) if ran else 0.0,
        "refused": len(records) - len(ran),
        "per_dc": {site.name: sum(r.dc == site.name for r in ran) for site in layout.sites},
    }

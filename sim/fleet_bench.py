"""Every DC policy on one multi-DC scenario in the seed's layout: ``tokenfleet bench fleet``.

The layout (the seed's Figure 3): clients enter in region A (``eu-west``), which has no
GPUs; B (``dc-b``, ``eu-central``) is the existing cluster and A's home; C (``dc-c``,
``eu-north``) and D (``dc-d``, ``us-east``) are extension DCs with light local traffic of
their own, and D's model is still warming up for the first ``D_READY_S``. A's traffic
runs at ``BASE_LEVEL`` of B's capacity, then at ``HOTSPOT_LEVEL`` for the hotspot, then
at the base level again. ``RESIDENT_SHARE`` of A's requests must stay in the EU, and one
tenant may use B and C only. Every DC runs the same stack (TokenPilot behind SLOMax),
so the DC policy is all that differs between rows.

Arrivals come from a labelled workload (default ``mixed``), split by the region its
labels give (``eu-west`` enters at A, ``ap-south`` at C, ``us-east`` at D), each
stream's own times stretched or pressed to the scenario's rates: bursts keep their
shape, sessions their order.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from control.controllers.fleetmind import WeightController
from control.controllers.placement import PlacementController
from control.fleet.registry import DC_POLICIES, make_dc_policy
from schemas.objectives import DEFAULT_OBJECTIVES
from sim.admission_bench import figures
from sim.clients import ClientModel
from sim.fleet_sim import FleetLayout, FleetSimulation, Observer, PublishedLoad, Site
from sim.ladder import instance_capacity_rps
from sim.metrics import met_objective
from sim.profiles import DEFAULT_PROFILE, profile
from sim.records import RequestRecord
from sim.registry import load_trace
from sim.workers import worker_processes
from sim.workload import TraceRequest

EU = ("eu-west", "eu-central", "eu-north")
ROUND_TRIPS_S = {
    ("eu-west", "eu-central"): 0.010,
    ("eu-west", "eu-north"): 0.030,
    ("eu-west", "us-east"): 0.080,
    ("eu-central", "eu-north"): 0.025,
    ("eu-central", "us-east"): 0.090,
    ("eu-north", "us-east"): 0.100,
}
"""Typical public-cloud figures: 10 to 30 ms within Europe, 80 to 100 across the Atlantic."""
INSTANCES_PER_DC = 4
D_READY_S = 90.0


def layout(instances_per_dc: int = INSTANCES_PER_DC) -> FleetLayout:
    """The seed's Figure 3: A (``eu-west``) enters without GPUs; B its home, its GPUs all
    in use; C and D the extension DCs, with GPUs for half as many replicas again (used
    only by the long cycle), D warming up for its first ``D_READY_S``."""
    return FleetLayout(
        (
            Site("dc-b", "eu-central", instances_per_dc),
            Site("dc-c", "eu-north", instances_per_dc, standby=instances_per_dc // 2),
            Site(
                "dc-d",
                "us-east",
                instances_per_dc,
                ready_at_s=D_READY_S,
                standby=instances_per_dc // 2,
            ),
        ),
        ROUND_TRIPS_S | {(b, a): rtt for (a, b), rtt in ROUND_TRIPS_S.items()},
        {"eu-west": "dc-b", "eu-central": "dc-b", "eu-north": "dc-c", "us-east": "dc-d"},
        {"tenant-d": frozenset({"dc-b", "dc-c"})},
    )


ENTRIES = {"eu-west": "eu-west", "ap-south": "eu-north", "us-east": "us-east"}
"""Where each labelled region's requests enter the scenario's fleet."""
HOTSPOT_REGION = "eu-west"
"""Region A, where the hotspot's requests enter."""
HOTSPOT_S = (60.0, 240.0)
END_S = 360.0
BASE_LEVEL, HOTSPOT_LEVEL, LOCAL_LEVEL = 0.6, 2.0, 0.3
RESIDENT_SHARE = 0.3
REACTED_SHARE = 0.1
"""The policy has reacted once A's requests sent outside B, over ``REACT_WINDOW_S``, are
more than before the hotspot (per second) by this share of A's traffic then."""
REACT_WINDOW_S = 5.0
"""The span the share outside B is read over: one short cycle of the weights controller,
so that a handful of requests in one second cannot read as a reaction."""
Progress = Callable[[str], None]


@dataclass(frozen=True)
class Scenario:
    requests: tuple[TraceRequest, ...]
    capacity_rps_per_instance: float
    """The operator's figure of what one instance serves: measured on the workload
    (``instance_capacity_rps``)."""
    layout: FleetLayout


@dataclass(frozen=True)
class Stack:
    """What runs at each level: the DC policy at the edge, admission and routing in each
    DC. The benchmark varies the DC policy in front of TokenPilot behind SLOMax."""

    name: str
    dc_policy: str
    admission: str = "slomax"
    router: str = "tokenpilot"
    placement: bool = False
    """Whether FleetMind's long cycle places replicas on the DCs' idle GPUs."""
    operator_capacity: bool = True
    """Whether the edge is given the operator's figure of what an instance serves
    (``rps_per_instance``)."""


STACKS = {name: Stack(name, name) for name in DC_POLICIES} | {
    "fleetmind_placement": Stack("fleetmind_placement", "fleetmind", placement=True)
}
"""The benchmark's rows: each DC policy, and FleetMind with its long cycle too."""
VARIANTS = {
    "fleetmind_without_rps_per_instance": Stack(
        "fleetmind_without_rps_per_instance", "fleetmind", operator_capacity=False
    )
}
"""Rows run only when named: what FleetMind makes where the fleet file gives no figure of
an instance's capacity (``docs/fleetmind.md``, the load model)."""
RUNNABLE = STACKS | VARIANTS
TOKENFLEET = Stack("tokenfleet", "fleetmind", placement=True)
BASELINE = Stack("baseline", "local_only", "fcfs", "llmd_default")
"""What an operator runs without TokenFleet: each request in its home DC, admitted as it
comes, routed by llm-d's default scorers."""


def scenario(
    trace: str = "mixed",
    *,
    seed: int = 0,
    profile_name: str = DEFAULT_PROFILE,
    instances_per_dc: int = INSTANCES_PER_DC,
) -> Scenario:
    """The scenario's arrivals from ``trace``'s labelled requests."""
    workload = load_trace(trace, seed=seed)
    per_instance = instance_capacity_rps(profile(profile_name), workload)
    fleet = layout(instances_per_dc)
    capacity = {site.region: site.instances * per_instance for site in fleet.sites}
    capacity["eu-west"] = capacity["eu-central"]
    rates = {
        "eu-west": [(0.0, BASE_LEVEL), (HOTSPOT_S[0], HOTSPOT_LEVEL), (HOTSPOT_S[1], BASE_LEVEL)],
        "eu-north": [(0.0, LOCAL_LEVEL)],
        "us-east": [(0.0, LOCAL_LEVEL)],
    }
    requests: list[TraceRequest] = []
    for label, entry in ENTRIES.items():
        stream = [replace(r, region=entry) for r in workload if r.region == label]
        if not stream:
            raise ValueError(f"{trace!r} has no requests labelled with region {label!r}")
        pieces = [(start, level * capacity[entry]) for start, level in rates[entry]]
        requests += paced(stream, pieces, END_S)
    requests = [_resident(r, seed) if r.region == "eu-west" else r for r in requests]
    requests.sort(key=lambda r: (r.arrival_s, r.request_id))
    return Scenario(tuple(requests), per_instance, fleet)


def paced(
    stream: Sequence[TraceRequest], pieces: Sequence[tuple[float, float]], end_s: float
) -> list[TraceRequest]:
    """``stream`` (in arrival order) with its times mapped so that it arrives at each
    piece's rate (requests per second from the piece's start to the next's), until
    ``end_s``: the n-th request of the stream's own cumulative count arrives when the
    pieces' cumulative count reaches it; what would come after ``end_s`` is dropped. A
    stream shorter than the pieces ask for comes again after its end (``_again``) as
    often as needed: cut short, the scenario's last seconds would have no arrivals while
    its rates are still counted over them (seed 1's region A ran out at 256 s of 360
    until 2026-12-06)."""
    if len(stream) < 2:
        return list(stream)
    starts = [start for start, _ in pieces] + [end_s]
    counts = np.concatenate(
        [[0.0], np.cumsum([r * (b - a) for (a, r), b in zip(pieces, starts[1:], strict=True)])]
    )
    stream = _again(stream, int(np.ceil(counts[-1] / len(stream))))
    own = np.array([r.arrival_s for r in stream]) - stream[0].arrival_s
    rate = len(stream) / max(own[-1], 1e-9)
    times = np.interp(own * rate, counts, starts, right=np.inf)
    return [
        replace(request, arrival_s=float(at))
        for request, at in zip(stream, times, strict=True)
        if at < end_s
    ]


def _again(stream: Sequence[TraceRequest], passes: int) -> list[TraceRequest]:
    """``stream`` run ``passes`` times (at least once), each pass after the last, one mean
    gap apart; a later pass's requests and sessions carry its number (``~2``, ...), and so
    do its prompts' block hashes: new clients sending prompts shaped as the first pass's,
    sharing prefixes among themselves as those did, none with the first pass (whose
    prompts a DC's cache may still hold)."""
    first = stream[0].arrival_s
    period = (stream[-1].arrival_s - first) * len(stream) / (len(stream) - 1)
    again = list(stream)
    for n in range(2, passes + 1):
        again += [
            replace(
                r,
                request_id=f"{r.request_id}~{n}",
                session_id=None if r.session_id is None else f"{r.session_id}~{n}",
                prefix_group=None if r.prefix_group is None else f"{r.prefix_group}~{n}",
                prefix_blocks=tuple(_salted(block, n) for block in r.prefix_blocks),
                arrival_s=r.arrival_s + (n - 1) * period,
            )
            for r in stream
        ]
    return again


def _salted(block: int, salt: int) -> int:
    """A block hash of its own for ``salt``'s pass: equal blocks stay equal within it."""
    digest = hashlib.blake2b(f"{salt}:{block}".encode(), digest_size=8).digest()
    return int.from_bytes(digest) >> 1


def _resident(request: TraceRequest, seed: int) -> TraceRequest:
    key = f"{seed}:residency:{request.session_id or request.request_id}"
    point = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest()) / 2**64
    return replace(request, residency=EU) if point < RESIDENT_SHARE else request


def run_stack(
    stack: Stack,
    case: Scenario,
    profile_name: str,
    seed: int,
    observe: Observer | None = None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """One stack's figures, and its series for the plot."""
    simulation = stack_simulation(stack, case, profile_name, seed, observe)
    records = simulation.run(case.requests)
    return fleet_figures(records, simulation, case.requests), _series(simulation)


def stack_simulation(
    stack: Stack,
    case: Scenario,
    profile_name: str,
    seed: int,
    observe: Observer | None = None,
) -> FleetSimulation:
    """The fleet ``stack`` runs on ``case``, ready to run."""
    return FleetSimulation(
        case.layout,
        profile(profile_name),
        make_dc_policy(stack.dc_policy),
        router=stack.router,
        admission=stack.admission,
        seed=seed,
        clients=ClientModel(seed=seed),
        capacity_rps_per_instance=case.capacity_rps_per_instance
        if stack.operator_capacity
        else None,
        weights=WeightController() if stack.dc_policy == "fleetmind" else None,
        placement=PlacementController() if stack.placement else None,
        observe=observe,
    )


def bench_fleet(
    trace: str = "mixed",
    *,
    seed: int = 0,
    profile_name: str = DEFAULT_PROFILE,
    policies: Sequence[str] | None = None,
    jobs: int = 1,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """The benchmark's JSON document."""
    case = scenario(trace, seed=seed, profile_name=profile_name)
    names = list(policies or STACKS)
    results: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {}
    with worker_processes(jobs, len(names)) as pool:
        futures = {
            name: pool.submit(run_stack, RUNNABLE[name], case, profile_name, seed) for name in names
        }
        for name, future in futures.items():
            results[name] = future.result()
            if progress:
                progress(name)
    return {
        "trace": trace,
        "seed": seed,
        "profile": profile_name,
        "requests": len(case.requests),
        "capacity_rps_per_instance": case.capacity_rps_per_instance,
        "layout": {
            "sites": [vars(site) for site in case.layout.sites],
            "round_trips_s": {f"{a}-{b}": rtt for (a, b), rtt in ROUND_TRIPS_S.items()},
            "home": dict(case.layout.home),
            "tenant_dcs": {t: sorted(dcs) for t, dcs in case.layout.tenant_dcs.items()},
        },
        "hotspot_s": list(HOTSPOT_S),
        "end_s": END_S,
        "levels": {"base": BASE_LEVEL, "hotspot": HOTSPOT_LEVEL, "local": LOCAL_LEVEL},
        "resident_share": RESIDENT_SHARE,
        "offered_tok_s": offered_tok_s(case.requests, END_S),
        "policies": {name: results[name][0] for name in names},
        "series": {name: results[name][1] for name in names},
    }


def offered_tok_s(requests: Sequence[TraceRequest], window_s: float) -> float:
    """The goodput if every arrival met its objective: the most any DC policy can make of
    the scenario, and so what bounds its ratio to ``local_only``'s."""
    return sum(r.output_tokens for r in requests) / window_s


def fleet_figures(
    records: Sequence[RequestRecord], simulation: FleetSimulation, requests: Sequence[TraceRequest]
) -> dict[str, Any]:
    """A run's figures: the admission bench's (rates over the scenario's span), and per
    entry region, for the hotspot, across DCs, against the hard filters."""
    by_id = {c.request.request_id: c.request for c in simulation.choices}
    result = figures(records, END_S)
    result["per_region"] = {
        region: region_figures([r for r in records if by_id[r.request_id].region == region], END_S)
        for region in sorted({r.region for r in requests})
    }
    hot = [
        r
        for r in records
        # by its request's arrival: a record that did not complete holds when it ended
        if by_id[r.request_id].region == "eu-west"
        and HOTSPOT_S[0] <= by_id[r.request_id].arrival_s < HOTSPOT_S[1]
    ]
    hot_s = HOTSPOT_S[1] - HOTSPOT_S[0]
    result["hotspot"] = region_figures(hot, hot_s)
    result["hotspot"]["per_class"] = {
        task_class: region_figures([r for r in hot if r.task_class == task_class], hot_s)
        for task_class in sorted({r.task_class for r in hot})
    }
    ran = [r for r in records if r.dc is not None]
    home = simulation.layout.home
    result["cross_dc_share"] = (
        sum(r.dc != home[by_id[r.request_id].region] for r in ran) / len(ran) if ran else 0.0
    )
    result |= _violations(simulation)
    result["capacity_mismatch_request_s"] = mismatch(simulation.tables, simulation.view_period_s)
    result["react_s"] = react_s(simulation)
    return result


def region_figures(records: Sequence[RequestRecord], window_s: float) -> dict[str, Any]:
    done = [r for r in records if r.outcome == "completed"]
    met = [r for r in done if met_objective(r, DEFAULT_OBJECTIVES)]
    ttft = np.array([r.ttft_s for r in done if r.ttft_s is not None])
    return {
        "arrivals": len(records),
        "goodput_tok_s": sum(r.output_tokens for r in met) / window_s,
        "compliance": len(met) / max(len(records), 1),
        "ttft_p50_s": float(np.percentile(ttft, 50)) if ttft.size else None,
        "ttft_p95_s": float(np.percentile(ttft, 95)) if ttft.size else None,
    }


def _violations(simulation: FleetSimulation) -> dict[str, int]:
    """Edge choices that put a request where its residency or its tenant may not run."""
    region = {site.name: site.region for site in simulation.layout.sites}
    residency = permission = 0
    for choice in simulation.choices:
        if choice.chosen is None:
            continue
        request = choice.request
        residency += bool(request.residency) and region[choice.chosen] not in request.residency
        allowed = simulation.layout.tenant_dcs.get(request.tenant)
        permission += allowed is not None and choice.chosen not in allowed
    return {"residency_violations": residency, "permission_violations": permission}


def mismatch(tables: Sequence[Mapping[str, PublishedLoad]], period_s: float) -> float:
    """Demand left waiting while capacity idled elsewhere, in request-seconds: at each
    publication, the requests queued in a DC while another ready DC had none queued,
    times the period between publications."""
    total = 0.0
    for published in tables:
        idle = {name for name, load in published.items() if load.ready and not load.queued}
        for name, load in published.items():
            if load.queued and idle - {name}:
                total += load.queued * period_s
    return total


def react_s(simulation: FleetSimulation) -> float | None:
    """Seconds from the hotspot's start to the first whole second by which, over the
    ``REACT_WINDOW_S`` before it (all within the hotspot, so at least that long), the
    rate of A's requests sent outside its home DC exceeds its rate in the minute before
    the hotspot by ``REACTED_SHARE`` of A's whole rate in the window (None: never): the
    hotspot's overflow goes elsewhere. An edge that already spread A's traffic by load
    reacts as soon as it sends the extra away; one that sent all of it home, as soon as
    it spills. A request counts where the edge sent it last (after any fallback), at its
    arrival."""
    home = simulation.layout.home["eu-west"]
    last = {
        c.request.request_id: c
        for c in simulation.choices
        if c.request.region == "eu-west" and c.chosen is not None
    }
    times = np.array([c.request.arrival_s for c in last.values()])
    outside = np.array([c.chosen != home for c in last.values()], dtype=float)
    start = HOTSPOT_S[0]
    outside_before = outside[(times >= start - 60.0) & (times < start)].sum() / 60.0
    for second in range(int(start + REACT_WINDOW_S), int(HOTSPOT_S[1]) + 1):
        window = outside[(times >= second - REACT_WINDOW_S) & (times < second)]
        extra = window.sum() / REACT_WINDOW_S - outside_before
        if window.size and extra >= REACTED_SHARE * window.size / REACT_WINDOW_S:
            return second - start
    return None


SPLIT_BIN_S = 10.0


def _series(simulation: FleetSimulation) -> dict[str, Any]:
    """A's requests per DC in each ``SPLIT_BIN_S`` bin, each DC's queue at each
    publication and the weights after each pass of their controller: what the plot draws."""
    bins = int(np.ceil(END_S / SPLIT_BIN_S))
    names = [site.name for site in simulation.layout.sites]
    counts = {name: [0] * bins for name in [*names, "refused"]}
    for choice in simulation.choices:
        if choice.request.region == HOTSPOT_REGION:
            index = min(int(choice.at_s // SPLIT_BIN_S), bins - 1)
            counts[choice.chosen or "refused"][index] += 1
    queues = {name: [tables[name].queued for tables in simulation.tables] for name in names}
    weights = [{"at_s": at, **weights} for at, weights in simulation.weight_steps]
    replicas = [{"at_s": at, **deployed} for at, deployed in simulation.placement_steps]
    return {
        "bin_s": SPLIT_BIN_S,
        "a_requests": counts,
        "queued": queues,
        "weights": weights,
        "replicas": replicas,
    }


def plot_fleet(document: Mapping[str, Any], path: Path) -> None:
    """A's traffic by DC over time under each policy, the hotspot shaded; and, where a
    policy ran FleetMind's weights loop, the weights the edge in A counted on, per DC."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(document["policies"])
    weighed = [n for n in names if document["series"][n]["weights"]][:1]
    panels = len(names) + len(weighed)
    columns = min(3, panels)
    rows = -(-panels // columns)
    figure, axes = plt.subplots(rows, columns, figsize=(4.2 * columns, 3.0 * rows + 0.4))
    highest = max(
        max(counts, default=0) / document["series"][name]["bin_s"]
        for name in names
        for counts in document["series"][name]["a_requests"].values()
    )
    for axis, name in zip(np.ravel(axes), names, strict=False):
        series = document["series"][name]
        width = series["bin_s"]
        for dc, counts in series["a_requests"].items():
            if any(counts):
                axis.plot(np.arange(len(counts)) * width, np.array(counts) / width, label=dc)
        axis.axvspan(*document["hotspot_s"], color="0.9", label="hotspot")
        goodput = document["policies"][name]["goodput_tok_s"]
        axis.set_title(f"{name}\n{goodput:,.0f} tok/s goodput", fontsize=9)
        axis.set_xlabel("seconds")
        axis.set_ylabel("A's requests per second, by DC", fontsize=8)
        axis.set_ylim(0, 1.05 * highest)  # one scale: the panels compare policies
        axis.legend(fontsize=7)
    for axis, name in zip(np.ravel(axes)[len(names) :], weighed, strict=False):
        _plot_weights(axis, document, name)
    for axis in np.ravel(axes)[panels:]:
        axis.set_visible(False)
    figure.suptitle(
        f"Requests entering at A ({HOTSPOT_REGION}, no GPUs; its home DC is B), where each "
        "policy sent them; shaded: the hotspot",
        fontsize=9,
    )
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def _plot_weights(axis: Any, document: Mapping[str, Any], name: str) -> None:
    """The weights ``name``'s controller published for requests entering at A, per DC."""
    series = document["series"][name]
    steps = series["weights"]
    prefix = f"{HOTSPOT_REGION}:"
    keys = sorted({key for step in steps for key in step if key.startswith(prefix)})
    times = [step["at_s"] for step in steps]
    for key, style in zip(keys, itertools.cycle(("-", "--", ":", "-.")), strict=False):
        axis.step(  # dashed and dotted: weights often coincide, at 1
            times,
            [step.get(key, 1.0) for step in steps],
            where="post",
            linestyle=style,
            label=key.removeprefix(prefix),
        )
    axis.axvspan(*document["hotspot_s"], color="0.9")
    axis.set_ylim(0, 1.05)
    axis.set_xlim(0, len(series["a_requests"]["refused"]) * series["bin_s"])
    axis.set_title(f"{name}: weights for A's requests", fontsize=9)
    axis.set_xlabel("seconds")
    axis.set_ylabel("weight", fontsize=8)
    if keys:
        axis.legend(fontsize=7)
    else:  # the controller never moved a weight off its default
        axis.text(0.5, 0.5, "every weight stayed at 1", ha="center", transform=axis.transAxes)

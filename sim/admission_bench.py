"""Every admission policy in front of the same router, on one workload, across a load
ladder that runs past capacity: ``tokenfleet bench admission``.

Per policy and level, and pooled over the ladder (rates averaged over levels, shares
over every level's arrivals together):

- ``total_tok_s``: output tokens of completed requests per second of the level's arrival
  window (the same span for every policy, so a policy that finishes work later, within its
  deadline, is not charged for the time it took);
- ``goodput_tok_s``: the same, of requests that met their class's objective;
- ``compliance``: requests that met their objective over all arrivals (a client's second
  attempt is an arrival of its own; a rejected or cancelled request did not comply);
- ``wasted_tok``: tokens generated for requests that did not complete (cancelled by their
  client, or given up at a deadline); a request run twice wastes its first run's tokens;
- ``lost_work_tok``: every token the engines computed for nothing: the uncached prompts
  prefilled and the tokens generated for requests that did not complete, and the KV
  recomputed after preemptions;
- ``rejected_share`` and ``cancelled_share`` of arrivals;
- ``per_class``: the same for each class, with TTFT and TPOT P50 / P95.

``capacity_at_90_rps``: the highest arrival rate at which 90 % of requests still meet
their objective (DistServe's goodput, Zhong et al., OSDI 2024), read off the ladder by
linear interpolation between the levels around the crossing.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, replace
from itertools import pairwise
from pathlib import Path
from typing import Any

import numpy as np

from control.admission.registry import ABLATIONS, ADMISSIONS, make_admission
from control.controllers.slomax import QuotaControllerParams
from control.routing import make_router
from schemas.base import TaskClass
from schemas.objectives import DEFAULT_OBJECTIVES, ClassObjective
from sim.clients import ClientModel
from sim.cluster import Cluster
from sim.control_loop import QuotaLoop
from sim.ladder import instance_capacity_rps, offered_rate_rps
from sim.metrics import latency_stats, met_objective
from sim.profiles import DEFAULT_PROFILE, profile
from sim.records import RequestRecord
from sim.registry import load_trace
from sim.run import RunConfig, check_policies, run_all
from sim.simulator import Simulation

STACKS = {"llmd_stack": ("llmd_default", "llmd_flow_control")}
"""Rows that change the router too: what a user would deploy instead, whole (router,
admission)."""
BENCHED = (*ADMISSIONS, *STACKS)
"""Every row of the benchmark: each admission policy in front of the bench's router, and
the stacks."""
ABLATED = tuple(ABLATIONS)
"""SLOMax with one part off each, which ``--policies`` also takes (an ablation)."""

ADMISSION_LADDER = (0.8, 1.0, 1.1, 1.2, 1.5, 2.0)
"""Past capacity, with a level where the engines' own queues (``fcfs``) leave about two
requests in three meeting their objective, as the issue asks: on the whole mixed workload
at 16 instances fcfs meets 70.5 % of arrivals at 1.1 x, between 78.3 % at 1.0 x and
60.3 % at 1.2 x."""
ATTAINMENT = 0.9
Progress = Callable[[str], None]


def bench_admission(
    trace: str = "mixed",
    *,
    instances: int = 16,
    profile_name: str = DEFAULT_PROFILE,
    ladder: Sequence[float] = ADMISSION_LADDER,
    requests: int | None = None,
    seed: int = 0,
    policies: Sequence[str] | None = None,
    router: str = "tokenpilot",
    clients: ClientModel | None = None,
    jobs: int = 1,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """The benchmark's JSON document; ``clients`` None: the default ``ClientModel``."""
    names = list(policies or BENCHED)
    for name in names:
        check_policies(*STACKS.get(name, (router, name)), profile_name)
    chosen = profile(profile_name)
    clients = clients or ClientModel(seed=seed)
    workload = load_trace(trace, limit=requests, seed=seed)
    capacity = instance_capacity_rps(chosen, workload) * instances
    offered = offered_rate_rps(workload)
    levels_of = {
        RunConfig(
            trace,
            instances,
            STACKS.get(name, (router, name))[0],
            profile_name,
            requests,
            level * capacity / offered,
            seed,
            admission=STACKS.get(name, (router, name))[1],
            clients=clients,
        ): (name, level)
        for name in names
        for level in ladder
    }
    records_of: dict[RunConfig, list[RequestRecord]] = {}
    span = workload[-1].arrival_s - workload[0].arrival_s
    for config, (_, records) in run_all(list(levels_of), workload, jobs):
        records_of[config] = records
        if progress:
            name, level = levels_of[config]
            progress(f"{name} at {level:g}")
    document: dict[str, Any] = {
        "trace": trace,
        "instances": instances,
        "profile": profile_name,
        "router": router,
        "ladder": list(ladder),
        "capacity_rps": capacity,
        "seed": seed,
        "requests": len(workload),
        "clients": {
            "patience_s": {c.value: s for c, s in clients.patience_s().items()},
            "retry_share": clients.retry_share,
            "retry_delay_s": clients.retry_delay_s,
        },
        "policies": {},
    }
    for policy in names:
        runs = [(lv, records_of[c]) for c, (name, lv) in levels_of.items() if name == policy]
        per_level = [
            {
                "level": lv,
                "rate_rps": lv * capacity,
                **figures(rs, span * offered / (lv * capacity)),
            }
            for lv, rs in runs
        ]
        pooled = figures(
            [r for _, rs in runs for r in rs],
            sum(span * offered / (lv * capacity) for lv, _ in runs),
        )
        for rate in ("total_tok_s", "goodput_tok_s"):
            pooled[rate] = float(np.mean([level[rate] for level in per_level]))
        pooled["capacity_at_90_rps"] = capacity_at(per_level)
        document["policies"][policy] = pooled | {"per_level": per_level}
    return document


def figures(
    records: Sequence[RequestRecord],
    window_s: float,
    objectives: Mapping[TaskClass, ClassObjective] = DEFAULT_OBJECTIVES,
) -> dict[str, Any]:
    """The benchmark's figures of one run's records, rates per second of ``window_s`` (or
    several runs' together, over the sum of their windows)."""
    result = _outcomes(records, window_s, objectives)
    result["per_class"] = {
        task_class: _outcomes(
            [r for r in records if r.task_class == task_class], window_s, objectives
        )
        | _latencies([r for r in records if r.task_class == task_class])
        for task_class in sorted({r.task_class for r in records})
    }
    return result


def capacity_at(
    per_level: Sequence[Mapping[str, Any]], attainment: float = ATTAINMENT
) -> float | None:
    """The arrival rate where compliance falls through ``attainment``, interpolated
    between the ladder's levels; the top level's rate if it never falls through, None if
    even the lowest level misses it."""
    points = sorted((float(lv["rate_rps"]), float(lv["compliance"])) for lv in per_level)
    if not points or points[0][1] < attainment:
        return None
    for (rate, share), (next_rate, next_share) in pairwise(points):
        if next_share < attainment:
            return rate + (share - attainment) / (share - next_share) * (next_rate - rate)
    return float(points[-1][0])


def _outcomes(
    records: Sequence[RequestRecord],
    window_s: float,
    objectives: Mapping[TaskClass, ClassObjective],
) -> dict[str, Any]:
    done = [r for r in records if r.outcome == "completed"]
    met = [r for r in done if met_objective(r, objectives)]
    duration = max(window_s, 1e-9)
    arrivals = max(len(records), 1)
    return {
        "arrivals": len(records),
        "total_tok_s": sum(r.output_tokens for r in done) / duration,
        "goodput_tok_s": sum(r.output_tokens for r in met) / duration,
        "compliance": len(met) / arrivals,
        "wasted_tok": sum(r.output_tokens for r in records if r.outcome != "completed"),
        "lost_work_tok": sum(r.lost_work_tokens for r in records),
        "rejected_share": sum(r.outcome == "rejected" for r in records) / arrivals,
        "cancelled_share": sum(r.outcome == "cancelled" for r in records) / arrivals,
    }


def _latencies(records: Sequence[RequestRecord]) -> dict[str, float]:
    done = [r for r in records if r.outcome == "completed"]
    ttft = latency_stats("ttft", [r.ttft_s for r in done if r.ttft_s is not None])
    tpot = latency_stats(
        "tpot", [r.tpot_s for r in done if r.tpot_s is not None and r.output_tokens > 1]
    )
    return {k: v for k, v in (ttft | tpot).items() if "p50" in k or "p95" in k}


def plot_levels(document: Mapping[str, Any], path: Path) -> None:
    """Goodput and compliance per level, one line per policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (goodput, compliance) = plt.subplots(1, 2, figsize=(11, 4.5))
    for policy, result in document["policies"].items():
        levels = [level["level"] for level in result["per_level"]]
        width = 2.2 if policy == "slomax" else 1.2
        for axes, figure_name in ((goodput, "goodput_tok_s"), (compliance, "compliance")):
            values = [level[figure_name] for level in result["per_level"]]
            axes.plot(levels, values, marker="o", linewidth=width, label=policy)
    goodput.set_ylabel("goodput (output tokens/s meeting their objective)")
    compliance.set_ylabel("share of arrivals meeting their objective")
    compliance.axhline(ATTAINMENT, color="grey", linestyle=":", linewidth=1)
    for axes in (goodput, compliance):
        axes.set_xlabel("offered load (share of measured capacity)")
        axes.grid(True, alpha=0.3)
    compliance.legend(fontsize=8)
    figure.suptitle(
        f"{document['trace']}, {document['instances']} instances, router {document['router']}"
    )
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def step_change(
    trace: str = "mixed",
    *,
    instances: int = 16,
    profile_name: str = DEFAULT_PROFILE,
    levels: tuple[float, float] = (0.8, 1.5),
    requests: int | None = None,
    seed: int = 0,
) -> dict[str, Any]:
    """SLOMax with its controller on a load that steps from ``levels[0]`` to ``levels[1]``
    of capacity halfway through the arrivals: the controller's passes (the limit it
    published, and the attainments it read) over time."""
    chosen = profile(profile_name)
    workload = load_trace(trace, limit=requests, seed=seed)
    capacity = instance_capacity_rps(chosen, workload) * instances
    offered = offered_rate_rps(workload)
    half = workload[len(workload) // 2].arrival_s
    low, high = (level * capacity / offered for level in levels)
    stepped = [
        replace(
            r,
            arrival_s=r.arrival_s / low
            if r.arrival_s < half
            else half / low + (r.arrival_s - half) / high,
        )
        for r in workload
    ]
    loop = QuotaLoop()
    pool = chosen.pool_model()
    simulation = Simulation(
        Cluster.single(chosen, instances),
        make_router("tokenpilot", seed, pool),
        admission=make_admission("slomax", pool),
        clients=ClientModel(seed=seed),
        control=loop,
    )
    simulation.run(stepped)
    return {
        "trace": trace,
        "instances": instances,
        "levels": list(levels),
        "step_at_s": half / low,
        "last_arrival_s": stepped[-1].arrival_s,
        "passes": [asdict(step) for step in loop.steps],
    }


def plot_step_change(result: Mapping[str, Any], path: Path) -> None:
    """The controller's limit and the attainments it read, over time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    until = result["last_arrival_s"] + 60.0  # then only the last requests drain
    passes = [p for p in result["passes"] if p["at_s"] <= until]
    times = [p["at_s"] for p in passes]
    figure, (limit, attained) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    limit.step(times, [p["long_documents"] for p in passes], where="post", label="long documents")
    if any(p["batch"] is not None for p in passes):  # a gap where the ceiling was lifted
        limit.step(times, [p["batch"] for p in passes], where="post", label="batch")
        limit.legend(fontsize=8)
    limit.set_ylabel("in flight, at most")
    for key, label in (
        ("interactive_compliance", "interactive"),
        ("long_document_compliance", "long_document"),
    ):
        attained.plot(times, [p[key] for p in passes], label=label)
    aim = QuotaControllerParams().interactive_target
    attained.axhline(
        aim, color="grey", linestyle=":", label=f"chats: the controller's aim ({aim:.0%})"
    )
    attained.set_ylabel("met their objective (60 s window)")
    attained.set_xlabel("simulated time (s)")
    attained.legend(fontsize=8)
    low, high = result["levels"]
    for axes in (limit, attained):
        axes.axvline(result["step_at_s"], color="red", linewidth=0.8)
        axes.grid(True, alpha=0.3)
    figure.suptitle(f"SLOMax's controller, load stepping from {low:g} to {high:g} x capacity")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)

"""The embedded main job: no Kafka, no Redis, everything in one process.

The whole policy stack on a fleet in the seed's layout (``sim/fleet_bench.py``: an entry
region without GPUs, its home DC taking a hotspot at twice its capacity, two extension
DCs, one still warming up), on the mixed workload: TokenFleet (FleetMind at the edge with
its weights loop and its long cycle placing replicas on idle GPUs, SLOMax and its quota
loop in front of TokenPilot in each DC) against
what an operator runs without it (llm-d's default routing, first come first served, each
request in its home DC), on the same arrivals. TokenFleet runs here with a live view
every ``LIVE_EVERY_S`` simulated seconds; the baseline runs beside it in a worker
process. At the end: a report, a plot and the figures as JSON, and the command again.
"""

from __future__ import annotations

import shlex
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from control.controllers.fleetmind import weight_for
from control.controllers.slomax import ceiling, long_documents
from schemas.base import TaskClass
from schemas.objectives import DEFAULT_OBJECTIVES
from sim.fleet_bench import (
    BASELINE,
    END_S,
    HOTSPOT_REGION,
    HOTSPOT_S,
    INSTANCES_PER_DC,
    TOKENFLEET,
    plot_fleet,
    run_stack,
    scenario,
)
from sim.fleet_sim import FleetSimulation
from sim.metrics import met_objective
from sim.profiles import DEFAULT_PROFILE
from sim.records import RequestRecord
from sim.workers import worker_processes
from tokenfleet.commands.output import as_json, save_each

LIVE_EVERY_S = 30
Say = Callable[[str], None]


def run_demo(
    seed: int = 0,
    instances_per_dc: int = INSTANCES_PER_DC,
    say: Say = print,
) -> dict[str, Any]:
    """Both stacks' figures (as ``bench fleet`` writes them; ``write_demo`` writes them)."""
    say(f"Building the scenario: the mixed workload in the seed's layout, seed {seed} ...")
    case = scenario(seed=seed, instances_per_dc=instances_per_dc)
    say(
        f"{len(case.requests):,} requests over {END_S:.0f} s; the hotspot in dc-b from "
        f"{HOTSPOT_S[0]:.0f} to {HOTSPOT_S[1]:.0f} s; {instances_per_dc} instances a DC."
    )
    with worker_processes(1, 1) as pool:
        baseline = pool.submit(run_stack, BASELINE, case, DEFAULT_PROFILE, seed)
        say(f"TokenFleet, live (the baseline runs beside it): every {LIVE_EVERY_S} s simulated")
        ours = run_stack(TOKENFLEET, case, DEFAULT_PROFILE, seed, observe=_live_view(say))
        theirs = baseline.result()
    document: dict[str, Any] = {
        "seed": seed,
        "instances_per_dc": instances_per_dc,
        "requests": len(case.requests),
        "hotspot_s": list(HOTSPOT_S),
        "end_s": END_S,
        "stacks": {stack.name: vars(stack) for stack in (TOKENFLEET, BASELINE)},
        "policies": {TOKENFLEET.name: ours[0], BASELINE.name: theirs[0]},
        "series": {TOKENFLEET.name: ours[1], BASELINE.name: theirs[1]},
    }
    return document


def write_demo(document: dict[str, Any], out: Path) -> None:
    """The figures (demo.json) and the plot (demo.png) in ``out``, which exists."""
    save_each(
        (out / "demo.json", as_json(document)), (out / "demo.png", partial(plot_fleet, document))
    )


def _live_view(say: Say) -> Callable[[FleetSimulation], None]:
    """Every ``LIVE_EVERY_S``: the goodput so far, fleet-wide and per class; then per DC
    its replicas ready of those placed, running and queued requests, weight for the
    hotspot's chats, SLOMax's ceilings (long documents, batch) and its goodput per class."""

    def view(simulation: FleetSimulation) -> None:
        at = round(simulation.now)
        if at % LIVE_EVERY_S or not simulation.tables:
            return
        latest = simulation.tables[-1].values()
        if at > END_S and not any(load.running or load.queued for load in latest):
            return  # the arrivals are over and the DCs idle: only clients' timers are left
        weights = simulation.weights_now(HOTSPOT_REGION)
        lines = []
        for site, dc in zip(simulation.layout.sites, simulation.simulations, strict=True):
            load = simulation.tables[-1][site.name]
            quotas = dc.control.quotas if dc.control else None
            limit = long_documents(quotas) if quotas else None
            batch = ceiling(quotas, TaskClass.BATCH) if quotas else None
            chats = weight_for(weights, site.name, TaskClass.INTERACTIVE) or 1.0
            lines.append(
                f"  {site.name:<5} {load.ready_instances}/{load.deployed} up "
                f"{load.running:>4} run {load.queued:>4} queued  w {chats:.2f}  "
                f"docs<={limit or '-':<3} batch<={batch or '-':<4} "
                f"goodput {_by_class(dc.records, at)}"
            )
        records = [r for dc in simulation.simulations for r in dc.records]
        say(f"t={at:>4}s goodput so far {_by_class(records, at)}\n" + "\n".join(lines))

    return view


def _by_class(records: list[RequestRecord], at: int) -> str:
    """Tokens per second so far of ``records`` that met their objective: all, and by class;
    per second of the arrivals' span so far, as the report counts it (past ``END_S``, per
    second of the whole span: the last line showed 6,385 tok/s, the report 6,942)."""
    met = [r for r in records if met_objective(r, DEFAULT_OBJECTIVES)]
    span_s = max(min(at, END_S), 1)
    rates = {
        c: sum(r.output_tokens for r in met if r.task_class == c.value) / span_s for c in TaskClass
    }
    each = ", ".join(f"{c.value} {rate:,.0f}" for c, rate in rates.items())
    return f"{sum(rates.values()):,.0f} tok/s ({each})"


def report(document: dict[str, Any]) -> list[str]:
    """The end-of-run report: the two stacks side by side."""
    ours, theirs = (document["policies"][s.name] for s in (TOKENFLEET, BASELINE))
    rows = [
        ("goodput (tokens/s)", "goodput_tok_s", "{:,.0f}"),
        ("met their objective", "compliance", "{:.1%}"),
        ("refused", "rejected_share", "{:.1%}"),
        ("run outside their home DC", "cross_dc_share", "{:.1%}"),
    ]
    lines = [f"{'':34}{'TokenFleet':>14}{'baseline':>14}"]
    for label, key, fmt in rows:
        lines.append(f"{label:34}{fmt.format(ours[key]):>14}{fmt.format(theirs[key]):>14}")
    for task_class in sorted(ours["per_class"]):
        mine = ours["per_class"][task_class]["compliance"]
        other = theirs["per_class"].get(task_class, {}).get("compliance", 0.0)
        lines.append(f"{'  in time, ' + task_class:34}{mine:>14.1%}{other:>14.1%}")
    hot = [p["hotspot"]["ttft_p95_s"] for p in (ours, theirs)]
    lines.append(f"{'hotspot TTFT P95 (s)':34}{hot[0]:>14.2f}{hot[1]:>14.2f}")
    ratio = ours["goodput_tok_s"] / max(theirs["goodput_tok_s"], 1e-9)
    lines.append(f"TokenFleet's goodput is {ratio:.2f} x the baseline's.")
    return lines


def main(seed: int, instances_per_dc: int, out: Path) -> int:
    document = run_demo(seed, instances_per_dc)
    print()
    for line in report(document):
        print(line)
    write_demo(document, out)
    print(f"\nFigures: {out / 'demo.json'}; A's traffic by DC over time: {out / 'demo.png'}")
    print(f"Run it again: {again(seed, instances_per_dc, out)}")
    return 0


def again(seed: int, instances_per_dc: int, out: Path) -> str:
    """The command that gives the same figures (the default fleet's size left unsaid), as a
    shell reads it."""
    size = ["--instances-per-dc", str(instances_per_dc)]
    if instances_per_dc == INSTANCES_PER_DC:
        size = []
    return shlex.join(["tokenfleet", "demo", "--seed", str(seed), *size, "--out", str(out)])

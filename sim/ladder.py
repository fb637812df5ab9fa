"""Load levels relative to what a cluster can serve of a given workload.

Capacity is measured, not assumed: a sample of the workload arrives all at once on one
instance, and the requests it completes per second of makespan, times the number of
instances, is the cluster's capacity for that mix.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from control.routing import make_router
from sim.cluster import Cluster, InstanceProfile
from sim.simulator import Simulation
from sim.workload import TraceRequest

DEFAULT_LADDER = (0.5, 0.8, 1.0, 1.2)


def instance_capacity_rps(
    profile: InstanceProfile, requests: Sequence[TraceRequest], sample: int = 300
) -> float:
    """Requests per second one instance completes of a burst of ``sample`` requests."""
    step = max(1, len(requests) // sample)
    burst = [replace(r, arrival_s=0.0) for r in requests[::step][:sample]]
    simulation = Simulation(Cluster.single(profile, 1), make_router("round_robin"))
    records = simulation.run(burst)
    done = [r for r in records if r.outcome == "completed"]
    makespan = max(r.arrival_s + (r.e2e_s or 0.0) for r in done)
    return len(done) / makespan


def offered_rate_rps(requests: Sequence[TraceRequest]) -> float:
    span = requests[-1].arrival_s - requests[0].arrival_s
    return len(requests) / span if span > 0 else float("inf")


def rate_scales(
    profile: InstanceProfile,
    requests: Sequence[TraceRequest],
    instances: int,
    levels: Sequence[float] = DEFAULT_LADDER,
) -> list[float]:
    """The ``--rate-scale`` of each level: level x capacity / the trace's own rate."""
    capacity = instance_capacity_rps(profile, requests) * instances
    return [level * capacity / offered_rate_rps(requests) for level in levels]

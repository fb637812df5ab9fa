"""Load levels relative to what a cluster can serve of a given workload.

Capacity is measured, not assumed: a sample of the workload arrives all at once on one
instance, and the requests per second that instance completes while it still has a
backlog, times the number of instances, is the cluster's capacity for that mix.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from control.routing import make_router
from sim.cluster import Cluster, InstanceProfile
from sim.simulator import Simulation
from sim.workload import TraceRequest

DEFAULT_LADDER = (0.5, 0.8, 1.0, 1.2)


def instance_capacity_rps(
    profile: InstanceProfile, requests: Sequence[TraceRequest], sample: int = 1_000
) -> float:
    """Requests per second one instance completes while it has a backlog.

    ``sample`` of the requests (every n-th) arrive at once. Until the last of them is
    admitted, the engine is never short of work; by Little's law, what it completes per
    second then is the number of sequences it runs at once (on average over that time)
    over the time each request holds its place, from admission to completion.

    Not the burst's requests over its makespan: the drain, when the last long requests
    decode in a shrinking batch, counts there as capacity unused, and its share depends
    on the sample. On the Azure trace that rate read 13.9 requests per second for a
    burst of 300, 16.3 for 1,000 and 19.6 for 3,000, where this one reads 21.0 and 21.1
    at 1,000 and 3,000. A sample of 300 Mooncake requests read between 1.01 and 1.44 over
    seeds 0 to 4 (the seed places arrivals within the trace's 3 s buckets, and so which
    requests are sampled); this one, at 1,000, 1.40, 1.36 and 1.36 at seeds 0, 1 and 3.
    A burst that fits in one batch has no backlog: its makespan is all there is to go by.
    A burst under ``max_num_seqs`` can still wait for the step's token budget; its backlog
    is then only the prefill ramp, and the rate reads low (50 requests of 500 tokens: 20
    per second, where 50 over the makespan is 35): sample a burst well past the batch.
    """
    step = max(1, len(requests) // sample)
    burst = [replace(r, arrival_s=0.0) for r in requests[::step][:sample]]
    simulation = Simulation(Cluster.single(profile, 1), make_router("round_robin"))
    done = [r for r in simulation.run(burst) if r.outcome == "completed"]
    if not done:
        raise ValueError(
            f"none of the {len(burst)} requests sampled to measure an instance's capacity "
            "completed on one instance: are they all too long for it?"
        )
    admitted = np.array([r.queue_wait_s or 0.0 for r in done])
    finished = np.array([r.e2e_s or 0.0 for r in done])
    backlog_s = admitted.max()
    if backlog_s <= 0:
        return float(len(done) / finished.max())
    running_s = np.clip(np.minimum(finished, backlog_s) - admitted, 0.0, None)
    return float((running_s.sum() / backlog_s) / (finished - admitted).mean())


def offered_rate_rps(requests: Sequence[TraceRequest]) -> float:
    """The trace's own arrival rate; ValueError where its arrivals span no time (one
    request, or all at once), which a ladder cannot scale to a rate."""
    span = requests[-1].arrival_s - requests[0].arrival_s if requests else 0.0
    if span <= 0:
        raise ValueError(
            f"the trace's {len(requests)} arrivals span no time: a ladder scales their "
            "rate, so it needs requests that arrive over time"
        )
    return len(requests) / span


def rate_scales(
    profile: InstanceProfile,
    requests: Sequence[TraceRequest],
    instances: int,
    levels: Sequence[float] = DEFAULT_LADDER,
) -> list[float]:
    """The ``--rate-scale`` of each level: level x capacity / the trace's own rate."""
    capacity = instance_capacity_rps(profile, requests) * instances
    return [level * capacity / offered_rate_rps(requests) for level in levels]

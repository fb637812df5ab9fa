"""How fast the simulator runs: ``tokenfleet bench sim``.

- the whole Mooncake conversation trace on 16 instances (the target: at most 60 s);
- instance scaling: 16, 64 and 256 instances with the arrival rate scaled with them, so
  each instance sees the same load;
- request scaling: the first quarter, half and all of the trace on 16 instances.
"""

from __future__ import annotations

import platform
import time
from collections.abc import Callable, Sequence

from control.routing import make_router
from sim.cluster import Cluster
from sim.profiles import DEFAULT_PROFILE, profile
from sim.registry import load_trace
from sim.run import scaled
from sim.simulator import Simulation
from sim.workload import TraceRequest


def timed_run(requests: Sequence[TraceRequest], instances: int, policy: str) -> dict[str, float]:
    chosen = profile(DEFAULT_PROFILE)
    router = make_router(policy, pool=chosen.pool_model())
    simulation = Simulation(Cluster.single(chosen, instances), router)
    started = time.perf_counter()
    records = simulation.run(requests)
    wall = time.perf_counter() - started
    return {
        "instances": instances,
        "requests": len(records),
        "wall_s": wall,
        "simulated_requests_per_s": len(records) / wall,
    }


def bench_sim(
    policy: str = "least_requests",
    instance_counts: Sequence[int] = (16, 64, 256),
    report: Callable[[str, dict[str, float]], None] | None = None,
) -> dict[str, object]:
    trace = load_trace("mooncake")
    result: dict[str, object] = {
        "machine": f"{platform.machine()}, {platform.python_implementation()} "
        f"{platform.python_version()}",
        "profile": DEFAULT_PROFILE,
        "policy": policy,
    }

    def run(label: str, requests: Sequence[TraceRequest], instances: int) -> dict[str, float]:
        figures = timed_run(requests, instances, policy)
        if report:
            report(label, figures)
        return figures

    result["whole_trace_16"] = run("whole trace, 16 instances", trace, 16)
    result["instance_scaling"] = [
        run(f"{n} instances", scaled(trace, n / 16), n) for n in instance_counts
    ]
    result["request_scaling"] = [
        run(f"{n} requests", trace[:n], 16) for n in (len(trace) // 4, len(trace) // 2, len(trace))
    ]
    return result

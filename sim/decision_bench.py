"""How long one routing decision takes: ``tokenfleet bench decision``.

A fleet of N instances with varied load, each seen ending a step in the last 30 ms, an
index holding shared prefixes on many of them, and a 16k-token prompt (1,000 blocks) half
of which some instances hold: the router is timed over repeated decisions (prefix matching
and the decision record included), after a warm-up, with ``time.perf_counter_ns``.

Several policies are timed side by side: every router decides each request on the same
snapshot, in an order that rotates, so a shared machine's noise slows them alike (and each
pays for the others evicting its data from the CPU's caches). On this project's machine,
over three runs in which TokenPilot's P50 moved by a third, each baseline's P50 ratio to it
moved by 0.01 to 0.14 (``docs/routing.md``, "Side by side with the baselines").
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from control.routing import FleetSnapshot, RouteRequest, make_router
from sim.profiles import DEFAULT_PROFILE, profile

PROMPT_TOKENS = 16_384
SIZES = (16, 256, 1024, 4096)
WARM_UP = 200


def random_fleet(size: int, rng: np.random.Generator) -> FleetSnapshot:
    total = np.full(size, 28_000, dtype=np.int64)
    return FleetSnapshot(
        tuple(f"i{n}" for n in range(size)),
        np.ones(size, dtype=bool),
        rng.integers(0, 8, size),
        rng.integers(0, 64, size),
        rng.integers(0, 200_000, size),
        rng.integers(0, 27_000, size),
        total,
    )


def time_decisions(
    policies: Sequence[str], size: int, decisions: int = 2_000, seed: int = 0
) -> list[dict]:
    """One row per policy: P50 and P99 in microseconds, and each as a ratio to the first
    policy's."""
    rng = np.random.default_rng(seed)
    pool = profile(DEFAULT_PROFILE).pool_model()
    routers = [make_router(policy, seed=seed, pool=pool) for policy in policies]
    blocks = PROMPT_TOKENS // 16
    shared = tuple(range(blocks // 2))
    indexes = [router.index for router in routers if hasattr(router, "index")]
    for instance in [int(rng.integers(size)) for _ in range(min(size, 64))]:
        for index in indexes:  # half the prompt cached there, in each prefix router's index
            index.add(instance, shared)
    fleet = random_fleet(size, rng)
    times = np.zeros((len(routers), decisions + WARM_UP))
    for n in range(decisions + WARM_UP):
        prompt = shared + tuple(10**9 + n * blocks + k for k in range(blocks - len(shared)))
        request = RouteRequest(f"r{n}", PROMPT_TOKENS, 256, prompt)
        now = n * 0.01
        stepping = replace(fleet, last_step_end_s=now - rng.uniform(0, 0.03, size))
        for turn in range(len(routers)):
            which = (n + turn) % len(routers)
            started = time.perf_counter_ns()
            routers[which].route(request, stepping, now=now)
            times[which, n] = (time.perf_counter_ns() - started) / 1_000
    p50, p99 = np.percentile(times[:, WARM_UP:], [50, 99], axis=1)
    return [
        {
            "policy": policy,
            "instances": size,
            "decisions": decisions,
            "p50_us": float(p50[row]),
            "p99_us": float(p99[row]),
            "p50_ratio": float(p50[row] / p50[0]),
            "p99_ratio": float(p99[row] / p99[0]),
        }
        for row, policy in enumerate(policies)
    ]

"""How long one routing decision takes: ``tokenfleet bench decision``.

A fleet of N instances with varied load, each seen ending a step in the last 30 ms, an
index holding shared prefixes on many of them, and a 16k-token prompt (1,000 blocks) half
of which some instances hold: the router is timed over repeated decisions (prefix matching
and the decision record included), after a warm-up, with ``time.perf_counter_ns``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from control.routing import FleetSnapshot, RouteRequest, make_router
from sim.profiles import profile

PROMPT_TOKENS = 16_384


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


def time_decisions(policy: str, size: int, decisions: int = 2_000, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    router = make_router(policy, seed=seed, pool=profile("llama3-70b-4xh100").pool_model())
    blocks = PROMPT_TOKENS // 16
    shared = tuple(range(blocks // 2))
    for _ in range(min(size, 64)):  # half the prompt cached on up to 64 instances
        router.index.add(int(rng.integers(size)), shared)
    fleet = random_fleet(size, rng)
    times = []
    for n in range(decisions + 200):
        prompt = shared + tuple(10**9 + n * blocks + k for k in range(blocks - len(shared)))
        request = RouteRequest(f"r{n}", PROMPT_TOKENS, 256, prompt)
        now = n * 0.01
        stepping = replace(fleet, last_step_end_s=now - rng.uniform(0, 0.03, size))
        started = time.perf_counter_ns()
        router.route(request, stepping, now=now)
        elapsed = time.perf_counter_ns() - started
        if n >= 200:
            times.append(elapsed / 1_000)
    array = np.array(times)
    return {
        "instances": size,
        "decisions": decisions,
        "p50_us": float(np.percentile(array, 50)),
        "p99_us": float(np.percentile(array, 99)),
    }


def bench_decisions(
    policy: str = "tokenpilot", sizes: Sequence[int] = (16, 256, 1024, 4096)
) -> list[dict]:
    return [time_decisions(policy, size) for size in sizes]

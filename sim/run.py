"""One simulation run from names and numbers: what ``tokenfleet sim`` and the benchmarks do."""

from __future__ import annotations

import csv
import math
import random
import time
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import as_completed
from dataclasses import asdict, dataclass, field, fields, is_dataclass, replace
from pathlib import Path
from typing import Any

from control.admission.registry import CONTROLLED, make_admission
from control.pipeline import check_pairing
from control.routing import make_router
from control.routing.tokenpilot import TokenPilotParams
from control.step_time import Blackbox, StepTime
from sim.clients import ClientModel
from sim.cluster import Cluster, InstanceProfile
from sim.control_loop import QuotaLoop
from sim.ladder import rate_scales
from sim.metrics import summarize
from sim.profiles import DEFAULT_PROFILE, profile
from sim.progress import with_progress
from sim.records import RequestRecord
from sim.registry import load_trace
from sim.simulator import HOST_TOKEN_LAG_S, Simulation
from sim.workers import worker_processes
from sim.workload import TraceRequest


@dataclass(frozen=True)
class RunConfig:
    trace: str
    instances: int = 16
    policy: str = "round_robin"
    profile: str = DEFAULT_PROFILE
    requests: int | None = None
    rate_scale: float = 1.0
    seed: int = 0
    blackbox: Blackbox | None = None
    """BLIS-form coefficients to use instead of the profile's step times."""
    host_token_lag_s: float = HOST_TOKEN_LAG_S
    """How late the host sees each step's streamed tokens (what TokenPilot assumes of it
    is its own parameter, ``token_lag_s``)."""
    tokenpilot: TokenPilotParams = field(default_factory=TokenPilotParams)
    """TokenPilot's parameters, as a deployment sets them (other policies ignore them)."""
    step_model_error: float = 0.0
    """Each term of the step model the router is given off by this fraction, up or down
    at random (seeded), while the engines step with the true one: how much TokenPilot
    owes to knowing the engines' own model."""
    admission: str = "fcfs"
    """The admission policy in front of the router (``control.admission.registry``)."""
    clients: ClientModel | None = None
    """How clients give up and retry (None: they wait for every answer, and never retry)."""

    def instance_profile(self) -> InstanceProfile:
        chosen = profile(self.profile)
        return chosen if self.blackbox is None else replace(chosen, step_time=self.blackbox)


def check_policies(policy: str, admission: str, profile_name: str = DEFAULT_PROFILE) -> None:
    """ValueError, before any work, where admission ``admission`` cannot run behind router
    ``policy`` (``control.pipeline.check_pairing``), both built for the profile's pool."""
    pool = profile(profile_name).pool_model()
    check_pairing(make_admission(admission, pool), make_router(policy, pool=pool))


def misjudged(step_time: StepTime, error: float, seed: int) -> StepTime:
    """``step_time`` with each of its numeric terms times 1 + ``error`` or 1 - ``error``,
    the sign drawn at random per term (seeded); a step model is a dataclass."""
    assert is_dataclass(step_time)
    assert not isinstance(step_time, type)
    rng = random.Random(seed)
    changed = {
        f.name: getattr(step_time, f.name) * (1 + error * rng.choice((-1, 1)))
        for f in fields(step_time)
        if isinstance(getattr(step_time, f.name), float)
    }
    return replace(step_time, **changed)


def scaled(requests: Iterable[TraceRequest], rate_scale: float) -> list[TraceRequest]:
    """Arrivals ``rate_scale`` times as dense (2.0 = twice the request rate)."""
    if rate_scale <= 0:
        raise ValueError("rate scale must be positive")
    spread = [replace(r, arrival_s=r.arrival_s / rate_scale) for r in requests]
    if not all(math.isfinite(r.arrival_s) for r in spread):
        raise ValueError(
            f"rate scale {rate_scale:g} spreads the arrivals past any time a number can hold"
        )
    return spread


def simulate_run(
    config: RunConfig,
    *,
    progress: bool = False,
    workload: list[TraceRequest] | None = None,
) -> tuple[dict[str, Any], list[RequestRecord]]:
    """Run ``config``; ``workload`` saves loading the trace again when it is at hand."""
    if workload is None:
        workload = load_trace(config.trace, limit=config.requests, seed=config.seed)
    workload = scaled(workload, config.rate_scale)
    chosen = config.instance_profile()
    cluster = Cluster.single(chosen, config.instances)
    pool = chosen.pool_model()
    if config.step_model_error:
        step_time = misjudged(pool.step_time, config.step_model_error, config.seed)
        pool = replace(pool, step_time=step_time)
    params = config.tokenpilot if config.policy == "tokenpilot" else None
    router = make_router(config.policy, config.seed, pool, params)
    simulation = Simulation(
        cluster,
        router,
        token_lag_s=config.host_token_lag_s,
        admission=make_admission(config.admission, pool),
        clients=config.clients,
        control=QuotaLoop() if config.admission in CONTROLLED else None,
    )
    started = time.perf_counter()
    records = simulation.run(with_progress(workload, progress, config.policy))
    wall = time.perf_counter() - started
    result = {
        "trace": config.trace,
        "instances": config.instances,
        "profile": config.profile,
        "policy": config.policy,
        "admission": config.admission,
        "seed": config.seed,
        "rate_scale": config.rate_scale,
        "host_token_lag_s": config.host_token_lag_s,
        "step_model_error": config.step_model_error,
        "tokenpilot_params": asdict(config.tokenpilot),
        "summary": summarize(records, simulation.engines),
        "wall_s": wall,
        "simulated_requests_per_s": len(workload) / wall if wall > 0 else 0.0,
    }
    return result, records


def run_all(
    configs: list[RunConfig], workload: list[TraceRequest], jobs: int
) -> Iterator[tuple[RunConfig, tuple[dict[str, Any], list[RequestRecord]]]]:
    """Each run's outcome, as runs finish, in ``jobs`` worker processes (which load the
    trace themselves) or, with ``jobs`` 1, here; each run is the same deterministic
    simulation either way."""
    if jobs <= 1:
        for config in configs:
            yield config, simulate_run(config, workload=workload)
        return
    with worker_processes(jobs, len(configs)) as pool:
        futures = {pool.submit(simulate_run, config): config for config in configs}
        for future in as_completed(futures):
            yield futures[future], future.result()


def write_records(rows: Iterable[dict[str, Any]], path: Path) -> None:
    """One CSV row per request (``RequestRecord.as_dict``, and a ladder's ``level``)."""
    rows = list(rows)
    with path.open("w", newline="") as out:
        if rows:
            writer = csv.DictWriter(out, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)


def simulate_ladder(
    config: RunConfig, levels: Sequence[float], *, progress: bool = False
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The run at each load level (a share of the cluster's measured capacity), and each
    request's record at each level, the level and its rate scale first (a request runs at
    every level, under one id)."""
    workload = load_trace(config.trace, limit=config.requests, seed=config.seed)
    scales = rate_scales(config.instance_profile(), workload, config.instances, levels)
    results = []
    records: list[dict[str, Any]] = []
    for level, scale in zip(levels, scales, strict=True):
        result, level_records = simulate_run(
            replace(config, rate_scale=scale), progress=progress, workload=workload
        )
        results.append({"level": level, **result})
        at = {"level": level, "rate_scale": scale}
        records.extend(at | record.as_dict() for record in level_records)
    return {"trace": config.trace, "ladder": list(levels), "levels": results}, records

"""Every routing policy on the same trace, cluster and seed, across a load ladder:
``tokenfleet bench routing``.

Figures are pooled over all levels (the records of every level together), with each level's
summary beside them. ``lower_bound`` is what no router can beat: every request prefilled
alone on an idle instance, with every block an earlier request of the trace had counted as
cached. ``fleet_cache_reference`` is the same with the fleet's KV blocks as one LRU cache:
what perfect placement could reach with the cache the fleet has.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path

import numpy as np

from control.routing import ROUTERS
from control.routing.tokenpilot import TokenPilotParams
from sim.cluster import InstanceProfile
from sim.ladder import DEFAULT_LADDER, rate_scales
from sim.metrics import latency_stats, record_figures
from sim.profiles import DEFAULT_PROFILE, profile
from sim.records import RequestRecord
from sim.registry import load_trace
from sim.run import RunConfig, run_all
from sim.simulator import HOST_TOKEN_LAG_S
from sim.workload import ENGINE_BLOCK_TOKENS, TraceRequest, reusable_blocks

POOLED = ("ttft_p50_s", "ttft_p95_s", "ttft_p99_s", "ttft_mean_s", "tpot_p50_s", "e2e_p95_s")
Progress = Callable[[str], None]


def bench_routing(
    trace: str,
    *,
    instances: int = 16,
    profile_name: str = DEFAULT_PROFILE,
    ladder: Sequence[float] = DEFAULT_LADDER,
    requests: int | None = None,
    seed: int = 0,
    policies: Sequence[str] | None = None,
    jobs: int = 1,
    progress: Progress | None = None,
    host_token_lag_s: float = HOST_TOKEN_LAG_S,
    tokenpilot: TokenPilotParams | None = None,
    step_model_error: float = 0.0,
) -> tuple[dict, dict[str, list[RequestRecord]]]:
    """The benchmark's JSON document, and every policy's pooled records (for plots);
    ``tokenpilot`` sets TokenPilot's parameters (None: its defaults);
    ``step_model_error`` misjudges the step model routers are given (``run.misjudged``).

    With ``jobs`` above 1 the runs go to that many worker processes; each run is the same
    deterministic simulation either way, so the figures do not depend on ``jobs``."""
    chosen = profile(profile_name)
    params = tokenpilot or TokenPilotParams()
    workload = load_trace(trace, limit=requests, seed=seed)
    scales = rate_scales(chosen, workload, instances, ladder)
    document: dict = {
        "trace": trace,
        "instances": instances,
        "model": chosen.model,
        "profile": profile_name,
        "ladder": list(ladder),
        "seed": seed,
        "host_token_lag_s": host_token_lag_s,
        "step_model_error": step_model_error,
        "tokenpilot_params": asdict(params),
        "requests": len(workload),
        "policies": {},
    }
    names = list(policies or ROUTERS)
    levels_of = {
        RunConfig(
            trace,
            instances,
            policy,
            profile_name,
            requests,
            scale,
            seed,
            host_token_lag_s=host_token_lag_s,
            tokenpilot=params,
            step_model_error=step_model_error,
        ): level
        for policy in names
        for level, scale in zip(ladder, scales, strict=True)
    }
    outcomes = {}
    for config, outcome in run_all(list(levels_of), workload, jobs):
        outcomes[config] = outcome
        if progress:
            progress(f"{config.policy} at {levels_of[config]:g}")
    pooled_records: dict[str, list[RequestRecord]] = {}
    for policy in names:
        levels, records = [], []
        for config, level in levels_of.items():
            if config.policy != policy:
                continue
            result, level_records = outcomes[config]
            levels.append({"level": level, "rate_scale": config.rate_scale, **result["summary"]})
            records.extend(level_records)
        document["policies"][policy] = _pooled(records, levels)
        pooled_records[policy] = records
    document["lower_bound"] = lower_bound(workload, chosen)
    fleet_blocks = instances * chosen.engine.num_blocks
    document["fleet_cache_reference"] = lower_bound(workload, chosen, fleet_blocks)
    return document, pooled_records


def _pooled(records: list[RequestRecord], levels: list[dict]) -> dict:
    """Record figures over every level's records together; rates averaged over levels."""
    pooled = record_figures(records)
    figures: dict = {name: pooled[name] for name in (*POOLED, "cache_hit_rate", "rejected")}
    for rate in ("throughput_tok_s", "goodput_tok_s", "imbalance"):
        figures[rate] = float(np.mean([level[rate] for level in levels]))
    figures["per_level"] = levels
    return figures


def lower_bound(
    workload: Sequence[TraceRequest], chosen: InstanceProfile, capacity_blocks: int | None = None
) -> dict[str, float]:
    """TTFT quantiles with no queueing (each request prefilled alone on an idle instance)
    and every reusable block cached: by a cache without limit (``capacity_blocks`` None,
    the bound no router can beat), or by one LRU cache of ``capacity_blocks``. With the
    fleet's KV blocks, the second is a reference for what perfect placement could reach
    with the cache the fleet has (not a bound: LRU is not the best eviction, and running
    sequences hold KV too); ``cache_hit_rate`` is the share of prompt tokens it served."""
    model, engine = chosen.step_time, chosen.engine
    held: OrderedDict[int, None] = OrderedDict()
    ttfts, hits = [], 0
    for request in workload:
        cached = reusable_blocks(request.prefix_blocks, held) * ENGINE_BLOCK_TOKENS
        cached = min(cached, request.input_tokens - 1)
        hits += cached
        for block in request.prefix_blocks:
            held[block] = None
            held.move_to_end(block)
        while capacity_blocks is not None and len(held) > capacity_blocks:
            held.popitem(last=False)
        uncached = request.input_tokens - cached
        steps = -(-uncached // engine.max_num_batched_tokens)
        chunk = uncached / steps
        pairs = uncached * cached + uncached * (uncached + 1) // 2
        prefill = steps * model.step_s(int(chunk), 0, 0, 0) + model.step_s(0, pairs, 0, 0)
        ttfts.append(prefill - model.step_s(0, 0, 0, 0) + model.ttft_overhead_s)
    stats = latency_stats("ttft", ttfts)
    prompt_tokens = max(sum(request.input_tokens for request in workload), 1)
    return {
        "ttft_p50_s": stats["ttft_p50_s"],
        "ttft_p95_s": stats["ttft_p95_s"],
        "cache_hit_rate": hits / prompt_tokens,
    }


def plot_ttft_cdfs(records: dict[str, list[RequestRecord]], title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(8, 5))
    for policy, policy_records in records.items():
        ttft = np.sort([r.ttft_s for r in policy_records if r.ttft_s is not None])
        axes.plot(
            ttft,
            np.arange(1, ttft.size + 1) / ttft.size,
            label=policy,
            linewidth=2.2 if policy == "tokenpilot" else 1.2,
        )
    axes.set_xscale("log")
    axes.set_xlabel("time to first token (s, log scale)")
    axes.set_ylabel("share of requests")
    axes.set_title(title)
    axes.grid(True, which="both", alpha=0.3)
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)

"""The summary of a run: latency quantiles, throughput, goodput per class, cache and balance.

- Goodput: output tokens of requests that completed and met their class objective, per
  second of the run (first arrival to last completion).
- Compliance: the share of a class's requests that met its objective; rejected requests
  count as not met.
- Imbalance: the coefficient of variation (std / mean) of the instances' busy time.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from schemas.base import TaskClass
from schemas.objectives import DEFAULT_OBJECTIVES, ClassObjective
from sim.engine import Engine
from sim.records import RequestRecord

QUANTILES = (50, 95, 99)


def latency_stats(name: str, values: Sequence[float]) -> dict[str, float]:
    """``{name}_p50_s``, ``_p95_s``, ``_p99_s`` and ``_mean_s``; NaN when there are none."""
    array = np.asarray(values, dtype=np.float64)
    if array.size == 0:
        return {f"{name}_{k}_s": float("nan") for k in ("p50", "p95", "p99", "mean")}
    stats = {f"{name}_p{q}_s": float(np.percentile(array, q)) for q in QUANTILES}
    stats[f"{name}_mean_s"] = float(array.mean())
    return stats


def summarize(
    records: Sequence[RequestRecord],
    engines: Sequence[Engine],
    objectives: Mapping[TaskClass, ClassObjective] = DEFAULT_OBJECTIVES,
) -> dict[str, object]:
    done = [r for r in records if r.outcome == "completed"]
    start = min((r.arrival_s for r in records), default=0.0)
    end = max((r.arrival_s + (r.e2e_s or 0.0) for r in records), default=0.0)
    duration = max(end - start, 1e-9)
    summary: dict[str, object] = {"duration_s": duration, **record_figures(records)}
    summary["throughput_tok_s"] = sum(r.output_tokens for r in done) / duration
    classes = _per_class(records, objectives, duration)
    summary["classes"] = classes
    summary["goodput_tok_s"] = sum(c["goodput_tok_s"] for c in classes.values())
    summary |= _balance(engines, duration)
    return summary


def record_figures(records: Sequence[RequestRecord]) -> dict[str, float]:
    """What records alone tell, whatever span they cover: counts, latency quantiles of
    the completed requests, and the share of their prompt tokens the cache served."""
    done = [r for r in records if r.outcome == "completed"]
    figures: dict[str, float] = {
        "requests": len(records),
        "completed": len(done),
        "rejected": sum(r.outcome == "rejected" for r in records),
        "cancelled": sum(r.outcome == "cancelled" for r in records),
    }
    figures |= latency_stats("ttft", [r.ttft_s for r in done if r.ttft_s is not None])
    multi = [r for r in done if r.output_tokens > 1]
    figures |= latency_stats("tpot", [r.tpot_s for r in multi if r.tpot_s is not None])
    figures |= latency_stats("e2e", [r.e2e_s for r in done if r.e2e_s is not None])
    figures |= latency_stats(
        "queue_wait", [r.queue_wait_s for r in done if r.queue_wait_s is not None]
    )
    input_tokens = sum(r.input_tokens for r in done)
    figures["cache_hit_rate"] = sum(r.cached_tokens for r in done) / max(input_tokens, 1)
    return figures


def met_objective(record: RequestRecord, objectives: Mapping[TaskClass, ClassObjective]) -> bool:
    if record.outcome != "completed":
        return False
    assert record.ttft_s is not None
    assert record.tpot_s is not None
    assert record.e2e_s is not None
    objective = objectives[TaskClass(record.task_class)]
    return objective.met(record.ttft_s, record.tpot_s, record.e2e_s, record.deadline_s)


def _per_class(
    records: Sequence[RequestRecord],
    objectives: Mapping[TaskClass, ClassObjective],
    duration: float,
) -> dict[str, dict[str, float]]:
    classes: dict[str, dict[str, float]] = {}
    for task_class in sorted({r.task_class for r in records}):
        mine = [r for r in records if r.task_class == task_class]
        met = [r for r in mine if met_objective(r, objectives)]
        classes[task_class] = {
            "requests": len(mine),
            "met": len(met),
            "compliance": len(met) / len(mine),
            "goodput_tok_s": sum(r.output_tokens for r in met) / duration,
        }
    return classes


def _balance(engines: Sequence[Engine], duration: float) -> dict[str, float]:
    busy = np.array([e.counters.busy_s for e in engines])
    mean = float(busy.mean()) if busy.size else 0.0
    return {
        "utilisation_mean": mean / duration,
        "imbalance": float(busy.std() / mean) if mean > 0 else 0.0,
        "preemptions": sum(e.counters.preemptions for e in engines),
        "evicted_blocks": sum(e.pool.counters.evicted_blocks for e in engines),
    }

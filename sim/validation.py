"""The simulator against real vLLM runs nearer the benchmarks' regime: Llama-3.1-70B on
4 x H100 with tails, and a 70B instance past saturation.

``calibration`` fits and validates means on Llama-2-70B at moderate load. This module adds
every real measurement of a 70B model that the fit did not see, with their tails:

- **Llama-3.1-70B TP4** (the benchmarks' model), two runs of two stages each. Facts from
  inference-sim/sim-to-real-accuracy-validation at dcec3fd
  (``results_trainval/error_records.csv``, the ``actual`` columns: experiments 60 and 61,
  vLLM 0.15.1 per ``results/figure_captions.md``) and the workload and engine settings of
  the same experiments in BLIS's test data (inference-sim/inference-sim at f90a1e3a,
  ``testdata/trained_physics_iter29.json``): shared-prefix prompts (100 system + 447 or
  466 question tokens), constant rates for 600 s each, ``max_num_batched_tokens`` 8192
  or 2048, 128 sequences, 30,251 or 30,425 KV blocks. The mean output length is not
  recorded; it follows from the records' own definition of the per-token time,
  ``(E2E - TTFT) / (output - 1)``.
- **Past saturation**: the overloaded Llama-2-70B TP4 "reasoning" run of
  inference-sim/training at ed5c1d2 (1,083-token prompts, 1,442-token answers, 4 req/s
  for 1,200 s, ``max_num_batched_tokens`` 2048): a third of its requests hit the client's
  300 s timeout. The simulator has no client timeout, so it is compared on the share that
  finishes within 300 s, those requests' latencies, and the per-token time.

The upstream repositories carry no licence, so only these figures are taken, with this
citation; none of their files. No run here has long prompts (the Mooncake trace averages
12k tokens), heavy prefix reuse or KV pressure: those stay unvalidated.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from control.routing import make_router
from sim.calibration import Stage, stage_workload
from sim.cluster import Cluster, InstanceProfile
from sim.progress import with_progress
from sim.records import RequestRecord
from sim.simulator import Simulation

PROFILE = "llama3-70b-4xh100"
"""The profile validated: the benchmarks' (fitted to Llama-2-70B, Llama-3.1-70B's shape)."""

WARM_UP = 0.1
"""The share of each stage's first requests left out, as in ``calibration``."""

TAILS = ("ttft_mean", "ttft_p90", "ttft_p99", "e2e_mean", "e2e_p90", "e2e_p99", "per_token")


@dataclass(frozen=True)
class Run:
    """A measured run: its stages back to back on one instance, and its KV cache."""

    name: str
    stages: tuple[Stage, ...]
    kv_blocks: int
    measured: tuple[dict[str, float], ...]
    """Per stage, each of ``TAILS`` in ms."""


def _llama31_stage(
    run: str,
    index: int,
    rate: float,
    question: int,
    groups: int,
    users: int,
    batched: int,
    measured: dict[str, float],
) -> Stage:
    output = (measured["e2e_mean"] - measured["ttft_mean"]) / measured["per_token"] + 1
    return Stage(
        experiment=f"sim2real-{run}",
        model="meta-llama/Llama-3.1-70B-Instruct",
        tp=4,
        stage=f"stage_{index}",
        rate_rps=rate,
        duration_s=600.0,
        prompt_tokens=100 + question,
        output_tokens=output,
        system_prompt_tokens=100,
        groups=groups,
        users_per_group=users,
        max_num_batched_tokens=batched,
        max_num_seqs=128,
        ttft_s=measured["ttft_mean"] / 1e3,
        e2e_s=measured["e2e_mean"] / 1e3,
        per_token_s=measured["per_token"] / 1e3,
    )


def _measured(*values: float) -> dict[str, float]:
    return dict(zip(TAILS, values, strict=True))


_GENERAL = (
    _measured(51.955, 58.127, 88.102, 4207.896, 4286.477, 4567.041, 17.078),
    _measured(54.427, 62.240, 65.877, 4624.547, 4807.255, 4936.284, 18.799),
)
_CODEGEN = (
    _measured(54.736, 61.112, 106.949, 4494.733, 4607.148, 5617.299, 18.299),
    _measured(59.804, 68.010, 72.142, 5013.708, 5109.778, 5233.709, 20.432),
)

LLAMA31_70B = (
    Run(
        "60-llama-3-1-70b-tp4-general-lite",
        tuple(
            _llama31_stage("60-general", k, rate, 447, 9, 5, 8192, m)
            for k, (rate, m) in enumerate(zip((2.5, 6.0), _GENERAL, strict=True))
        ),
        30_251,
        _GENERAL,
    ),
    Run(
        "61-llama-3-1-70b-tp4-codegen",
        tuple(
            _llama31_stage("61-codegen", k, rate, 466, 11, 4, 2048, m)
            for k, (rate, m) in enumerate(zip((5.0, 10.0), _CODEGEN, strict=True))
        ),
        30_425,
        _CODEGEN,
    ),
)

OVERLOAD = Stage(
    experiment="20260218-065057-llama-2-70b-hf-tp4-reasoning",
    model="meta-llama/Llama-2-70b-hf",
    tp=4,
    stage="stage_0",
    rate_rps=4.0,
    duration_s=1200.0,
    prompt_tokens=1082.9,
    output_tokens=1441.9,
    system_prompt_tokens=100,
    groups=23,
    users_per_group=1,
    max_num_batched_tokens=2048,
    max_num_seqs=128,
    ttft_s=118.9958,
    e2e_s=161.7299,
    per_token_s=0.02966,
)
OVERLOAD_TIMEOUT_S = 300.0
OVERLOAD_MEASURED = {
    "within_timeout": 3200 / 4800,
    "ttft_mean": 118_995.8,
    "ttft_p90": 230_378.7,
    "e2e_mean": 161_729.9,
    "per_token": 29.66,
}
"""Of the requests that finished within the client's 300 s (ms), and the share that did."""


@dataclass(frozen=True)
class Row:
    name: str
    rate_rps: float
    measured: dict[str, float]
    simulated: dict[str, float]

    def as_dict(self) -> dict[str, object]:
        return {
            "stage": self.name,
            "rate_rps": self.rate_rps,
            "measured": self.measured,
            "simulated": self.simulated,
            "error": {k: self.simulated[k] / self.measured[k] - 1 for k in self.measured},
        }


def _instance(profile: InstanceProfile, stage: Stage, kv_blocks: int | None) -> Cluster:
    engine = replace(
        profile.engine,
        max_num_batched_tokens=stage.max_num_batched_tokens,
        max_num_seqs=stage.max_num_seqs,
        num_blocks=kv_blocks or profile.engine.num_blocks,
    )
    return Cluster.single(replace(profile, engine=engine), 1)


def _tails(records: Sequence[RequestRecord]) -> dict[str, float]:
    done = [r for r in records if r.outcome == "completed" and r.ttft_s is not None]
    ttft = np.array([r.ttft_s for r in done]) * 1e3
    e2e = np.array([r.e2e_s for r in done]) * 1e3
    output = float(np.mean([r.output_tokens for r in done]))
    return {
        "ttft_mean": float(ttft.mean()),
        "ttft_p90": float(np.percentile(ttft, 90)),
        "ttft_p99": float(np.percentile(ttft, 99)),
        "e2e_mean": float(e2e.mean()),
        "e2e_p90": float(np.percentile(e2e, 90)),
        "e2e_p99": float(np.percentile(e2e, 99)),
        "per_token": (float(e2e.mean()) - float(ttft.mean())) / (output - 1),
    }


def simulate_run(run: Run, profile: InstanceProfile, progress: bool = False) -> list[Row]:
    """The run's stages back to back on one instance, as measured; each stage's first
    tenth of requests is its warm-up."""
    requests, start = [], 0.0
    for stage in run.stages:
        arrivals = stage_workload(stage, stage.duration_s)
        requests.append([replace(r, arrival_s=r.arrival_s + start) for r in arrivals])
        start += stage.duration_s
    simulation = Simulation(
        _instance(profile, run.stages[0], run.kv_blocks), make_router("round_robin")
    )
    arrivals = [r for part in requests for r in part]
    records = {r.request_id: r for r in simulation.run(with_progress(arrivals, progress, run.name))}
    rows = []
    for stage, part, measured in zip(run.stages, requests, run.measured, strict=True):
        steady = [records[r.request_id] for r in part[int(len(part) * WARM_UP) :]]
        rows.append(Row(stage.name, stage.rate_rps, measured, _tails(steady)))
    return rows


def simulate_overload(profile: InstanceProfile, progress: bool = False) -> Row:
    stage = OVERLOAD
    simulation = Simulation(_instance(profile, stage, None), make_router("round_robin"))
    arrivals = stage_workload(stage, stage.duration_s)
    records = simulation.run(with_progress(arrivals, progress, stage.name))
    done = [r for r in records if r.outcome == "completed" and r.e2e_s is not None]
    within = [r for r in done if (r.e2e_s or 0.0) <= OVERLOAD_TIMEOUT_S]
    tails = _tails(within)
    simulated = {key: tails[key] for key in OVERLOAD_MEASURED if key in tails}
    simulated["within_timeout"] = len(within) / len(records)
    simulated["per_token"] = _tails(done)["per_token"]
    return Row(stage.name, stage.rate_rps, OVERLOAD_MEASURED, simulated)


def validate_regime(profile: InstanceProfile, progress: bool = False) -> list[Row]:
    """Every Llama-3.1-70B stage, then the overloaded run (``progress``: a bar for each
    run's arrivals, about 15 s each)."""
    rows = [row for run in LLAMA31_70B for row in simulate_run(run, profile, progress)]
    return [*rows, simulate_overload(profile, progress)]


def markdown_table(rows: Sequence[Row]) -> str:
    """Measured / simulated, and the error, of each figure a row has."""
    lines = [
        "| stage | rate (req/s) | figure | measured | simulated | error |",
        "|---|---:|---|---:|---:|---:|",
    ]
    for row in rows:
        for key, measured in row.measured.items():
            simulated = row.simulated[key]
            lines.append(
                f"| {row.name} | {row.rate_rps:g} | {key} | {_shown(key, measured)} | "
                f"{_shown(key, simulated)} | {simulated / measured - 1:+.1%} |"
            )
    return "\n".join(lines)


def _shown(key: str, value: float) -> str:
    if key == "within_timeout":
        return f"{value:.1%}"
    return f"{value:,.0f} ms" if value >= 1000 else f"{value:.1f} ms"

"""Fitting step-time coefficients to real vLLM measurements, by simulation.

Ground truth: ``sim/data/calibration/inference_perf_stages.csv``, the figures of real vLLM
runs on H100-SXM from the inference-sim training repository (inference-perf's
shared-prefix workload at constant rates; ``max_num_batched_tokens`` 2048,
``max_num_seqs`` 128; source and columns in that folder's README). Per-token time is
``(E2E - TTFT) / (output - 1)`` from the means, not the reported TPOT, which multi-token
chunks bias.

Which terms are fitted: the measured prompts are short (about 600 tokens), so the context
terms ``d`` (decode attention) and ``e`` (prefill attention) and the knee ``n0`` cannot be
identified from them. They come from physics instead, with the peak figures and MFUs of
BLIS's ``hardware_config.json`` (H100: 989.5 TFLOP/s, 3.35 TB/s, MFU 0.45 prefill):

- ``d`` = KV bytes per token / (TP x bandwidth): reading one context token's K and V;
- ``e`` = 4 x layers x hidden / (TP x FLOP/s x MFU): one prefill token attending to one
  context token (QK^T and AV);
- ``n0`` = the ridge point, weight-read time / per-token compute time, is only the start:
  real bandwidth and MFU move the knee, so it is fitted with the rest.

``a`` (per step), ``b`` (per token past the knee), ``n0``, ``c`` (per decode sequence) and
the API overhead on TTFT are fitted by Nelder-Mead on the relative errors of simulated
TTFT, E2E and per-token time against the training stages; the other stages are held out.
"""

from __future__ import annotations

import csv
import math
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from control.routing import make_router
from control.step_time import KneeRoofline
from sim.cluster import Cluster, InstanceProfile
from sim.simulator import Simulation
from sim.workload import ENGINE_BLOCK_TOKENS, TraceRequest

WINDOW_S = 300.0
"""Simulated seconds per stage, in the fit and in validation alike: long enough that a model
slightly past capacity shows its growing queue (60 s hid one)."""


@dataclass(frozen=True)
class Stage:
    """One measured stage: a constant request rate for a duration, and what was seen."""

    experiment: str
    model: str
    tp: int
    stage: str
    rate_rps: float
    duration_s: float
    prompt_tokens: float
    output_tokens: float
    system_prompt_tokens: int
    groups: int
    users_per_group: int
    max_num_batched_tokens: int
    max_num_seqs: int
    ttft_s: float
    e2e_s: float
    per_token_s: float

    @property
    def name(self) -> str:
        return f"{self.experiment.split('-', 2)[2]}/{self.stage}"


STAGES_FILE = "inference_perf_stages.csv"
"""The measured stages' table, in ``calibration_dir()`` (``sim/data/calibration/README.md``)."""


def calibration_dir() -> Path:
    """``$TOKENFLEET_CALIBRATION``, else the measured figures this repository carries."""
    configured = os.environ.get("TOKENFLEET_CALIBRATION")
    if configured:
        return Path(configured)
    return Path(__file__).resolve().parent / "data" / "calibration"


def load_stages(path: str | None = None) -> list[Stage]:
    """The measured stages without failures (overloaded runs are not a latency sample);
    ValueError naming the row for one that is not a stage's figures."""
    path = path or str(calibration_dir() / STAGES_FILE)
    stages = []
    with open(path) as rows:
        for line, row in enumerate(csv.DictReader(rows), start=2):
            try:
                if int(row["n_failures"]) == 0:
                    stages.append(_stage(row))
            except (KeyError, ValueError, TypeError) as exc:  # TypeError: a short row's None
                why = f"{type(exc).__name__}: {exc}"
                raise ValueError(f"{path}, line {line}: not a measured stage ({why})") from None
    return stages


_ABOVE_ZERO = (
    "tp",
    "rate_rps",
    "duration_s",
    "prompt_len_mean",
    "output_len_mean",
    "num_unique_system_prompts",
    "num_users_per_system_prompt",
    "max_num_batched_tokens",
    "max_num_seqs",
)
_ZERO_OR_MORE = ("system_prompt_len", "ttft_mean_ms", "e2e_mean_ms", "per_token_time_from_e2e_ms")
"""A stage's figures and their ranges: outside them a stage's simulation divided by zero,
recursed without end or printed a negative rate."""


def _stage(row: dict[str, str]) -> Stage:
    for column in _ABOVE_ZERO + _ZERO_OR_MORE:
        value, above = float(row[column]), column in _ABOVE_ZERO
        if not (math.isfinite(value) and (value > 0 if above else value >= 0)):
            wanted = "above 0" if above else "0 or more"
            raise ValueError(f"{column} must be a finite number {wanted}, not {row[column]}")
    return Stage(
        row["experiment"],
        row["model"],
        int(row["tp"]),
        row["stage"],
        float(row["rate_rps"]),
        float(row["duration_s"]),
        float(row["prompt_len_mean"]),
        float(row["output_len_mean"]),
        int(row["system_prompt_len"]),
        int(row["num_unique_system_prompts"]),
        int(row["num_users_per_system_prompt"]),
        int(row["max_num_batched_tokens"]),
        int(row["max_num_seqs"]),
        float(row["ttft_mean_ms"]) / 1e3,
        float(row["e2e_mean_ms"]) / 1e3,
        float(row["per_token_time_from_e2e_ms"]) / 1e3,
    )


def stage_workload(stage: Stage, seconds: float) -> list[TraceRequest]:
    """Constant arrivals at the stage's rate; each request is its group's system prompt
    (shared, so cached after the first) and a question of its own."""
    count = max(1, int(stage.rate_rps * seconds))
    system_blocks = stage.system_prompt_tokens // ENGINE_BLOCK_TOKENS
    prompt = round(stage.prompt_tokens)
    output = max(2, round(stage.output_tokens))
    requests = []
    for n in range(count):
        group = n % stage.groups
        prefix = tuple(
            hash(("system", stage.experiment, group, b)) & (2**63 - 1) for b in range(system_blocks)
        )
        requests.append(
            TraceRequest(f"{stage.name}-{n}", n / stage.rate_rps, prompt, output, prefix)
        )
    return requests


@dataclass(frozen=True)
class Predicted:
    ttft_s: float
    e2e_s: float
    per_token_s: float


def simulate_stage(stage: Stage, profile: InstanceProfile, seconds: float = WINDOW_S) -> Predicted:
    """Mean TTFT, E2E and per-token time of one instance serving the stage's workload.

    The first 10 % of the requests are a warm-up and left out of the means.
    """
    engine = replace(
        profile.engine,
        max_num_batched_tokens=stage.max_num_batched_tokens,
        max_num_seqs=stage.max_num_seqs,
    )
    simulation = Simulation(
        Cluster.single(replace(profile, engine=engine), 1), make_router("round_robin")
    )
    records = simulation.run(stage_workload(stage, seconds))
    records.sort(key=lambda r: r.arrival_s)
    steady = [r for r in records[len(records) // 10 :] if r.outcome == "completed"]
    ttft = float(np.mean([r.ttft_s for r in steady]))
    e2e = float(np.mean([r.e2e_s for r in steady]))
    output = float(np.mean([r.output_tokens for r in steady]))
    return Predicted(ttft, e2e, (e2e - ttft) / (output - 1))


def relative_errors(stage: Stage, predicted: Predicted) -> tuple[float, float, float]:
    return (
        predicted.ttft_s / stage.ttft_s - 1,
        predicted.e2e_s / stage.e2e_s - 1,
        predicted.per_token_s / stage.per_token_s - 1,
    )


FITTED = ("a_s", "b_s_per_token", "n0_tokens", "c_s_per_seq", "ttft_overhead_s")


def fit(
    stages: Sequence[Stage],
    profile: InstanceProfile,
    *,
    seconds: float = WINDOW_S,
    iterations: int = 120,
    progress: Callable[[int, float], None] | None = None,
) -> KneeRoofline:
    """Fit ``FITTED`` to ``stages`` in log space, starting from the profile's values."""
    start = profile.step_time
    assert isinstance(start, KneeRoofline)

    def candidate(log_values: np.ndarray) -> KneeRoofline:
        values = (float(v) for v in np.exp(log_values))
        return replace(start, **dict(zip(FITTED, values, strict=True)))

    def loss(log_values: np.ndarray) -> float:
        trial = replace(profile, step_time=candidate(log_values))
        errors = [relative_errors(s, simulate_stage(s, trial, seconds)) for s in stages]
        return float(np.mean(np.square(errors)))

    initial = np.log([getattr(start, name) for name in FITTED])
    best = nelder_mead(loss, initial, iterations=iterations, progress=progress)
    return candidate(best)


def nelder_mead(
    loss: Callable[[np.ndarray], float],
    initial: np.ndarray,
    *,
    step: float = 0.3,
    iterations: int = 120,
    progress: Callable[[int, float], None] | None = None,
) -> np.ndarray:
    """Minimise ``loss`` from ``initial`` with the Nelder-Mead simplex (standard factors)."""
    simplex = [initial] + [initial + step * np.eye(len(initial))[i] for i in range(len(initial))]
    values = [loss(point) for point in simplex]
    for iteration in range(iterations):
        order = np.argsort(values)
        simplex, values = [simplex[i] for i in order], [values[i] for i in order]
        if progress:
            progress(iteration, values[0])
        centroid = np.mean(simplex[:-1], axis=0)
        reflected = centroid + (centroid - simplex[-1])
        reflected_value = loss(reflected)
        if reflected_value < values[0]:
            expanded = centroid + 2 * (centroid - simplex[-1])
            expanded_value = loss(expanded)
            if expanded_value < reflected_value:
                simplex[-1], values[-1] = expanded, expanded_value
            else:
                simplex[-1], values[-1] = reflected, reflected_value
        elif reflected_value < values[-2]:
            simplex[-1], values[-1] = reflected, reflected_value
        else:
            contracted = centroid + 0.5 * (simplex[-1] - centroid)
            contracted_value = loss(contracted)
            if contracted_value < values[-1]:
                simplex[-1], values[-1] = contracted, contracted_value
            else:
                simplex = [simplex[0] + 0.5 * (p - simplex[0]) for p in simplex]
                values = [values[0]] + [loss(p) for p in simplex[1:]]
    best: np.ndarray = simplex[int(np.argmin(values))]
    return best


@dataclass(frozen=True)
class ValidationRow:
    stage: Stage
    split: str
    """``fit`` or ``held out``."""
    predicted: Predicted

    def as_dict(self) -> dict[str, object]:
        ttft, e2e, per_token = relative_errors(self.stage, self.predicted)
        return {
            "stage": self.stage.name,
            "split": self.split,
            "rate_rps": self.stage.rate_rps,
            "ttft_measured_s": self.stage.ttft_s,
            "ttft_simulated_s": self.predicted.ttft_s,
            "ttft_error": ttft,
            "e2e_measured_s": self.stage.e2e_s,
            "e2e_simulated_s": self.predicted.e2e_s,
            "e2e_error": e2e,
            "per_token_measured_s": self.stage.per_token_s,
            "per_token_simulated_s": self.predicted.per_token_s,
            "per_token_error": per_token,
        }


def validate(
    stages: Iterable[Stage],
    training: Sequence[str],
    profile: InstanceProfile,
    seconds: float = WINDOW_S,
) -> list[ValidationRow]:
    return [
        ValidationRow(
            s,
            "fit" if is_training(s, training) else "held out",
            simulate_stage(s, profile, seconds),
        )
        for s in stages
    ]


def is_training(stage: Stage, training: Sequence[str]) -> bool:
    return any(stage.name.endswith(name) for name in training)


def markdown_table(rows: Sequence[ValidationRow]) -> str:
    lines = [
        "| stage | split | rate (req/s) | TTFT measured / simulated (ms) | error | "
        "E2E measured / simulated (s) | error | per-token measured / simulated (ms) | error |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        s, p = row.stage, row.predicted
        ttft, e2e, per_token = relative_errors(s, p)
        lines.append(
            f"| {s.name} | {row.split} | {s.rate_rps:g} | {s.ttft_s * 1e3:.1f} / "
            f"{p.ttft_s * 1e3:.1f} | {ttft:+.1%} | {s.e2e_s:.2f} / {p.e2e_s:.2f} | {e2e:+.1%} | "
            f"{s.per_token_s * 1e3:.2f} / {p.per_token_s * 1e3:.2f} | {per_token:+.1%} |"
        )
    return "\n".join(lines)

from __future__ import annotations

import os

import numpy as np
import pytest

from sim.calibration import (
    calibration_dir,
    is_training,
    load_stages,
    nelder_mead,
    stage_workload,
)
from sim.hardware import H100
from sim.profiles import CALIBRATED, LLAMA_70B, TRAINING_STAGES

needs_measurements = pytest.mark.skipif(
    not (calibration_dir() / "derived").is_dir() and os.environ.get("CI") != "true",
    reason="the calibration measurements are not in the repository (no licence upstream): "
    "set TOKENFLEET_CALIBRATION to a copy (CI has one, and fails without it)",
)


def test_nelder_mead_finds_the_minimum_of_a_bowl() -> None:
    target = np.array([1.0, -2.0, 0.5])
    best = nelder_mead(lambda x: float(np.sum((x - target) ** 2)), np.zeros(3), iterations=200)
    np.testing.assert_allclose(best, target, atol=1e-3)


def test_physics_terms_of_a_70b_model_on_four_h100() -> None:
    assert LLAMA_70B.kv_bytes_per_token == 2 * 80 * 8 * 128 * 2
    physics = LLAMA_70B.physics(H100, tp=4)
    # one context token's K and V over four GPUs' bandwidth
    assert physics["d_s_per_context_token"] == pytest.approx(327_680 / (4 * 3.35e12))
    # weight read (138 GB over 13.4 TB/s) over per-token compute (138 GFLOP at 45 % MFU)
    assert physics["n0_tokens"] == pytest.approx(
        (69e9 * 2 / (4 * 3.35e12)) / (2 * 69e9 / (4 * 989.5e12 * 0.45))
    )


@needs_measurements
def test_stages_with_failures_and_summaries_are_left_out() -> None:
    stages = load_stages()
    assert stages
    assert not any("reasoning" in s.experiment for s in stages)  # overloaded, with failures
    assert {s.stage for s in stages} <= {"stage_0", "stage_1"}
    for calibrated in CALIBRATED.values():
        mine = [s for s in stages if calibrated.measured_model in s.experiment]
        training = [s for s in mine if is_training(s, TRAINING_STAGES)]
        assert len(training) == 3
        assert len(mine) > len(training), "every profile keeps held-out stages"


@needs_measurements
def test_a_stage_workload_shares_each_group_s_system_prompt() -> None:
    stage = next(s for s in load_stages() if "70b" in s.experiment)
    requests = stage_workload(stage, seconds=10)
    assert len(requests) == int(stage.rate_rps * 10)
    gaps = np.diff([r.arrival_s for r in requests])
    np.testing.assert_allclose(gaps, 1 / stage.rate_rps)
    first, same_group = requests[0], requests[stage.groups]
    assert first.prefix_blocks == same_group.prefix_blocks
    assert first.prefix_blocks != requests[1].prefix_blocks
    assert len(first.prefix_blocks) == stage.system_prompt_tokens // 16

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest

from sim.calibration import (
    STAGES_FILE,
    calibration_dir,
    is_training,
    load_stages,
    nelder_mead,
    stage_workload,
)
from sim.hardware import H100
from sim.profiles import CALIBRATED, LLAMA_70B, TRAINING_STAGES


def test_the_carried_measurements_are_the_recorded_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    """The figures under ``sim/data/calibration`` match their checksum, and the loader reads
    them from there unless told otherwise."""
    root = Path(__file__).parents[2] / "sim" / "data" / "calibration"
    digest, name = (root / "SHA256SUMS").read_text().split()
    assert name == STAGES_FILE
    assert hashlib.sha256((root / name).read_bytes()).hexdigest() == digest
    monkeypatch.delenv("TOKENFLEET_CALIBRATION", raising=False)
    assert calibration_dir().resolve() == root.resolve()


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


def test_stages_with_failures_are_left_out() -> None:
    stages = load_stages()
    assert stages
    assert not any("reasoning" in s.experiment for s in stages)  # overloaded, with failures
    assert {s.stage for s in stages} <= {"stage_0", "stage_1"}
    for calibrated in CALIBRATED.values():
        mine = [s for s in stages if calibrated.measured_model in s.experiment]
        training = [s for s in mine if is_training(s, TRAINING_STAGES)]
        assert len(training) == 3
        assert len(mine) > len(training), "every profile keeps held-out stages"


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


def test_a_row_that_is_not_a_stage_s_figures_is_named(tmp_path: Path) -> None:
    carried = Path(__file__).parents[2] / "sim" / "data" / "calibration" / STAGES_FILE
    header, first = carried.read_text().splitlines()[:2]
    summary = first.replace(",stage_0,5,600,", ",summary,,,")  # a whole-run row, no rate
    (tmp_path / STAGES_FILE).write_text("\n".join([header, first, summary]) + "\n")
    with pytest.raises(ValueError, match=r"line 3: not a measured stage"):
        load_stages(str(tmp_path / STAGES_FILE))


@pytest.mark.parametrize(
    ("column", "value", "message"),
    [
        ("rate_rps", "0", "rate_rps must be a finite number above 0, not 0"),  # ZeroDivisionError
        ("rate_rps", "-5", "rate_rps must be a finite number above 0, not -5"),  # a rate of -5
        ("rate_rps", "nan", "rate_rps must be a finite number above 0, not nan"),
        ("prompt_len_mean", "-5", "prompt_len_mean must be"),  # KeyError
        ("max_num_seqs", "0", "max_num_seqs must be"),  # RecursionError
        ("ttft_mean_ms", "inf", "ttft_mean_ms must be a finite number 0 or more, not inf"),
    ],
)
def test_a_stage_s_figure_out_of_range_is_named(
    tmp_path: Path, column: str, value: str, message: str
) -> None:
    carried = Path(__file__).parents[2] / "sim" / "data" / "calibration" / STAGES_FILE
    header, first = carried.read_text().splitlines()[:2]
    cells = dict(zip(header.split(","), first.split(","), strict=True)) | {column: value}
    (tmp_path / STAGES_FILE).write_text("\n".join([header, ",".join(cells.values())]) + "\n")
    with pytest.raises(ValueError, match=r"line 2: not a measured stage \(ValueError: ") as bad:
        load_stages(str(tmp_path / STAGES_FILE))
    assert message in str(bad.value)


def test_a_row_cut_short_is_named(tmp_path: Path) -> None:
    """Its missing cells read as None: float(None) raised a TypeError, with a traceback."""
    carried = Path(__file__).parents[2] / "sim" / "data" / "calibration" / STAGES_FILE
    header, first = carried.read_text().splitlines()[:2]
    short = ",".join(first.split(",")[:8])
    (tmp_path / STAGES_FILE).write_text("\n".join([header, short]) + "\n")
    with pytest.raises(ValueError, match=r"line 2: not a measured stage \(TypeError: "):
        load_stages(str(tmp_path / STAGES_FILE))

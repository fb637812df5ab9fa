"""The validation table of docs/validation.md ("Where the benchmarks run"), pinned: a change
to the engine or the step model that moves a simulated figure fails here, and the table
and docs/results/validation-70b.json are made again with ``tokenfleet validate --json``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sim import validation
from sim.profiles import PROFILES

PINNED = Path(__file__).resolve().parents[2] / "docs" / "results" / "validation-70b.json"


@pytest.fixture(scope="module")
def rows() -> list[validation.Row]:
    return validation.validate_regime(PROFILES[validation.PROFILE])


def test_the_simulated_figures_are_those_the_docs_show(rows: list[validation.Row]) -> None:
    pinned = json.loads(PINNED.read_text())
    assert pinned["profile"] == validation.PROFILE
    assert [row["stage"] for row in pinned["rows"]] == [row.name for row in rows]
    for row, kept in zip(rows, pinned["rows"], strict=True):
        assert row.measured == kept["measured"]
        assert row.simulated == pytest.approx(kept["simulated"], rel=1e-9), row.name


def test_the_table_holds_each_stage_and_the_overloaded_run(rows: list[validation.Row]) -> None:
    """Four Llama-3.1-70B stages and the overloaded run, whose queue shows in its TTFT."""
    assert len(rows) == 5
    overload = rows[-1]
    assert overload.simulated["ttft_mean"] > 100 * rows[0].simulated["ttft_mean"]
    assert 0 < overload.simulated["within_timeout"] <= 1


def test_the_mean_output_length_follows_from_the_records_own_per_token_definition() -> None:
    stage = validation.LLAMA31_70B[0].stages[0]
    per_token = (stage.e2e_s - stage.ttft_s) / (stage.output_tokens - 1)
    assert per_token == pytest.approx(stage.per_token_s)
    assert 240 < stage.output_tokens < 248  # the workload asked for 248

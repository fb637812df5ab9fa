"""What the command line makes of the environment: a misspelt setting is named, a traces
folder that is not there is a message."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tokenfleet.cli import main


def test_a_misspelt_setting_is_named_with_the_one_meant(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for name in [n for n in os.environ if n.startswith("TOKENFLEET_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("TOKENFLEET_GATEWAY_ADMISION", "fcfs")
    monkeypatch.setenv("TOKENFLEET_WORKER_WINDOW_S", "30")  # known: no warning
    monkeypatch.setenv("TOKENFLEET_TRACES", str(Path(__file__).parents[2] / "sim/data/traces"))
    assert main(["workload", "list"]) == 0
    warnings = capsys.readouterr().err.splitlines()
    assert warnings == [
        "tokenfleet: warning: TOKENFLEET_GATEWAY_ADMISION is not a setting TokenFleet reads, "
        "ignored (did you mean TOKENFLEET_GATEWAY_ADMISSION?)"
    ]


@pytest.mark.parametrize(
    ("trace", "folder"),
    [
        ("mooncake", "mooncake_fast25/"),
        # a folder that is not there globbed to no client: an empty trace, exit 0
        ("servegen", "servegen/reason/deepseek-r1/chunk-*-trace.csv"),
    ],
)
def test_a_traces_folder_that_is_not_there_is_named_with_exit_2(
    trace: str,
    folder: str,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("TOKENFLEET_TRACES", str(tmp_path / "none"))
    assert main(["sim", "--trace", trace, "--instances", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"tokenfleet: trace {trace}: {tmp_path}/none/{folder}")
    assert "TOKENFLEET_TRACES" in err

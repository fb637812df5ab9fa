"""Progress bars are drawn on a terminal only: on a log file or in CI their carriage
returns run every update into one garbled line."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from sim.progress import progress_bar

ROOT = Path(__file__).parents[2]


def test_no_bar_is_drawn_where_stderr_is_no_terminal(capsys: pytest.CaptureFixture[str]) -> None:
    assert list(progress_bar(range(3), desc="items")) == [0, 1, 2]
    with progress_bar(total=2, desc="runs") as bar:
        bar.update(2)
    assert capsys.readouterr().err == ""


def test_every_bar_of_the_project_goes_through_sim_progress() -> None:
    direct = [
        f"{path.relative_to(ROOT)}:{n}"
        for folder in ("sim", "tokenfleet", "control", "streams", "gateway")
        for path in (ROOT / folder).rglob("*.py")
        if path.name != "progress.py"
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if re.search(r"\btqdm\b", line)
    ]
    assert direct == []

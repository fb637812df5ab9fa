"""The embedded main job: the whole stack against the baseline stack, on the same
arrivals, with a live view, a report and its files."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

from tokenfleet.cli import build_parser
from tokenfleet.demo import INSTANCES_PER_DC, again, report, run_demo, write_demo


def test_the_demo_runs_both_stacks_on_the_same_arrivals_and_writes_its_report(
    tmp_path: Path,
) -> None:
    said: list[str] = []
    document = run_demo(seed=0, instances_per_dc=1, say=said.append)
    write_demo(document, tmp_path)
    ours, theirs = document["policies"]["tokenfleet"], document["policies"]["baseline"]
    assert ours["arrivals"] > 1000
    assert theirs["cross_dc_share"] == 0.0  # the baseline keeps every request at home
    assert ours["cross_dc_share"] > 0.0  # FleetMind moved some of the hotspot
    assert ours["residency_violations"] == ours["permission_violations"] == 0
    live = [line for line in said if line.startswith("t=")]
    assert len(live) >= 10  # every 30 s over a 360 s scenario and its drain
    assert all("dc-b" in line and "dc-d" in line for line in live)
    # per second of the arrivals' span, as the report counts: it divided by the time so
    # far, drain included, and its last line showed 8 % less than the report
    last = float(live[-1].split("goodput so far ")[1].split(" tok/s")[0].replace(",", ""))
    assert abs(last / ours["goodput_tok_s"] - 1) < 0.01
    assert json.loads((tmp_path / "demo.json").read_text())["policies"].keys() == {
        "tokenfleet",
        "baseline",
    }
    assert (tmp_path / "demo.png").stat().st_size > 10_000
    lines = report(document)
    assert lines[-1].startswith("TokenFleet's goodput is")


def test_the_command_it_prints_to_run_it_again_runs_the_same_demo() -> None:
    """It left out --instances-per-dc: run again, a smaller fleet came out as the default."""
    for size, out in ((1, Path("d")), (INSTANCES_PER_DC, Path("my runs/d"))):
        argv = shlex.split(again(3, size, out))[1:]
        args = build_parser().parse_args(argv)
        assert (args.seed, args.instances_per_dc, args.out) == (3, size, out)

"""Ports given on the command line: refused before anything starts where they cannot
work, and port 0, where a command takes it, a free port that the command prints."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tokenfleet.cli import build_parser, main

ROOT = Path(__file__).parents[2]


def _printed_ports(argv: list[str], lines: int) -> list[int]:
    """The ports of the first ``lines`` URLs a long-running command prints; it is then
    stopped."""
    with subprocess.Popen(
        [sys.executable, "-m", "tokenfleet.cli", *argv],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    ) as process:
        try:
            assert process.stdout is not None
            printed = [process.stdout.readline() for _ in range(lines)]
        finally:
            process.terminate()
    return [int(re.findall(r"127\.0\.0\.1:(\d+)/v1", line)[0]) for line in printed]


def test_emulated_instances_past_port_65535_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["emulate", "--base-port", "65535", "--instances", "2"]) == 2
    assert "--base-port 65535: 2 ports from it run to 65536, past 65535" in capsys.readouterr().err


def test_base_port_0_gives_each_instance_a_free_port_of_its_own() -> None:
    ports = _printed_ports(["emulate", "--base-port", "0", "--instances", "2"], 2)
    assert len(set(ports)) == 2
    assert all(port > 1024 for port in ports)


def test_a_gateway_on_port_0_prints_the_port_it_got() -> None:
    fleet = str(ROOT / "examples" / "fleet.toml")
    [port] = _printed_ports(["gateway", "--fleet", fleet, "--port", "0"], 1)
    assert port > 0


@pytest.mark.parametrize(
    "option", ["--gateway-port", "--controller-port", "--worker-port", "--collector-port"]
)
def test_up_refuses_port_0_whose_address_it_must_know(
    option: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as refused:
        build_parser().parse_args(["up", option, "0"])
    assert refused.value.code == 2
    assert "give a port from 1 to 65535" in capsys.readouterr().err


def test_up_refuses_gateway_ports_past_65535_before_starting_anything(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fleet = str(ROOT / "examples" / "fleet-local.toml")  # three DCs: three gateways
    argv = ["up", "--fleet", fleet, "--home", str(tmp_path), "--gateway-port", "65534"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "--gateway-port 65534: 3 ports from it run to 65536" in err
    # no Kafka, no Redis, no part started: only the lock ``up`` held on the folder
    assert {path.name for path in tmp_path.iterdir()} <= {"up.lock"}

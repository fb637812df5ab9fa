"""The example local fleet on ports free here, for tests that run ``tokenfleet up`` or
its plan: ``up`` refuses a port another server holds before it starts anything, so on
the example's own ports such a test would depend on what else runs on the machine."""

from __future__ import annotations

import re
from pathlib import Path

from tokenfleet.services.process import free_ports

LOCAL_FLEET = Path(__file__).parents[1] / "examples" / "fleet-local.toml"


def fleet_on_free_ports(path: Path) -> Path:
    """The local fleet file, written to ``path``, with its instances on ports free here."""
    text = LOCAL_FLEET.read_text()
    ports = sorted(set(re.findall(r"127\.0\.0\.1:(\d+)", text)))
    base = free_ports(len(ports))
    for n, port in enumerate(ports):
        text = text.replace(f"127.0.0.1:{port}", f"127.0.0.1:{base + n}")
    path.write_text(text)
    return path


def parts_ports() -> dict[str, int]:
    """Ports free here for the parts other than the emulators, as ``plan`` takes them (a
    gateway per DC from ``gateway_port`` on)."""
    ports = {"gateway_port": free_ports(3), "controller_port": free_ports(1)}
    return ports | {"worker_port": free_ports(1), "collector_port": free_ports(1)}


def up_on_free_ports(folder: Path) -> list[str]:
    """``tokenfleet up``'s options for the local fleet with every port free here (its
    fleet file written in ``folder``)."""
    options = ["--fleet", str(fleet_on_free_ports(folder / "fleet.toml"))]
    for name, port in parts_ports().items():
        options += [f"--{name.replace('_', '-')}", str(port)]
    return options

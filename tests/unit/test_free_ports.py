"""Ports for local servers: free when chosen, and out of the kernel's way."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from tokenfleet.services import process
from tokenfleet.services.process import free_ports


@pytest.fixture(autouse=True)
def nothing_handed_out(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(process, "_HANDED_OUT", set())


def test_consecutive_ports_are_free_and_below_the_ephemeral_range(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Outgoing connections take their local ports from the ephemeral range, so a port
    drawn from it can be gone by the time the server binds it."""
    ephemeral = tmp_path / "ip_local_port_range"
    ephemeral.write_text("32768\t60999\n")
    monkeypatch.setattr(process, "EPHEMERAL_RANGE", ephemeral)
    for _ in range(20):
        base = free_ports(3)
        assert base >= process.LOWEST_PORT
        assert base + 2 < 32768
        for port in range(base, base + 3):
            with socket.socket() as s:
                s.bind(("127.0.0.1", port))


def test_a_base_with_a_taken_port_is_passed_over(monkeypatch: pytest.MonkeyPatch) -> None:
    free = free_ports(2)
    process._HANDED_OUT.clear()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        candidates = iter([taken.getsockname()[1] - 1, free])
        monkeypatch.setattr(process, "_candidate", lambda count: next(candidates))
        assert free_ports(2) == free


def test_without_the_kernel_s_range_the_kernel_picks(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(process, "EPHEMERAL_RANGE", tmp_path / "absent")
    monkeypatch.setattr(process, "_RANDOM", None)  # drawing at random would fail
    base = free_ports(2)
    with socket.socket() as s:
        s.bind(("127.0.0.1", base + 1))


def test_a_port_handed_out_is_not_handed_out_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """Until its server binds it, a port handed out is free to anyone who checks."""
    first = free_ports(3)
    candidates = iter([first + 2, first + 3, 65534])
    monkeypatch.setattr(process, "_candidate", lambda count: next(candidates, first + 10))
    second = free_ports(3)
    assert second not in {first + 2, 65534}  # overlaps the first, or runs past 65535
    assert second == first + 3 or second == first + 10

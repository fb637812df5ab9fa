"""Ctrl-C, SIGTERM and SIGHUP stop a command with a one-line message and exit 130, 143
and 129 (128 and the signal's number, as a shell reports it), after the cleanup that
stops its children has run (a SIGHUP that nohup ignores stays ignored); a command run
from another thread than the main one (as tests do) leaves the signal handlers alone."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tokenfleet.cli import main

ROOT = Path(__file__).parents[2]

# tokenfleet bench gateway, its benchmark replaced by one that starts a child as the real
# one starts its emulators and gateways (http_service) and then runs until stopped.
BENCH_WITH_A_CHILD = """
import sys, time
from pathlib import Path
from tokenfleet import gateway_bench
from tokenfleet.cli import main
from tokenfleet.services.process import free_port, http_service

def bench(*args, **kwargs):
    port = free_port()
    argv = [sys.executable, "-m", "http.server", "--bind", "127.0.0.1", str(port)]
    with http_service(Path(sys.argv[1]), argv, f"http://127.0.0.1:{port}", health="/"):
        print("ready", flush=True)
        time.sleep(600)

gateway_bench.bench_gateway = bench
sys.exit(main(["bench", "gateway", "--no-litellm", "--no-redis", "--json", sys.argv[2]]))
"""


@contextlib.contextmanager
def _ready_bench(tmp_path: Path, hangup: signal.Handlers) -> Iterator[subprocess.Popen[str]]:
    """``BENCH_WITH_A_CHILD``, with SIGHUP's disposition ``hangup``, once its child runs."""
    argv = [sys.executable, "-c", BENCH_WITH_A_CHILD, str(tmp_path), str(tmp_path / "b.json")]
    with subprocess.Popen(
        argv,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGHUP, hangup),
    ) as bench:
        assert bench.stdout is not None
        assert bench.stdout.readline() == "ready\n"
        yield bench


def _ended(process: subprocess.Popen[str]) -> tuple[str, str]:
    """Its output once it has ended; killed where it has not within 60 s (the ``with``
    around it would wait for good, and the suite with it)."""
    try:
        return process.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        process.kill()
        process.communicate()
        raise


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.parametrize(
    ("stop", "code", "said"),
    [
        (signal.SIGTERM, 143, "terminated"),
        (signal.SIGINT, 130, "interrupted"),
        # the terminal closed (an SSH session dropped): up was killed halfway, its parts
        # left running
        (signal.SIGHUP, 129, "hung up"),
    ],
)
def test_a_stopped_bench_stops_its_children_and_exits_as_a_shell_says(
    stop: signal.Signals, code: int, said: str, tmp_path: Path
) -> None:
    # as a terminal's shell runs it: under nohup (a suite run so) SIGHUP is ignored
    with _ready_bench(tmp_path, hangup=signal.SIG_DFL) as bench:
        child = int((tmp_path / "pid").read_text().split()[0])
        bench.send_signal(stop)
        _, err = _ended(bench)
    assert bench.returncode == code
    assert err.strip().splitlines()[-1] == f"tokenfleet: {said}"
    assert "Traceback" not in err
    for _ in range(50):  # reaped by the bench; a moment for the kernel to say so
        if not _alive(child):
            break
        time.sleep(0.1)
    assert not _alive(child)


def test_a_hangup_that_nohup_ignores_stays_ignored(tmp_path: Path) -> None:
    with _ready_bench(tmp_path, hangup=signal.SIG_IGN) as bench:  # as nohup runs it
        bench.send_signal(signal.SIGHUP)
        with pytest.raises(subprocess.TimeoutExpired):
            bench.wait(timeout=1)  # still running
        bench.send_signal(signal.SIGTERM)
        _, err = _ended(bench)
    assert bench.returncode == 143
    assert err.strip().splitlines()[-1] == "tokenfleet: terminated"


async def test_a_command_run_from_another_thread_runs() -> None:
    """Setting a signal handler there raised ValueError: only the main thread may."""
    assert await asyncio.to_thread(main, ["workload", "list"]) == 0

"""Worker processes for simulated runs, left early."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from concurrent.futures import Future, wait
from pathlib import Path
from typing import Any

import pytest

from sim.workers import worker_processes


def test_a_pool_left_early_cancels_the_queued_runs_and_stops_its_workers() -> None:
    """The pool's own exit waited for every queued run: a sweep stopped by SIGTERM went
    on for minutes."""
    seen: dict[str, Any] = {}
    with pytest.raises(KeyboardInterrupt):
        _sweep_stopped_by_ctrl_c(_sleep_a_minute, None, seen)
    _assert_stopped(seen["workers"])
    queued: Future[None] = seen["queued"]
    wait([queued], timeout=10)
    assert queued.done()
    assert queued.cancelled() or queued.exception() is not None  # never run


def test_a_worker_that_outlives_sigterm_is_killed(tmp_path: Path) -> None:
    """CI (stop 54) found a worker alive 10 s after SIGTERM, for a cause not shown: one
    that SIGTERM leaves running is killed."""
    started = tmp_path / "ignoring-sigterm"
    seen: dict[str, Any] = {}
    with pytest.raises(KeyboardInterrupt):
        _sweep_stopped_by_ctrl_c(_ignore_sigterm_and_sleep, started, seen)
    _assert_stopped(seen["workers"])


def _sleep_a_minute(started: Path | None) -> None:
    time.sleep(60)


def _ignore_sigterm_and_sleep(started: Path | None) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    assert started is not None
    started.touch()
    time.sleep(60)


def _sweep_stopped_by_ctrl_c(
    run: Callable[[Path | None], None], started: Path | None, seen: dict[str, Any]
) -> None:
    """Two runs of a minute on one worker, stopped once the first has started (once
    ``started`` exists, where given)."""
    with worker_processes(1, 2) as pool:
        running = pool.submit(run, started)
        seen["queued"] = pool.submit(run, started)
        deadline = time.monotonic() + 30
        while not running.running() or (started is not None and not started.exists()):
            assert not running.done()  # it ended without starting: failed
            assert time.monotonic() < deadline
            time.sleep(0.01)
        # the pool's own: active_children() would also name any process an earlier test
        # left stopping, which this test would then wait on
        seen["workers"] = list(pool._processes.values())
        raise KeyboardInterrupt


def _assert_stopped(workers: list[Any]) -> None:
    """Each worker gone within 10 s, not left to sleep its minute. Read from its exit code,
    polled: the pool's own thread joins the workers too, and where it reaps one between
    this thread's wait and its ``waitpid`` (ECHILD), ``is_alive()`` answers True for a
    process already gone (CI at ad44ef4: a worker "alive" after ``join(10)``, shown
    stopped by SIGTERM a moment later)."""
    deadline = time.monotonic() + 10
    for worker in workers:
        while worker.exitcode is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert worker.exitcode is not None


def test_a_pool_starts_no_more_workers_than_runs() -> None:
    """Under fork the pool starts every worker at once: ``--jobs 40`` for one run forked
    40 processes."""
    with worker_processes(40, 2) as pool:
        assert pool._max_workers == 2  # the standard library has no public way

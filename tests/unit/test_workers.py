"""Worker processes for simulated runs, left early."""

from __future__ import annotations

import time
from concurrent.futures import Future, wait
from typing import Any

import pytest

from sim.workers import worker_processes


def test_a_pool_left_early_cancels_the_queued_runs_and_stops_its_workers() -> None:
    """The pool's own exit waited for every queued run: a sweep stopped by SIGTERM went
    on for minutes."""
    seen: dict[str, Any] = {}
    with pytest.raises(KeyboardInterrupt):
        _sweep_stopped_by_ctrl_c(seen)
    for worker in seen["workers"]:
        worker.join(10)
        assert not worker.is_alive()  # stopped, not left to sleep its minute
    queued: Future[None] = seen["queued"]
    wait([queued], timeout=10)
    assert queued.cancelled() or queued.exception() is not None  # never run


def _sweep_stopped_by_ctrl_c(seen: dict[str, Any]) -> None:
    """Two runs of a minute on one worker, stopped once the first has started."""
    with worker_processes(1) as pool:
        running = pool.submit(time.sleep, 60)
        seen["queued"] = pool.submit(time.sleep, 60)
        while not running.running():
            time.sleep(0.01)
        # the pool's own: active_children() would also name any process an earlier test
        # left stopping, which this test would then wait on
        seen["workers"] = list(pool._processes.values())
        raise KeyboardInterrupt

"""Worker processes for simulated runs, left early."""

from __future__ import annotations

import multiprocessing
import time
from concurrent.futures import wait

import pytest

from sim.workers import worker_processes


def test_a_pool_left_early_cancels_the_queued_runs_and_stops_its_workers() -> None:
    """The pool's own exit waited for every queued run: a sweep stopped by SIGTERM went
    on for minutes."""
    with pytest.raises(KeyboardInterrupt), worker_processes(1) as pool:
        running = pool.submit(time.sleep, 60)
        queued = pool.submit(time.sleep, 60)
        while not running.running():
            time.sleep(0.01)
        workers = multiprocessing.active_children()
        raise KeyboardInterrupt
    for worker in workers:
        worker.join(10)
        assert not worker.is_alive()  # stopped, not left to sleep its minute
    wait([queued], timeout=10)
    assert queued.cancelled() or queued.exception() is not None  # never run

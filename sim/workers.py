"""Worker processes for independent simulated runs (``--jobs``)."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager


@contextmanager
def worker_processes(jobs: int) -> Iterator[ProcessPoolExecutor]:
    """A pool of ``jobs`` processes. Left early (Ctrl-C, or SIGTERM, which the command
    line raises as KeyboardInterrupt), the runs not started are cancelled and the workers
    stopped: the pool's own exit waits for every run queued, so a stopped sweep went on
    for minutes. The workers take SIGTERM's default action rather than the handler a
    forked worker inherits, which would only end the run in hand and start the next."""
    pool = ProcessPoolExecutor(max_workers=jobs, initializer=_default_sigterm)
    try:
        yield pool
    except BaseException:
        workers = list(pool._processes.values())  # the standard library has no public way
        pool.shutdown(wait=False, cancel_futures=True)
        for worker in workers:
            worker.terminate()
        raise
    pool.shutdown()


def _default_sigterm() -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)

"""Worker processes for independent simulated runs (``--jobs``)."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from multiprocessing.process import BaseProcess

STOP_GRACE_S = 2.0
"""How long a worker gets to exit after SIGTERM before it is killed (SIGKILL), and then
how long the pool waits for it to be gone."""


@contextmanager
def worker_processes(jobs: int, runs: int) -> Iterator[ProcessPoolExecutor]:
    """A pool of ``jobs`` processes, or of one a run where ``runs`` are fewer (under fork
    the pool starts all its workers at once: ``--jobs 40`` for one run forked 40). Left
    early (Ctrl-C, or SIGTERM, which the command line raises as KeyboardInterrupt), the
    runs not started are cancelled and the workers stopped: the pool's own exit waits for
    every run queued, so a stopped sweep went on for minutes. The workers take SIGTERM's
    default action rather than the handler a forked worker inherits, which would only end
    the run in hand and start the next."""
    pool = ProcessPoolExecutor(max(1, min(jobs, runs)), initializer=_default_sigterm)
    try:
        yield pool
    except BaseException:
        workers = list(pool._processes.values())  # the standard library has no public way
        pool.shutdown(wait=False, cancel_futures=True)
        _stop(workers)
        raise
    pool.shutdown()


def _stop(workers: Sequence[BaseProcess]) -> None:
    """SIGTERM, then SIGKILL for any worker alive ``STOP_GRACE_S`` later. CI once found a
    worker alive 10 s after SIGTERM, for a cause not shown. One way it can happen: a
    worker signalled before its initializer ran still has the handler it was forked with."""
    for worker in workers:
        worker.terminate()
    deadline = time.monotonic() + STOP_GRACE_S
    for worker in workers:
        worker.join(max(0.0, deadline - time.monotonic()))
        if worker.is_alive():
            worker.kill()
            worker.join(STOP_GRACE_S)  # bounded: a process in the kernel dies on its way out


def _default_sigterm() -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)

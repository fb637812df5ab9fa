"""``tokenfleet worker`` whose seek to the committed offsets, at the end of every table
recovery, starts 3 s late: the window in which a recovered worker has resumed its input
partitions but not yet declared itself ready, made wide enough for events to be fetched
in it. Whenever Faust's flow control resumes it empties the agents' queues; the worker
appends to REPORT how many events each such emptying dropped. Run as ``python -m
tests.integration.slow_seek_worker REPORT [worker options]``."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from faust.transport.consumer import Consumer
from mode.utils.queues import FlowControlEvent

from tokenfleet.cli import main

SEEK_DELAY_S = 3.0
REPORT = Path(sys.argv[1])
_perform_seek = Consumer.perform_seek
_clear = FlowControlEvent.clear


async def _late_seek(self: Consumer) -> None:
    await asyncio.sleep(SEEK_DELAY_S)
    await _perform_seek(self)


def _counted_clear(self: FlowControlEvent) -> None:
    dropped = sum(queue.qsize() for queue in self._queues)
    with REPORT.open("a") as report:
        report.write(f"{dropped}\n")
    _clear(self)


Consumer.perform_seek = _late_seek  # type: ignore[method-assign]
FlowControlEvent.clear = _counted_clear  # type: ignore[method-assign]
sys.exit(main(["worker", *sys.argv[2:]]))

"""``tokenfleet worker`` whose seek to the committed offsets, at the end of every table
recovery, starts 3 s late: the window in which a recovered worker has resumed its input
partitions but not yet declared itself ready, made wide enough for events to be fetched
in it. When the seek ends, the worker appends to REPORT how many events its agents'
queues hold: Faust's next step, resuming flow control, empties them. Run as ``python -m
tests.integration.slow_seek_worker REPORT [worker options]``."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from faust.transport.consumer import Consumer

from tokenfleet.cli import main

SEEK_DELAY_S = 3.0
REPORT = Path(sys.argv[1])
_perform_seek = Consumer.perform_seek


async def _late_seek(self: Consumer) -> None:
    await asyncio.sleep(SEEK_DELAY_S)
    await _perform_seek(self)
    _report(sum(queue.qsize() for queue in self.app.flow_control._queues))


def _report(queued: int) -> None:
    with REPORT.open("a") as report:
        report.write(f"{queued}\n")


Consumer.perform_seek = _late_seek  # type: ignore[method-assign]
sys.exit(main(["worker", *sys.argv[2:]]))

"""``tokenfleet worker`` changed at the seek to the committed offsets that ends every table
recovery, appending a count to REPORT each time. Run as ``python -m
tests.integration.seek_worker late|drop REPORT [worker options]``.

- ``late``: the seek starts 3 s late, widening the window in which a recovered worker has
  resumed its input partitions but not yet declared itself ready. When the seek ends it
  reports how many events its agents' queues hold: Faust's next step, resuming flow
  control, empties them.
- ``drop``: before the seek it takes every record aiokafka has fetched and throws them
  away, as Faust's fetcher did when its set of active partitions emptied while aiokafka
  answered (aiokafka then answers for every partition; Faust keeps the records of active
  partitions only). It waits 2 s first for aiokafka to fetch, then fetches up to 10 times
  more while aiokafka brings nothing, and reports how many records it threw away.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path

from faust.transport.consumer import Consumer

from tokenfleet.cli import main

SEEK_DELAY_S = 3.0
FETCH_WAIT_S = 2.0
MORE_FETCHES = 10
"""After ``FETCH_WAIT_S``, at most this many fetches of up to 1 s each, until one brings
records (a loaded machine may fetch later)."""
_perform_seek = Consumer.perform_seek


async def _late(consumer: Consumer) -> int:
    await asyncio.sleep(SEEK_DELAY_S)
    await _perform_seek(consumer)
    return sum(queue.qsize() for queue in consumer.app.flow_control._queues)


async def _drop(consumer: Consumer) -> int:
    await asyncio.sleep(FETCH_WAIT_S)
    dropped, fetches = 0, 0
    while not dropped and fetches < MORE_FETCHES:
        records = await consumer._getmany(active_partitions=set(), timeout=1.0)
        dropped, fetches = sum(len(batch) for batch in records.values()), fetches + 1
    await _perform_seek(consumer)
    return dropped


def _reporting(seek: Callable[[Consumer], Awaitable[int]], report: Path) -> None:
    async def perform_seek(consumer: Consumer) -> None:
        _append(report, await seek(consumer))

    Consumer.perform_seek = perform_seek  # type: ignore[method-assign]


def _append(report: Path, count: int) -> None:
    with report.open("a") as lines:
        lines.write(f"{count}\n")


_reporting({"late": _late, "drop": _drop}[sys.argv[1]], Path(sys.argv[2]))
sys.exit(main(["worker", *sys.argv[3:]]))

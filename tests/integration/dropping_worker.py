"""``tokenfleet worker`` that, at the end of every table recovery, takes every record
aiokafka has fetched for it and throws them away before seeking to the committed offsets:
what Faust's fetcher does when its set of active partitions empties while aiokafka is
answering it (aiokafka then answers for every partition; Faust keeps the records of
active partitions only). It waits 2 s first, for aiokafka to fetch (and up to 10 s more
while aiokafka answers with nothing), and appends to REPORT how many records it threw
away.

Run as ``python -m tests.integration.dropping_worker REPORT [worker options]``."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from faust.transport.consumer import Consumer

from tokenfleet.cli import main

FETCH_WAIT_S = 2.0
MORE_TRIES = 10
"""Then at most this many fetches of up to 1 s each, until one brings records."""
REPORT = Path(sys.argv[1])
_perform_seek = Consumer.perform_seek


async def _drop_then_seek(self: Consumer) -> None:
    await asyncio.sleep(FETCH_WAIT_S)
    dropped, waited = 0, 0
    while not dropped and waited < MORE_TRIES:  # a loaded machine may fetch later
        records = await self._getmany(active_partitions=set(), timeout=1.0)
        dropped, waited = sum(len(batch) for batch in records.values()), waited + 1
    _report(dropped)
    await _perform_seek(self)


def _report(dropped: int) -> None:
    with REPORT.open("a") as report:
        report.write(f"{dropped}\n")


Consumer.perform_seek = _drop_then_seek  # type: ignore[method-assign]
sys.exit(main(["worker", *sys.argv[2:]]))

"""Faust's own ceiling on a broker: how fast an agent that only counts events consumes.

No table worker on Faust's own consumer loop can go faster on the same broker and cores,
so the streams bench reports this rate next to the worker's, measured in the same run, on
the same events. The agent runs Faust as it ships: it still pays per message what the
worker's consumer no longer does (``streams.faust_parts.RewindingConsumer.wait_first``). Run as
``python -m sim.faust_ceiling BOOTSTRAP TOPIC COUNT``; it prints the seconds from the
first event to the ``COUNT``-th and exits. It runs as the worker does
(``streams.faust_app.run_worker``).
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

import faust

from streams.faust_app import run_worker


def counting_app(bootstrap: str, topic: str, count: int) -> faust.App:
    folder = Path(tempfile.gettempdir()) / "tokenfleet-ceiling"
    folder.mkdir(exist_ok=True)  # Faust makes only the last level
    app = faust.App(
        f"ceiling-{topic}",
        broker=f"kafka://{bootstrap}",
        store="memory://",
        datadir=str(folder / topic),
        web_enabled=False,
        consumer_auto_offset_reset="earliest",
    )
    events = app.topic(topic, key_serializer="raw", value_serializer="raw")

    @app.agent(events)
    async def consume(stream: faust.StreamT) -> None:
        seen, started = 0, 0.0
        async for _ in stream.events():
            if seen == 0:
                started = time.monotonic()
            seen += 1
            if seen == count:
                print(time.monotonic() - started, flush=True)
                os._exit(0)  # Faust's shutdown takes seconds and measures nothing

    return app


def main() -> None:
    bootstrap, topic, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
    run_worker(lambda: counting_app(bootstrap, topic, count), redirect_stdouts=False)


if __name__ == "__main__":
    main()

"""What one table worker sustains on a broker, and how soon an event shows in a table.

- **Rate**: once the worker is up (it has counted a warm-up request), it is paused
  (SIGSTOP) while the lifecycle events (arrived, routed, completed) of ``requests``
  requests are published, then resumed; the rate is their number over the time from the
  resumption to the first table that counts them all. Pausing keeps the publisher's own
  work out of the figure: on a small machine it would share the worker's cores.
- **Lag**: then, on another DC, requests are published at a steady pace, half the
  measured rate (or ``paced_per_s`` if lower); a completion's lag is the time from its
  publication (acknowledged) to the first published table counting it. A table holds the
  slice still open, so the publish interval (0.25 s here), not the slide, bounds it.
- **More workers** (``workers`` > 1): a group of that many workers, started together
  once the first is gone, and once their tables count a warm-up request the rate is
  measured again on a DC of its own, every worker paused while it is published. The
  join's partitions are shared; one DC's slices are one partition, so one worker
  aggregates a DC. Beside each bulk rate, the workers' CPU time an event (Linux's
  /proc): where the cores are shared with the broker, it says whether a second worker
  adds work or only shares them.
- **Ceiling**: last, with the workers gone, the bulk events are copied to a topic of their
  own and consumed by a Faust agent that only counts them (``sim.faust_ceiling``): no
  worker built on Faust goes faster on this broker and these cores.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from aiokafka.admin import AIOKafkaAdminClient

from schemas import Envelope, Topic, topic_for
from schemas.base import TaskClass
from schemas.lifecycle import RequestArrived, RequestCompleted, RequestRouted
from schemas.topics import DAY_MS
from sim.progress import progress_bar
from streams.kafka import KafkaBus, create_topics

WORKER_SETTINGS = {
    "TOKENFLEET_WORKER_WINDOW_S": "120",
    "TOKENFLEET_WORKER_SLIDE_S": "5",
    "TOKENFLEET_WORKER_GRACE_S": "60",
    "TOKENFLEET_WORKER_PUBLISH_S": "0.25",
    # A worker is paused while the runs are published: the broker must not hand its
    # partitions on meanwhile, as it could after the worker's 10 s default.
    "TOKENFLEET_WORKER_SESSION_TIMEOUT_S": "60",
}
WINDOW_S = float(WORKER_SETTINGS["TOKENFLEET_WORKER_WINDOW_S"])
PROBE_REQUESTS = 1_000
"""Requests of the first, short run that sizes the timed one: a run the worker cannot
drain within the tables' window never shows its whole count (its first events leave the
window first), so the timed run is kept to what the worker drains in half of it."""
_RUN_MODULE = (sys.executable, "-P", "-m")
"""How a child runs one of the project's modules: ``-P`` leaves the working folder off its
``sys.path``, where a package of the operator's own would shadow ``sim`` or ``schemas``."""


def bench_streams(
    bootstrap: str,
    requests: int = 20_000,
    paced_per_s: float = 500.0,
    paced_s: float = 20.0,
    workers: int = 1,
) -> dict[str, Any]:
    asyncio.run(create_topics(bootstrap))
    tag = uuid.uuid4().hex[:8]
    more: dict[str, Any] = {}
    with _worker(bootstrap, f"bench-{tag}") as worker:
        group = [worker]
        asyncio.run(_counted(bootstrap, group, f"warm-{tag}", 10, timeout_s=300))
        probe = min(requests, PROBE_REQUESTS)
        probe_s = asyncio.run(_counted(bootstrap, group, f"probe-{tag}", probe, timeout_s=1800))
        bulk = max(probe, min(requests, int(probe / probe_s * WINDOW_S / 2)))
        elapsed, cpu_us_per_event = _bulk_run(bootstrap, group, f"bulk-{tag}", bulk)
        events_per_s = 3 * bulk / elapsed
        pace = min(paced_per_s, events_per_s / 3 / 2)
        lags = asyncio.run(_paced(bootstrap, f"paced-{tag}", pace, paced_s))
    if workers > 1:
        more = _more_workers(bootstrap, workers, bulk, tag)
        more["over_one_worker"] = more["events_per_s"] / events_per_s
    ceiling_per_s = 3 * bulk / _ceiling(bootstrap, f"bench-ceiling-{tag}", bulk)
    return {
        "events": 3 * bulk,
        "events_asked": 3 * requests,
        "events_per_s": events_per_s,
        "worker_cpu_us_per_event": cpu_us_per_event,
        "faust_ceiling_events_per_s": ceiling_per_s,
        "share_of_ceiling": events_per_s / ceiling_per_s,
        "paced_requests_per_s": pace,
        "paced_events_per_s": 3 * pace,
        "lag_p50_s": float(np.percentile(lags, 50)),
        "lag_p95_s": float(np.percentile(lags, 95)),
        "lag_samples": len(lags),
        "window": {
            k.removeprefix("TOKENFLEET_WORKER_").lower(): v for k, v in WORKER_SETTINGS.items()
        },
        "cpus": os.cpu_count(),
    } | ({"workers": workers, f"{workers}_workers": more} if more else {})


def _more_workers(bootstrap: str, workers: int, bulk: int, tag: str) -> dict[str, Any]:
    """The bulk run's rate again, by a group of ``workers`` workers started together."""
    app_id = f"bench{workers}-{tag}"
    with contextlib.ExitStack() as stack:
        group = [stack.enter_context(_worker(bootstrap, app_id)) for _ in range(workers)]
        asyncio.run(_counted(bootstrap, group, f"warm{workers}-{tag}", 10, timeout_s=300))
        elapsed, cpu_us_per_event = _bulk_run(bootstrap, group, f"bulk{workers}-{tag}", bulk)
    return {
        "events": 3 * bulk,
        "events_per_s": 3 * bulk / elapsed,
        "worker_cpu_us_per_event": cpu_us_per_event,
    }


def _bulk_run(
    bootstrap: str, workers: list[subprocess.Popen[bytes]], dc: str, requests: int
) -> tuple[float, float | None]:
    """Seconds ``workers`` take to count ``requests`` requests published in ``dc``, and
    their CPU time per event meanwhile, in microseconds (None off Linux)."""
    before_s = _cpu_s(workers)
    elapsed = asyncio.run(_counted(bootstrap, workers, dc, requests, timeout_s=1800))
    after_s = _cpu_s(workers)
    if before_s is None or after_s is None:
        return elapsed, None
    return elapsed, (after_s - before_s) / (3 * requests) * 1e6


def _cpu_s(workers: list[subprocess.Popen[bytes]]) -> float | None:
    """CPU seconds (user and system) the workers have used so far, from Linux's /proc
    (None without it): with the rate, it tells whether more workers cost more CPU an
    event, or only get less of the cores each. RuntimeError if a worker has exited: the
    others would have taken its partitions, and the figures would be theirs."""
    if not Path("/proc/self/stat").exists():
        return None
    ticks = os.sysconf("SC_CLK_TCK")
    used = 0
    for worker in workers:
        if worker.poll() is not None:
            raise RuntimeError(f"a table worker exited (code {worker.returncode}) in the run")
        stat = Path(f"/proc/{worker.pid}/stat").read_text()
        utime, stime = stat.rsplit(")", 1)[1].split()[11:13]  # the 14th and 15th fields
        used += int(utime) + int(stime)
    return used / ticks


def _request(dc: str, n: int, at: float | None = None) -> list[Envelope]:
    at = time.time() if at is None else at
    rid = f"{dc}-{n}"
    payloads = (
        RequestArrived(
            request_id=rid,
            tenant=f"tenant-{n % 4}",
            task_class=TaskClass.INTERACTIVE,
            model="m",
            input_tokens=500,
            output_budget=100,
            source_region="here",
        ),
        RequestRouted(request_id=rid, dc=dc, instance_id=f"i{n % 8}", policy="p", candidates=()),
        RequestCompleted(
            request_id=rid,
            dc=dc,
            instance_id=f"i{n % 8}",
            task_class=TaskClass.INTERACTIVE,
            tenant=f"tenant-{n % 4}",
            input_tokens=500,
            cached_tokens=0,
            output_tokens=100,
            ttft_s=0.2 + (n % 10) / 10,
            tpot_s=0.02,
            e2e_s=3.0,
        ),
    )
    return [Envelope.wrap(p, source="bench", ts=at) for p in payloads]


@contextlib.contextmanager
def _worker(bootstrap: str, app_id: str) -> Iterator[subprocess.Popen[bytes]]:
    environment = (
        os.environ
        | WORKER_SETTINGS
        | {
            "TOKENFLEET_KAFKA_BOOTSTRAP": bootstrap,
            "TOKENFLEET_WORKER_APP_ID": app_id,
        }
    )
    process = subprocess.Popen(
        [*_RUN_MODULE, "tokenfleet", "worker"],
        env=environment,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        yield process
    finally:
        process.terminate()
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:  # a worker stuck in its shutdown: left running
            process.kill()  # on its own, it took a core for good
            process.wait()


def _ceiling(bootstrap: str, topic: str, requests: int) -> float:
    """Seconds a Faust agent that only counts takes to consume the bulk run's events,
    copied to a topic of their own with as many partitions as the lifecycle topics (and
    deleted after: on a broker of the user's, it would only take space)."""
    partitions = topic_for(RequestArrived).partitions
    asyncio.run(
        create_topics(bootstrap, [Topic(topic, "request_id", partitions, False, DAY_MS, ())])
    )
    try:
        events = [e for n in range(requests) for e in _request(topic, n)]
        asyncio.run(_publish_copy(bootstrap, events, topic))
        argv = [*_RUN_MODULE, "sim.faust_ceiling", bootstrap, topic, str(len(events))]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=600, check=True)
        return float(done.stdout.split()[-1])
    finally:
        asyncio.run(_delete_topic(bootstrap, topic))


async def _delete_topic(bootstrap: str, topic: str) -> None:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        await admin.delete_topics([topic])
    finally:
        await admin.close()


async def _publish_copy(bootstrap: str, events: list[Envelope], topic: str) -> None:
    bus = KafkaBus(bootstrap)
    try:
        for at in progress_bar(range(0, len(events), 5000), desc=f"publish {topic}", unit="batch"):
            await bus.publish_events(events[at : at + 5000], to=topic)
    finally:
        await bus.close()


def _completed(envelope: Envelope) -> int:
    return sum(row.completed for row in envelope.payload.classes)  # type: ignore[attr-defined]


async def _counted(
    bootstrap: str, workers: list[subprocess.Popen[bytes]], dc: str, requests: int, timeout_s: float
) -> float:
    """Publish ``requests`` requests in ``dc`` with the workers stopped; return the seconds
    from their resumption to the first table counting them all. RuntimeError, at once, when
    the count falls back before it gets there: the window let the first ones go."""
    bus = KafkaBus(bootstrap)
    events = [e for n in range(requests) for e in _request(dc, n)]
    try:
        async with (
            asyncio.timeout(timeout_s),
            bus.subscribe("tf.tables.goodput", "latest") as tables,
        ):
            for worker in workers:
                worker.send_signal(signal.SIGSTOP)
            try:
                for at in progress_bar(
                    range(0, len(events), 5000), desc=f"publish {dc}", unit="batch"
                ):
                    await bus.publish_events(events[at : at + 5000])
            finally:
                for worker in workers:
                    worker.send_signal(signal.SIGCONT)
            started = time.monotonic()
            consumed, counted_before = progress_bar(total=requests, desc="consume", unit="req"), 0
            async for table in tables:
                if table.key == dc:
                    counted = _completed(table.envelope)
                    if counted < counted_before:
                        raise RuntimeError(
                            f"the worker counted {counted_before} of {requests} requests "
                            f"before the tables' {WINDOW_S:g} s window let the first go: it "
                            f"drains fewer than {requests / WINDOW_S:.0f} requests/s here"
                        )
                    consumed.update(counted - counted_before)
                    counted_before = counted
                    if counted >= requests:
                        consumed.close()
                        return time.monotonic() - started
    finally:
        await bus.close()
    raise RuntimeError("the table stream ended")


async def _paced(bootstrap: str, dc: str, per_s: float, seconds: float) -> list[float]:
    bus = KafkaBus(bootstrap)
    published: list[float] = []
    seen: list[tuple[float, int]] = []
    caught_up = asyncio.Event()

    async def watch() -> None:
        async with bus.subscribe("tf.tables.goodput", "latest") as tables:
            async for table in tables:
                if table.key == dc:
                    seen.append((time.monotonic(), _completed(table.envelope)))
                    if published and seen[-1][1] >= len(published):
                        caught_up.set()

    watcher = asyncio.create_task(watch())
    try:
        await asyncio.sleep(1.0)
        step, n, start = 0.05, 0, time.monotonic()
        while time.monotonic() - start < seconds:
            batch = max(1, round(per_s * step))
            events = [e for k in range(n, n + batch) for e in _request(dc, k)]
            await bus.publish_events(events)
            published.extend([time.monotonic()] * batch)
            n += batch
            await asyncio.sleep(max(0.0, start + len(published) / per_s - time.monotonic()))
        caught_up.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(caught_up.wait(), 30)
    finally:
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)
        await bus.close()
    return [_first_seen(seen, k + 1) - at for k, at in enumerate(published)]


def _first_seen(seen: list[tuple[float, int]], count: int) -> float:
    return next((at for at, counted in seen if counted >= count), float("inf"))

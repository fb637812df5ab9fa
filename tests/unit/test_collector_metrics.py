"""What the collector counts for Prometheus, and when ``tokenfleet collect`` serves it."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from schemas import Envelope, topic_for
from schemas.fleet import InstanceConfig
from streams.collector import Collector
from streams.memory import InMemoryBus
from tokenfleet.cli import main
from tokenfleet.services.process import answers_http, free_port

LOCAL_FLEET = Path(__file__).parents[2] / "examples" / "fleet-local.toml"


async def _kv_events(request: web.Request) -> web.Response:
    """One new stored block at every read, as the emulator's feed numbers them."""
    after = int(request.query["after"])
    page = {"epoch": "e", "next": after + 1, "complete": True, "events": [[after + 1, True]]}
    return web.json_response(page)


@contextlib.asynccontextmanager
async def _instance_serving(
    exposition: str = "vllm:num_requests_running 1\n",
) -> AsyncIterator[str]:
    """A vLLM instance's ``/metrics`` and the emulator's ``/kv-events``; yields its URL."""

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(text=exposition)

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/kv-events", _kv_events)
    async with TestServer(app, host="127.0.0.1") as server:
        yield str(server.make_url("/"))


def _instance(name: str, url: str, engine: str = "vllm") -> InstanceConfig:
    return InstanceConfig(id=name, dc="dc-a", url=url, model="m", engine=engine)


async def test_scrapes_and_failures_are_counted_by_instance_with_the_last_good_one_s_time() -> None:
    async with _instance_serving() as url, aiohttp.ClientSession() as client:
        dead = f"http://127.0.0.1:{free_port()}"
        instances = [_instance("alive", url), _instance("dead", dead)]
        collector = Collector(instances, InMemoryBus(), client, timeout_s=0.5)
        before = time.time()
        await collector.scrape_once()
        await collector.scrape_once()
    sample = collector.metrics.registry.get_sample_value
    assert sample("tokenfleet_collector_scrapes_total", {"instance_id": "alive"}) == 2
    assert sample("tokenfleet_collector_scrapes_total", {"instance_id": "dead"}) == 2
    assert sample("tokenfleet_collector_scrape_failures_total", {"instance_id": "alive"}) == 0
    assert sample("tokenfleet_collector_scrape_failures_total", {"instance_id": "dead"}) == 2
    last = "tokenfleet_collector_last_scrape_timestamp_seconds"
    assert before <= (sample(last, {"instance_id": "alive"}) or 0) <= time.time()
    assert sample(last, {"instance_id": "dead"}) is None  # never scraped successfully
    # Another collector counts in a registry of its own, each series there from the start.
    fresh = Collector(instances, InMemoryBus(), client).metrics.registry.get_sample_value
    assert fresh("tokenfleet_collector_scrape_failures_total", {"instance_id": "dead"}) == 0


@pytest.mark.parametrize(
    "exposition",
    [
        "vllm:kv_cache_usage_perc NaN\n",
        "vllm:num_preemptions_total +Inf\n",
        "vllm:num_requests_running -2\n",
    ],
)
async def test_an_instance_that_reads_no_count_is_published_not_ready(exposition: str) -> None:
    """Its telemetry raised outside the scrape's guard, and the collector stopped for
    every instance of the fleet."""
    async with _instance_serving(exposition) as url, aiohttp.ClientSession() as client:
        collector = Collector([_instance("odd", url)], InMemoryBus(), client)
        [telemetry] = await collector.scrape_once()
    assert not telemetry.ready
    failures = collector.metrics.registry.get_sample_value
    assert failures("tokenfleet_collector_scrape_failures_total", {"instance_id": "odd"}) == 1


async def test_a_failed_scrape_s_warning_says_what_failed(caplog: pytest.LogCaptureFixture) -> None:
    """A slow instance's warning ended in an empty message (a TimeoutError's text), and an
    SGLang server without ``--enable-metrics`` (no ``/metrics``) got a bare 404."""

    answered = asyncio.Event()

    async def slow(_: web.Request) -> web.Response:
        await answered.wait()  # set once the scrape gave up: nothing is left pending
        return web.Response(text="")

    app = web.Application()
    app.router.add_get("/slow/metrics", slow)
    async with TestServer(app, host="127.0.0.1") as server, aiohttp.ClientSession() as client:
        instances = [
            _instance("slow", str(server.make_url("/slow/"))),
            _instance("bare", str(server.make_url("/")), engine="sglang"),
        ]
        with caplog.at_level(logging.WARNING, logger="streams.collector"):
            await Collector(instances, InMemoryBus(), client, timeout_s=0.2).scrape_once()
        answered.set()
    warnings = sorted(record.getMessage() for record in caplog.records)
    assert warnings[0].startswith("bare is published not ready")
    assert warnings[0].endswith("(an SGLang server serves /metrics only with --enable-metrics)")
    assert warnings[1].startswith("slow is published not ready")
    assert warnings[1].endswith(": no answer within 0.2 s")


class _RefusingFirst(InMemoryBus):
    """Refuses the first batch for each topic, as a broker away would, and tallies the
    events it takes by topic."""

    def __init__(self) -> None:
        super().__init__()
        self.refused: set[str] = set()
        self.taken: Counter[str] = Counter()
        self.both_taken = asyncio.Event()
        """Set once each topic has taken a batch after its refusal."""

    async def publish_events(self, envelopes: Sequence[Envelope], to: str | None = None) -> None:
        topic = topic_for(type(envelopes[0].payload)).name
        if topic not in self.refused:
            self.refused.add(topic)
            raise ConnectionError("broker away")
        self.taken[topic] += len(envelopes)
        if len(self.taken) == 2:
            self.both_taken.set()


async def test_events_published_and_refused_batches_are_counted_by_topic() -> None:
    bus = _RefusingFirst()
    async with _instance_serving() as url, aiohttp.ClientSession() as client:
        collector = Collector([_instance("alive", url)], bus, client, 0.01, kv_interval_s=0.01)
        running = asyncio.create_task(collector.run())
        try:
            await asyncio.wait_for(bus.both_taken.wait(), timeout=10)
        finally:
            running.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await running
    sample = collector.metrics.registry.get_sample_value
    for topic in ("tf.telemetry", "tf.kv-events"):
        assert sample("tokenfleet_collector_publish_failures_total", {"topic": topic}) == 1
        published = sample("tokenfleet_collector_events_published_total", {"topic": topic})
        assert published == bus.taken[topic] > 0, topic


def test_collect_exits_without_serving_metrics_where_it_cannot_reach_kafka(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``/metrics`` answering is what tells ``tokenfleet up`` the collector started: it
    must not answer for one that cannot publish."""
    monkeypatch.setenv("TOKENFLEET_KAFKA_BOOTSTRAP", "127.0.0.1:1")
    port = free_port()
    assert main(["collect", "--fleet", str(LOCAL_FLEET), "--metrics-port", str(port)]) == 2
    assert "cannot reach the Kafka broker at 127.0.0.1:1" in capsys.readouterr().err
    assert not answers_http(f"http://127.0.0.1:{port}/metrics")

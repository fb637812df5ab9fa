"""The telemetry collector: scrape every instance's ``/metrics``, publish ``tf.telemetry``;
read the KV events of instances that serve them over HTTP, publish ``tf.kv-events``.

Understands vLLM's names (v1, and the older ``gpu_cache_usage_perc``) and SGLang's (its
server needs ``--enable-metrics``); an exposition with none of the engine's metrics is
an instance published not ready, with a warning, rather than one read as idle.
Scrapes run concurrently, each under a timeout, so one slow instance delays no other. An
instance that does not answer (or answers garbage) is published not ready; the next good
scrape publishes it ready again.

KV events come from ``/kv-events`` (the emulator's feed, ``sim/emulator/kv_feed.py``); an
instance that answers 404 (vLLM and SGLang, which publish theirs on ZMQ) is not asked
again. Events the feed dropped before they were read, or a restarted instance (a new
epoch), are published as the instance's cache cleared, so that no index keeps blocks the
engine may have evicted unseen.

What it did is counted in ``CollectorMetrics`` (``tokenfleet collect --metrics-port``
serves them): scrapes and failed scrapes by instance, the last good scrape's time, and
events published and failed publishes by topic.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import os
import re
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from operator import itemgetter
from statistics import fmean

import aiohttp
from prometheus_client import CollectorRegistry, Counter, Gauge, ProcessCollector
from pydantic import BaseModel

from schemas import Envelope, Message, topic_for
from schemas.base import BlockHash
from schemas.fleet import InstanceConfig
from schemas.telemetry import InstanceTelemetry, KvAllCleared, KvBlocksRemoved, KvBlocksStored
from streams.bus import EventBus

log = logging.getLogger(__name__)

TELEMETRY_TOPIC = topic_for(InstanceTelemetry).name
KV_EVENTS_TOPIC = topic_for(KvAllCleared).name
NOMINAL_KV_BLOCKS = 10_000
"""Cache size assumed when an engine reports only a usage fraction (SGLang without
``max_total_num_tokens``): usage is then right as a share, not as a count."""


@dataclass(frozen=True)
class Scraped:
    """The figures one scrape yields, engine-neutral."""

    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    kv_blocks_total: int | None = None
    block_size: int = 16
    prefix_hits: float = 0.0
    prefix_queries: float = 0.0
    preemptions: float = 0.0
    asleep: bool = False
    """vLLM's engines are all put to sleep (``/sleep``: weights offloaded or dropped)."""


_VLLM = {
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
    "vllm:kv_cache_usage_perc": "kv_usage",
    "vllm:gpu_cache_usage_perc": "kv_usage_older",
    "vllm:prefix_cache_hits": "prefix_hits",
    "vllm:prefix_cache_queries": "prefix_queries",
    "vllm:gpu_prefix_cache_hits": "prefix_hits_older",
    "vllm:gpu_prefix_cache_queries": "prefix_queries_older",
    "vllm:num_preemptions": "preemptions",
    "vllm:cache_config_info": "cache_config",
    "vllm:engine_sleep_state": "sleep_state",
}
_SGLANG = {
    "sglang:num_running_reqs": "running",
    "sglang:num_queue_reqs": "waiting",
    "sglang:token_usage": "kv_usage",
    "sglang:max_total_num_tokens": "total_tokens",
    "sglang:prompt_tokens": "prefix_queries",
    "sglang:cached_tokens": "prefix_hits",
    "sglang:cache_hit_rate": "hit_rate",
    "sglang:num_retracted_requests": "preemptions",
}
_SHARES = frozenset({"kv_usage", "kv_usage_older", "hit_rate"})
"""Fractions, one per engine (vLLM's data-parallel engines, SGLang's DP ranks): averaged,
where counts are added up."""


class NoEngineMetrics(ValueError):
    """An exposition with none of the engine's metrics: read as idle, the instance would
    draw every request."""


def _series_group(engine: str, name: str, labels: dict[str, str]) -> tuple[tuple[str, ...], bool]:
    """The group of series a sample belongs to, and whether it is one priority's share.

    The series of one group repeat one figure, and the largest counts: vLLM's API-server
    processes (``pid``, under ``--api-server-count``: a gauge without ``mostrecent``, as
    ``kv_cache_usage_perc`` was from 0.9.2 until late 2025, vLLM PR #28792, has a series
    per process, only one of them fed the engine's stats, the others 0), SGLang's
    tensor-parallel (pipeline, expert) ranks of a batch. The groups are vLLM's
    data-parallel engines and SGLang's DP ranks (under DP attention a rank's ``tp_rank``
    is global, not 0), added up or averaged. SGLang repeats a figure per priority beside
    its total (``priority`` empty); under priority scheduling its tokenizer's counters
    have the per-priority series alone (SGLang 0.5.23, ``metrics_collector.py``)."""
    if engine != "sglang":
        return (name, *(f"{k}={v}" for k, v in sorted(labels.items()) if k != "pid")), False
    kept = (f"{k}={v}" for k, v in sorted(labels.items()) if k == "dp_rank" or k[-5:] != "_rank")
    return (name, *kept), bool(labels.get("priority"))


_SAMPLE = re.compile(
    r'([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{((?:[^"}]|"(?:[^"\\]|\\.)*")*)\})?[ \t]+(\S+)'
)
"""A sample's name, its labels (each value a quoted string, which may hold ``}``) and its
value; a timestamp or an OpenMetrics exemplar (`` # {trace_id="..."} 7.0``) may follow."""
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def samples(text: str) -> Iterator[tuple[str, dict[str, str], float]]:
    """``(name, labels, value)`` of each sample of a Prometheus text exposition; raises
    ValueError on a line that is not one. (prometheus_client's parser costs milliseconds
    a scrape, which a gateway scraping its fleet five times a second feels.)"""
    for line in text.splitlines():
        line = line.strip()  # the format allows blanks around a line's tokens
        if not line or line.startswith("#"):
            continue
        match = _SAMPLE.match(line)
        if match is None:
            raise ValueError(f"not a Prometheus sample: {line[:80]!r}")
        name, labels, value = match.groups()
        yield name, dict(_LABEL.findall(labels)) if labels else {}, float(value)


def parse_metrics(text: str, engine: str) -> Scraped:
    """Read a Prometheus exposition; raises ValueError if it is not one, and
    ``NoEngineMetrics`` if it has none of the engine's metrics (vLLM started with
    ``--disable-log-stats``, or a server of the other engine than the fleet file says).
    Counts of several series of one family (one per model, or per data-parallel engine)
    are added up, fractions averaged; vLLM's older ``gpu_cache_usage_perc`` and
    ``gpu_prefix_cache_{hits,queries}`` are read only where ``kv_cache_usage_perc`` and
    ``prefix_cache_queries`` are missing (0.9.2 to 0.10 publish both; 0.8 to 0.9.1 the
    older only, whose prefix counters read 0 until 2026-12-07)."""
    names = _VLLM if engine == "vllm" else _SGLANG
    groups: dict[str, dict[tuple[str, ...], float]] = {}
    by_priority: dict[str, dict[tuple[str, ...], float]] = {}
    blocks, block_size = 0, 16
    awake: list[float] = []
    engine_samples = False
    for name, labels, value in samples(text):
        engine_samples = engine_samples or name.startswith(f"{engine}:")
        # Counters are exposed as ``name_total`` (with ``name_created`` beside them).
        field = names.get(name.removesuffix("_total"))
        if field == "sleep_state":
            if labels.get("sleep_state") == "awake":  # 1 awake, 0 asleep; one per engine
                awake.append(value)
        elif field == "cache_config":
            # One series per data-parallel engine, each with the engines' sum already.
            blocks = max(blocks, _whole(labels.get("num_gpu_blocks")))
            block_size = _whole(labels.get("block_size")) or block_size
        elif field is not None:
            group, shared = _series_group(engine, name, labels)
            values = (by_priority if shared else groups).setdefault(field, {})
            values[group] = max(values.get(group, value), value)
    if not engine_samples:  # a server's gauges wait for its first stats (SGLang's: 30 s idle)
        raise NoEngineMetrics(
            f"no {engine} metrics (such as {', '.join(list(names)[:2])}): an SGLang server "
            "needs --enable-metrics, a vLLM one its stats logging (no --disable-log-stats); "
            "the fleet file's `engine` must name the server's"
        )
    for field, shares in by_priority.items():  # a figure without its total: the shares
        groups.setdefault(field, shares)
    figures = {f: fmean(v.values()) if f in _SHARES else sum(v.values()) for f, v in groups.items()}
    for field, value in figures.items():
        if not 0 <= value < math.inf:  # NaN too: no gauge or counter here is one
            raise ValueError(f"its {field} reads {value}, not a count")
    if total_tokens := figures.get("total_tokens"):
        blocks = max(int(total_tokens) // block_size, 1)
    hit_rate = figures.get("hit_rate")
    if hit_rate is not None and "prefix_queries" not in figures:
        # An SGLang without the tokenizer's counters: its last prefill batch's rate, over a
        # nominal 1,000 queries (a counter that never grows: the tables read no rate).
        figures["prefix_queries"], figures["prefix_hits"] = 1000.0, 1000.0 * hit_rate
    kv_usage = figures.get("kv_usage", figures.get("kv_usage_older", 0.0))
    if "prefix_queries" not in figures:  # vLLM 0.8 to 0.9.1 had only the older pair
        figures["prefix_queries"] = figures.get("prefix_queries_older", 0.0)
        figures["prefix_hits"] = figures.get("prefix_hits_older", 0.0)
    return Scraped(
        running=int(figures.get("running", 0)),
        waiting=int(figures.get("waiting", 0)),
        kv_usage=min(max(kv_usage, 0.0), 1.0),
        kv_blocks_total=blocks or None,
        block_size=block_size,
        prefix_hits=figures.get("prefix_hits", 0.0),
        prefix_queries=figures.get("prefix_queries", 0.0),
        preemptions=figures.get("preemptions", 0.0),
        asleep=bool(awake) and not any(awake),
    )


def _whole(label: str | None) -> int:
    """A count in a label; 0 where it is missing or not a number (vLLM 0.8 wrote
    ``num_gpu_blocks="None"`` before its cache was sized)."""
    try:
        return int(label or 0)
    except ValueError:
        return 0


def telemetry_of(instance: InstanceConfig, scraped: Scraped | None) -> InstanceTelemetry:
    """The telemetry event for one scrape; None means the instance did not answer."""
    if scraped is None:
        return InstanceTelemetry(
            instance_id=instance.id,
            dc=instance.dc,
            model=instance.model,
            model_version=instance.version,
            ready=False,
            waiting=0,
            running=0,
            inflight_tokens=0,
            kv_blocks_used=0,
            kv_blocks_total=0,
        )
    total = scraped.kv_blocks_total or NOMINAL_KV_BLOCKS
    queries = int(scraped.prefix_queries)
    return InstanceTelemetry(
        instance_id=instance.id,
        dc=instance.dc,
        model=instance.model,
        model_version=instance.version,
        ready=not scraped.asleep,
        waiting=scraped.waiting,
        running=scraped.running,
        inflight_tokens=0,
        kv_blocks_used=min(round(scraped.kv_usage * total), total),
        kv_blocks_total=total,
        block_size=scraped.block_size,
        prefix_cache_hits=min(int(scraped.prefix_hits), queries),
        prefix_cache_queries=queries,
        preemptions=int(scraped.preemptions),
    )


class KvEventPage(BaseModel):
    """One answer of an instance's ``/kv-events``: events as ``[hash, stored]``."""

    epoch: str
    next: int
    complete: bool
    events: list[tuple[BlockHash, bool]]


KvMessage = KvBlocksStored | KvBlocksRemoved | KvAllCleared


def kv_messages(
    instance_id: str, events: Sequence[tuple[int, bool]], lost: str | None = None
) -> list[KvMessage]:
    """The ``tf.kv-events`` messages for an instance's events, a message per run of stored
    or removed blocks, in order; first the cache cleared, when events were ``lost``."""
    messages: list[KvMessage] = [KvAllCleared(instance_id=instance_id, reason=lost)] if lost else []
    for stored, run in itertools.groupby(events, key=itemgetter(1)):
        hashes = tuple(block for block, _ in run)
        kind = KvBlocksStored if stored else KvBlocksRemoved
        messages.append(kind(instance_id=instance_id, block_hashes=hashes))
    return messages


class CollectorMetrics:
    """The collector's Prometheus metrics, in a registry of its own (tests build several),
    or in ``registry``, the process's (an embedded gateway's, which runs a collector and
    has the process metrics already). Each instance's and topic's series exist from the
    start, at 0, so that a first failure shows as an increase rather than as a new
    series."""

    def __init__(
        self, instance_ids: Iterable[str], registry: CollectorRegistry | None = None
    ) -> None:
        if registry is None:
            registry = CollectorRegistry()
            ProcessCollector(registry=registry)  # process_cpu_seconds_total, memory, files
        self.registry = r = registry
        self.scrapes = Counter(
            "tokenfleet_collector_scrapes",
            "Scrapes of an instance's /metrics, failed ones included, by instance (its id in "
            "the fleet file).",
            ("instance_id",),
            registry=r,
        )
        self.scrape_failures = Counter(
            "tokenfleet_collector_scrape_failures",
            "Scrapes that failed (no answer in time, an HTTP error, no exposition, none of "
            "the engine's metrics), by instance: each published it not ready.",
            ("instance_id",),
            registry=r,
        )
        self.last_scrape = Gauge(
            "tokenfleet_collector_last_scrape_timestamp_seconds",
            "When the instance was last scraped successfully (Unix time); absent before.",
            ("instance_id",),
            registry=r,
        )
        self.events_published = Counter(
            "tokenfleet_collector_events_published",
            "Events the bus has taken, by topic (tf.telemetry, tf.kv-events).",
            ("topic",),
            registry=r,
        )
        self.publish_failures = Counter(
            "tokenfleet_collector_publish_failures",
            "Batches of events the bus refused, by topic: a round's telemetry is lost; the "
            "KV events' instances are published cleared at their next read.",
            ("topic",),
            registry=r,
        )
        for instance_id in instance_ids:
            self.scrapes.labels(instance_id)
            self.scrape_failures.labels(instance_id)
        for topic in (TELEMETRY_TOPIC, KV_EVENTS_TOPIC):
            self.events_published.labels(topic)
            self.publish_failures.labels(topic)


class Collector:
    """Scrapes ``instances`` every ``interval_s`` and publishes one telemetry event per
    instance; every ``kv_interval_s``, the KV events each instance with a feed made since.

    KV events are read less often than metrics (an eviction matters to an index only when
    a prompt asks for that prefix again), in a loop of their own, first one KV interval
    after the start: in the two-gateway burst test, reads at the scrape's pace and a first
    read racing a new gateway's first telemetry moved placements (2 failures in 18 runs).
    """

    def __init__(
        self,
        instances: Iterable[InstanceConfig],
        bus: EventBus,
        client: aiohttp.ClientSession,
        interval_s: float = 0.2,
        timeout_s: float = 1.0,
        kv_interval_s: float = 1.0,
        registry: CollectorRegistry | None = None,
    ) -> None:
        """``registry``: where its metrics go (``CollectorMetrics``)."""
        self.instances = tuple(instances)
        self._headers = {i.id: i.auth_headers(os.environ) for i in self.instances}
        self.bus = bus
        self.client = client
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.kv_interval_s = kv_interval_s
        self._kv_cursors: dict[str, tuple[str, int]] = {}
        """Per instance with a feed: its epoch and the number of the last event read."""
        self._without_feed: set[str] = set()
        self._unpublished: set[str] = set()
        """Instances whose KV events were read but could not be published."""
        self._unread: dict[str, str] = {}
        """Instances whose last scrape failed, and why (warned of once, not every scrape)."""
        self.metrics = CollectorMetrics((i.id for i in self.instances), registry)

    async def scrape_once(self) -> list[InstanceTelemetry]:
        scraped = await asyncio.gather(*(self._scrape(i) for i in self.instances))
        return [telemetry_of(i, s) for i, s in zip(self.instances, scraped, strict=True)]

    async def kv_events_once(self) -> list[KvMessage]:
        """The KV events of every instance with a feed since the last read."""
        readers = [self._kv_events(i) for i in self.instances if i.id not in self._without_feed]
        return [message for messages in await asyncio.gather(*readers) for message in messages]

    async def run(self) -> None:
        """Scrape and publish until cancelled: telemetry and KV events in rounds of their
        own, so that reading a feed never delays telemetry (the first KV read waits a KV
        interval, so that it does not race a starting gateway's first telemetry)."""
        await asyncio.gather(
            _every(self.interval_s, self._publish_telemetry),
            _every(self.kv_interval_s, self._publish_kv, first_after_s=self.kv_interval_s),
        )

    async def _publish_telemetry(self) -> None:
        """A bus outage loses one round, not the loop."""
        await self._publish(TELEMETRY_TOPIC, await self.scrape_once())

    async def _publish_kv(self) -> None:
        """KV events a bus outage loses clear their instances at the next round (their
        index is relearned from routing)."""
        kv_events = await self.kv_events_once()
        if kv_events and not await self._publish(KV_EVENTS_TOPIC, kv_events):
            self._unpublished.update(message.instance_id for message in kv_events)

    async def _publish(self, topic: str, messages: Sequence[Message]) -> bool:
        """Publish ``messages`` (``topic``'s, counted under it); False, with a warning,
        where the bus refused them."""
        try:
            await self.bus.publish_events([Envelope.wrap(m, source="collector") for m in messages])
        except Exception as exc:
            log.warning("publishing to %s failed: %s", topic, exc)
            self.metrics.publish_failures.labels(topic).inc()
            return False
        self.metrics.events_published.labels(topic).inc(len(messages))
        return True

    async def _scrape(self, instance: InstanceConfig) -> Scraped | None:
        url = f"{str(instance.url).rstrip('/')}/metrics"
        self.metrics.scrapes.labels(instance.id).inc()
        try:
            async with (
                asyncio.timeout(self.timeout_s),
                self.client.get(url, headers=self._headers[instance.id]) as response,
            ):
                response.raise_for_status()
                text = await response.text()
            scraped = parse_metrics(text, instance.engine)
        except (aiohttp.ClientError, ValueError, TimeoutError) as exc:
            why = str(exc) if isinstance(exc, NoEngineMetrics) else type(exc).__name__
            if self._unread.get(instance.id) != why:
                detail = self._scrape_failure_text(instance, exc)
                log.warning("%s is published not ready: scraping %s: %s", instance.id, url, detail)
            self._unread[instance.id] = why
            self.metrics.scrape_failures.labels(instance.id).inc()
            return None
        if self._unread.pop(instance.id, None) is not None:
            log.warning("%s answers again: published ready", instance.id)
        self.metrics.last_scrape.labels(instance.id).set_to_current_time()
        return scraped

    def _scrape_failure_text(self, instance: InstanceConfig, exc: Exception) -> str:
        """What a failed scrape's warning says of it."""
        if isinstance(exc, TimeoutError):  # its text is empty
            return f"no answer within {self.timeout_s:g} s"
        missing = isinstance(exc, aiohttp.ClientResponseError) and exc.status == 404
        if missing and instance.engine == "sglang":
            return f"{exc} (an SGLang server serves /metrics only with --enable-metrics)"
        return str(exc)

    async def _kv_events(self, instance: InstanceConfig) -> list[KvMessage]:
        url = f"{str(instance.url).rstrip('/')}/kv-events"
        cursor = self._kv_cursors.get(instance.id)
        params: dict[str, str | int] = (
            {"epoch": cursor[0], "after": cursor[1]} if cursor else {"after": 0}
        )
        try:
            async with (
                asyncio.timeout(self.timeout_s),
                self.client.get(url, params=params, headers=self._headers[instance.id]) as response,
            ):
                if response.status == 404:
                    log.info("%s serves no KV events over HTTP", instance.id)
                    self._without_feed.add(instance.id)
                    return []
                response.raise_for_status()
                page = KvEventPage.model_validate(await response.json(content_type=None))
        except (aiohttp.ClientError, ValueError, TimeoutError) as exc:
            log.info("reading the KV events of %s failed: %s", instance.id, exc)
            return []
        self._kv_cursors[instance.id] = (page.epoch, page.next)
        return kv_messages(instance.id, page.events, self._lost(instance.id, cursor, page))

    def _lost(
        self, instance_id: str, cursor: tuple[str, int] | None, page: KvEventPage
    ) -> str | None:
        """Why events of the instance may have gone unseen since the last read, if they may."""
        if instance_id in self._unpublished:
            self._unpublished.discard(instance_id)
            return "KV events read but not published"
        if cursor is None:  # the first read: what happened before concerns no index yet
            return None
        if cursor[0] != page.epoch:
            return "instance restarted"
        return None if page.complete else "KV events dropped before they were read"


async def _every(
    interval_s: float, act: Callable[[], Awaitable[None]], first_after_s: float = 0.0
) -> None:
    """``act`` after ``first_after_s``, then again each ``interval_s`` after it began,
    until cancelled."""
    await asyncio.sleep(first_after_s)
    while True:
        started = time.monotonic()
        await act()
        await asyncio.sleep(max(0.0, interval_s - (time.monotonic() - started)))

"""The telemetry collector: scrape every instance's ``/metrics``, publish ``tf.telemetry``.

Understands vLLM's names (v1, and the older ``gpu_cache_usage_perc``) and SGLang's.
Scrapes run concurrently, each under a timeout, so one slow instance delays no other. An
instance that does not answer (or answers garbage) is published not ready; the next good
scrape publishes it ready again.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import aiohttp

from schemas import Envelope
from schemas.fleet import InstanceConfig
from schemas.telemetry import InstanceTelemetry
from streams.bus import EventBus

log = logging.getLogger(__name__)

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


_VLLM = {
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
    "vllm:kv_cache_usage_perc": "kv_usage",
    "vllm:gpu_cache_usage_perc": "kv_usage",
    "vllm:prefix_cache_hits": "prefix_hits",
    "vllm:prefix_cache_queries": "prefix_queries",
    "vllm:num_preemptions": "preemptions",
}
_SGLANG = {
    "sglang:num_running_reqs": "running",
    "sglang:num_queue_reqs": "waiting",
    "sglang:token_usage": "kv_usage",
}


_SAMPLE = re.compile(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?[ \t]+(\S+)")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def samples(text: str) -> Iterator[tuple[str, dict[str, str], float]]:
    """``(name, labels, value)`` of each sample of a Prometheus text exposition; raises
    ValueError on a line that is not one. (prometheus_client's parser costs milliseconds
    a scrape, which a gateway scraping its fleet five times a second feels.)"""
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        match = _SAMPLE.match(line)
        if match is None:
            raise ValueError(f"not a Prometheus sample: {line[:80]!r}")
        name, labels, value = match.groups()
        yield name, dict(_LABEL.findall(labels)) if labels else {}, float(value)


def parse_metrics(text: str, engine: str) -> Scraped:
    """Read a Prometheus exposition; raises ValueError if it is not one. Values of several
    series of one family (e.g. one per model) are added up."""
    names = _VLLM if engine == "vllm" else _SGLANG
    values: dict[str, float] = {}
    total_tokens = hit_rate = None
    blocks: int | None = None
    block_size = 16
    for name, labels, value in samples(text):
        # Counters are exposed as ``name_total`` (with ``name_created`` beside them).
        field = names.get(name.removesuffix("_total"))
        if field is not None:
            values[field] = values.get(field, 0.0) + value
        elif name == "vllm:cache_config_info":
            blocks = int(labels.get("num_gpu_blocks", 0)) or None
            block_size = int(labels.get("block_size", 16))
        elif name == "sglang:max_total_num_tokens":
            total_tokens = value
        elif name == "sglang:cache_hit_rate":
            hit_rate = value
    if total_tokens:
        blocks = max(int(total_tokens) // block_size, 1)
    if hit_rate is not None:  # a rate, not counters: report it over a nominal 1,000 queries
        values["prefix_queries"], values["prefix_hits"] = 1000.0, 1000.0 * hit_rate
    return Scraped(
        running=int(values.get("running", 0)),
        waiting=int(values.get("waiting", 0)),
        kv_usage=min(max(values.get("kv_usage", 0.0), 0.0), 1.0),
        kv_blocks_total=blocks,
        block_size=block_size,
        prefix_hits=values.get("prefix_hits", 0.0),
        prefix_queries=values.get("prefix_queries", 0.0),
        preemptions=values.get("preemptions", 0.0),
    )


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
        ready=True,
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


class Collector:
    """Scrapes ``instances`` every ``interval_s`` and publishes one event per instance."""

    def __init__(
        self,
        instances: Iterable[InstanceConfig],
        bus: EventBus,
        client: aiohttp.ClientSession,
        interval_s: float = 0.2,
        timeout_s: float = 1.0,
    ) -> None:
        self.instances = tuple(instances)
        self.bus = bus
        self.client = client
        self.interval_s = interval_s
        self.timeout_s = timeout_s

    async def scrape_once(self) -> list[InstanceTelemetry]:
        scraped = await asyncio.gather(*(self._scrape(i) for i in self.instances))
        return [telemetry_of(i, s) for i, s in zip(self.instances, scraped, strict=True)]

    async def run(self) -> None:
        """Scrape and publish until cancelled, one round per interval."""
        while True:
            started = time.monotonic()
            events = [Envelope.wrap(t, source="collector") for t in await self.scrape_once()]
            try:
                await self.bus.publish_events(events)
            except Exception as exc:  # a bus outage loses one round, not the loop
                log.warning("publishing telemetry failed: %s", exc)
            await asyncio.sleep(max(0.0, self.interval_s - (time.monotonic() - started)))

    async def _scrape(self, instance: InstanceConfig) -> Scraped | None:
        url = f"{str(instance.url).rstrip('/')}/metrics"
        try:
            async with asyncio.timeout(self.timeout_s), self.client.get(url) as response:
                response.raise_for_status()
                text = await response.text()
            return parse_metrics(text, instance.engine)
        except (aiohttp.ClientError, ValueError, TimeoutError) as exc:
            log.info("scraping %s failed: %s", instance.id, exc)
            return None

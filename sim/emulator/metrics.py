"""``/metrics`` of an emulated instance, under vLLM v1's names and ``model_name`` label.

Gauges and counters are read from the engine at scrape time; latency histograms are fed
as requests finish, in the engine's virtual seconds.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from sim.engine import Engine, Sequence

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)


class EngineMetrics:
    def __init__(self, engine: Engine, model: str) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(engine, model))
        labels = ("model_name",)
        self._ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Time to first token.",
            labels,
            registry=self.registry,
            buckets=_LATENCY_BUCKETS,
        )
        self._e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "End-to-end latency.",
            labels,
            registry=self.registry,
            buckets=_LATENCY_BUCKETS,
        )
        self._model = model

    def observe(self, sequence: Sequence) -> None:
        """Record a finished sequence (the driver's ``on_finish``)."""
        assert sequence.first_token_s is not None
        assert sequence.finished_s is not None
        self._ttft.labels(self._model).observe(sequence.first_token_s - sequence.enqueued_s)
        self._e2e.labels(self._model).observe(sequence.finished_s - sequence.enqueued_s)


class _EngineCollector(Collector):
    def __init__(self, engine: Engine, model: str) -> None:
        self._engine = engine
        self._model = model

    def collect(self) -> Iterator[Metric]:
        engine, labels, model = self._engine, ["model_name"], [self._model]
        pool = engine.pool
        for name, text, value in (
            ("vllm:num_requests_running", "Requests in the running batch.", len(engine.running)),
            ("vllm:num_requests_waiting", "Requests waiting to be scheduled.", len(engine.waiting)),
            (
                "vllm:kv_cache_usage_perc",
                "KV cache usage, 1 = full.",
                pool.used_blocks / pool.num_blocks,
            ),
        ):
            gauge = GaugeMetricFamily(name, text, labels=labels)
            gauge.add_metric(model, value)
            yield gauge
        for name, text, value in (
            (
                "vllm:prefix_cache_queries",
                "Prompt tokens looked up in the prefix cache.",
                pool.counters.prefix_queries_tokens,
            ),
            (
                "vllm:prefix_cache_hits",
                "Prompt tokens found in the prefix cache.",
                pool.counters.prefix_hits_tokens,
            ),
            ("vllm:num_preemptions", "Preempted sequences.", engine.counters.preemptions),
        ):
            counter = CounterMetricFamily(name, text, labels=labels)
            counter.add_metric(model, value)
            yield counter
        info = GaugeMetricFamily(
            "vllm:cache_config_info",
            "KV cache configuration.",
            labels=["block_size", "num_gpu_blocks", "enable_prefix_caching"],
        )
        info.add_metric([str(pool.block_size), str(pool.num_blocks), "True"], 1.0)
        yield info

"""An engine's state as the telemetry the live system publishes (``tf.telemetry``)."""

from __future__ import annotations

from schemas.telemetry import InstanceTelemetry
from sim.engine import Engine


def instance_telemetry(
    engine: Engine, instance_id: str, dc: str, model: str, model_version: str
) -> InstanceTelemetry:
    pool = engine.pool
    return InstanceTelemetry(
        instance_id=instance_id,
        dc=dc,
        model=model,
        model_version=model_version,
        ready=True,
        waiting=len(engine.waiting),
        running=len(engine.running),
        inflight_tokens=engine.inflight_tokens,
        kv_blocks_used=pool.used_blocks,
        kv_blocks_total=pool.num_blocks,
        block_size=pool.block_size,
        prefix_cache_hits=pool.counters.prefix_hits_tokens,
        prefix_cache_queries=pool.counters.prefix_queries_tokens,
        preemptions=engine.counters.preemptions,
    )

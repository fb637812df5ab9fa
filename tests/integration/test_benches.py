"""The service benchmarks run end to end at a tiny size and report what they promise.

They measure nothing here (the machine is shared); they show that the figures come from
real runs: every paced request was seen in a table, every front answered.
"""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path

import pytest
from aiokafka.admin import AIOKafkaAdminClient

from sim.streams_bench import bench_streams
from tests.conftest import run_in_thread
from tests.services import Service
from tokenfleet.cli import main


@pytest.mark.kafka
def test_the_streams_bench_times_the_worker_and_faust_alone(kafka: Service) -> None:
    figures = bench_streams(kafka.address, requests=200, paced_per_s=20.0, paced_s=3.0, workers=2)
    assert figures["events"] == 600
    assert figures["events_per_s"] > 0
    assert figures["faust_ceiling_events_per_s"] > 0
    ratio = figures["events_per_s"] / figures["faust_ceiling_events_per_s"]
    assert figures["share_of_ceiling"] == pytest.approx(ratio)
    assert figures["lag_samples"] >= 50
    assert figures["worker_cpu_us_per_event"] > 0  # the worker's own work, read from /proc
    # an infinite lag would mean a paced request never showed in a table
    assert 0 < figures["lag_p50_s"] <= figures["lag_p95_s"] < math.inf
    two = figures["2_workers"]  # the same run again, two workers sharing the partitions
    assert two["events"] == 600
    assert two["over_one_worker"] == pytest.approx(two["events_per_s"] / figures["events_per_s"])
    assert two["worker_cpu_us_per_event"] > 0
    assert not run_in_thread(_copies_left(kafka.address)), "the ceiling's copy was not deleted"


async def _copies_left(bootstrap: str, wait_s: float = 10.0) -> list[str]:
    """Topics the ceiling copied events to, still listed after ``wait_s`` (a broker
    deletes a topic a moment after it is asked to)."""
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        for _ in range(int(wait_s * 10)):
            left = [t for t in await admin.list_topics() if t.startswith("bench-ceiling-")]
            if not left:
                break
            await asyncio.sleep(0.1)
        return left
    finally:
        await admin.close()


def test_the_gateway_bench_measures_the_gateway_beside_the_instances(tmp_path: Path) -> None:
    out = tmp_path / "gateway.json"
    argv = ["bench", "gateway", "--requests", "40", "--duration", "1", "--no-litellm"]
    assert main([*argv, "--json", str(out)]) == 0
    figures = json.loads(out.read_text())
    assert figures["max_rps"] > 0
    assert figures["direct_rps"] > 0
    assert figures["gateway_cpu_ms_per_request"] > 0
    assert figures["bare_proxy"]["cpu_ms_per_request"] > 0
    assert figures["bare_proxy"]["max_rps"] > 0
    assert figures["gateway_redis"]["cpu_ms_per_request"] > 0  # its own redis-server
    # a request's charge, at least, is a script call (its ends ride on later charges)
    assert figures["gateway_redis"]["redis_calls_per_request"] >= 1
    pair = figures["gateway_redis_pair"]  # two replicas on that one Redis
    assert pair["max_rps"] > 0
    assert pair["cpu_ms_per_request"] > 0
    assert pair["redis_calls_per_request"] >= 1
    expected = pair["max_rps"] / figures["gateway_redis"]["max_rps"]
    assert pair["rate_over_one_replica"] == pytest.approx(expected)
    for q in (50, 99):
        added = figures[f"gateway_p{q}_ms"] - figures[f"direct_p{q}_ms"]
        assert figures[f"added_latency_p{q}_ms"] == pytest.approx(added)

"""What an operator's Prometheus scrapes from a gateway: the request path's counts, and in
the embedded mode its collector's, with every error counter at 0 from the start."""

from __future__ import annotations

import asyncio

from prometheus_client.parser import text_string_to_metric_families

from tests.gateway_harness import MODEL, Gateway, chat, scraped


async def _series(front: Gateway) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    async with front.client() as http:
        text = (await http.get("/metrics")).text
    series: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            series.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return series


async def test_the_answer_names_the_instance_and_metrics_count_it(front: Gateway) -> None:
    async with front.client() as http:
        response = await http.post("/v1/chat/completions", json=chat("hi " * 100))
    assert response.status_code == 200
    instance = response.headers["x-tokenfleet-instance"]
    assert instance in {"i0", "i1"}
    assert await scraped(front.url, "tokenfleet_gateway_decisions_total", instance_id=instance) == 1
    assert await scraped(front.url, "tokenfleet_gateway_requests_total", status="200") == 1
    assert await scraped(front.url, "tokenfleet_gateway_added_latency_seconds_count") == 1
    assert await scraped(front.url, "tokenfleet_gateway_token_lag_seconds", model=MODEL) == 0.004


async def test_latency_histograms_count_each_completed_request_as_its_client_saw_it(
    front: Gateway,
) -> None:
    async with front.client() as http:
        streamed = await http.post("/v1/chat/completions", json=chat("s " * 40) | {"stream": True})
        whole = await http.post("/v1/chat/completions", json=chat("w " * 40))
    assert (streamed.status_code, whole.status_code) == (200, 200)
    labels = {"model": MODEL, "task_class": "interactive"}
    # a stream's books close in a task of their own, which may end a moment after the
    # client's read
    duration = "tokenfleet_gateway_request_duration_seconds"
    for _ in range(100):
        if await scraped(front.url, f"{duration}_count", **labels) == 2:
            break
        await asyncio.sleep(0.02)
    assert await scraped(front.url, f"{duration}_count", **labels) == 2
    # only the streamed answer shows its first token before its end
    ttft = "tokenfleet_gateway_time_to_first_token_seconds"
    assert await scraped(front.url, f"{ttft}_count", **labels) == 1
    assert 0 < await scraped(front.url, f"{ttft}_sum", **labels) < 5


async def test_a_stream_its_client_leaves_after_its_first_token_counts_that_token(
    front: Gateway,
) -> None:
    """vLLM observes a first token when it comes; counted at the end, a stream its client
    left was missing from the histogram, though its first token was sent."""
    body = chat("s " * 40, max_tokens=3000) | {"stream": True}
    async with front.client() as http, http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if '"content"' in line:
                break  # and leave
    labels = {"model": MODEL, "task_class": "interactive"}
    cancelled = "tokenfleet_gateway_cancellations_total"  # the stream's end, in a task
    for _ in range(100):
        if await scraped(front.url, cancelled) == 1:
            break
        await asyncio.sleep(0.02)
    assert await scraped(front.url, cancelled) == 1
    ttft = "tokenfleet_gateway_time_to_first_token_seconds_count"
    assert await scraped(front.url, ttft, **labels) == 1
    duration = "tokenfleet_gateway_request_duration_seconds_count"
    assert await scraped(front.url, duration, **labels) == 0  # its end never came


async def test_error_counters_start_at_zero_for_each_instance_stage_and_dc(
    front: Gateway,
) -> None:
    """A series first seen at 1 has no ``increase()``: an alert on a rare error, often the
    only one, would never fire."""
    series = await _series(front)
    upstream = series["tokenfleet_gateway_upstream_errors_total"]
    stages = {"connect", "status", "body", "before_first_token", "after_first_token", "refused"}
    expected = {(("instance_id", i), ("stage", s)) for i in ("i0", "i1") for s in stages}
    assert set(upstream) == expected
    assert set(upstream.values()) == {0.0}
    fallbacks = series["tokenfleet_gateway_dc_fallbacks_total"]
    assert set(fallbacks) == {(("dc", "dc-a"), ("why", w)) for w in ("Refused", "DcFailed")}
    assert len(series["tokenfleet_gateway_events_dropped_total"]) == 4


async def test_an_embedded_gateway_shows_its_collector_s_metrics(front: Gateway) -> None:
    """Nothing else serves them in the embedded mode: an instance that stopped answering
    its scrapes showed nowhere but in the gateway's 503s."""
    series = await _series(front)
    for instance_id in ("i0", "i1"):
        scrapes = series["tokenfleet_collector_scrapes_total"][(("instance_id", instance_id),)]
        assert scrapes >= 1  # the gateway is ready: each instance was scraped
        failures = series["tokenfleet_collector_scrape_failures_total"]
        assert failures[(("instance_id", instance_id),)] == 0
    assert len(series["process_cpu_seconds_total"]) == 1  # one process collector, not two


async def test_a_request_refused_as_invalid_counts_under_the_fleet_s_model_it_names(
    front: Gateway,
) -> None:
    """Refused before its body was read whole, it counted under ``-`` whatever it named;
    a name outside the fleet still does (a client could add series without end)."""
    async with front.client() as http:
        too_many = await http.post("/v1/chat/completions", json=chat("hi") | {"n": 129})
        unknown = await http.post("/v1/chat/completions", json=chat("hi") | {"model": "x" * 40})
        garbled = await http.post("/v1/chat/completions", content=b"{not json")
    assert (too_many.status_code, unknown.status_code, garbled.status_code) == (400, 404, 400)
    requests = (await _series(front))["tokenfleet_gateway_requests_total"]
    assert requests[(("model", MODEL), ("status", "400"))] == 1
    assert requests[(("model", "-"), ("status", "404"))] == 1
    assert requests[(("model", "-"), ("status", "400"))] == 1

"""schemathesis against the gateway's OpenAPI document: whatever it is sent, never a 500."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error

from tests.gateway_harness import KEY, emulated, fleet_for, gateway


@pytest.fixture(scope="module")
def gateway_url() -> Iterator[str]:
    """A gateway in front of two fast emulated instances, on a loop in its own thread
    (schemathesis calls synchronously)."""
    started: list[str] = []
    ready, stop = threading.Event(), threading.Event()

    async def serve() -> None:
        async with (
            emulated(2, speedup=1000) as running,
            gateway(fleet_for([i.url for i in running])) as front,
        ):
            started.append(front.url)
            ready.set()
            await asyncio.to_thread(stop.wait)

    thread = threading.Thread(target=asyncio.run, args=(serve(),), daemon=True)
    thread.start()
    assert ready.wait(30), "the gateway did not start"
    yield started[0]
    stop.set()
    thread.join(30)


def test_no_request_makes_the_gateway_fail(gateway_url: str) -> None:
    # Driven through hypothesis directly: schemathesis's pytest plugin does not load
    # under this pytest.
    schema = schemathesis.openapi.from_url(f"{gateway_url}/openapi.json")
    auth = {"authorization": f"Bearer {KEY}"}
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/chat/completions", "/v1/completions"}
    for operation in operations:

        @given(case=operation.as_strategy())
        @settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
        def no_server_error(case: schemathesis.Case) -> None:
            response = case.call(base_url=gateway_url, headers=auth)
            case.validate_response(response, checks=[not_a_server_error])

        no_server_error()

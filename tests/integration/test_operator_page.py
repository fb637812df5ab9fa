"""The operators' page: server-sent events as a client reads them, and the page as
headless Chromium (Debian's package) renders it from them."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import unavailable
from tests.gateway_harness import http_server
from tests.services import Service
from tests.unit.test_operator_view import Clock, capacity, goodput, quotas, weights
from tokenfleet.operator_page import operator_app
from tokenfleet.operator_view import OperatorView
from tokenfleet.services.process import answers_http, free_port


@pytest.fixture
async def page() -> AsyncIterator[str]:
    """The page over two DCs, dc-b's weight lowered and its chats late."""
    clock = Clock()
    view = OperatorView(clock)
    for n in range(6):
        at = clock.now - 50 + 10 * n
        view.apply(goodput("dc-a", n + 1, at, met=95, tokens_per_s=400.0))
        view.apply(goodput("dc-b", n + 1, at, met=60, tokens_per_s=300.0))
        view.apply(weights(at, dc_a=1.0, dc_b=1.0 - 0.04 * n))
        view.apply(quotas("dc-b", at, limit=8 - n))
    view.apply(capacity("dc-a", 1, clock.now))
    async with http_server(operator_app(view, every_s=0.1)) as url:
        yield url


async def test_the_events_carry_the_state_and_a_limit_ends_them(page: str) -> None:
    async with httpx.AsyncClient(base_url=page) as http:
        async with http.stream("GET", "/events", params={"limit": 3}) as events:
            assert events.headers["content-type"].startswith("text/event-stream")
            lines = [line async for line in events.aiter_lines() if line.startswith("data: ")]
        refused = await http.get("/events", params={"limit": "many"})
    assert len(lines) == 3
    state = json.loads(lines[-1].removeprefix("data: "))
    assert [dc["dc"] for dc in state["dcs"]] == ["dc-a", "dc-b"]
    assert state["dcs"][1]["weight"] == pytest.approx(0.8)
    assert refused.status_code == 400


async def test_its_metrics_carry_the_gauges_and_the_process_s(page: str) -> None:
    async with httpx.AsyncClient(base_url=page) as http:
        text = (await http.get("/metrics")).text
    assert 'tokenfleet_controller_weight{dc="dc-b"} 0.8' in text
    assert "process_cpu_seconds_total " in text  # as every other part of the fleet serves


async def test_chromium_draws_the_tables_and_charts_from_the_events(
    page: str, tmp_path: Path
) -> None:
    dom = await _render(f"{page}/?limit=2", tmp_path)
    assert "as of " in dom  # the state arrived
    weight = re.search(r'<td data-dc="dc-b" class="weight">([^<]*)</td>', dom)
    assert weight is not None
    assert weight.group(1) == "0.80"
    chats = re.search(r'data-dc="dc-b" data-class="interactive" class="goodput">([^<]*)<', dom)
    assert chats is not None
    assert chats.group(1) == "180.0"
    lines = re.findall(r'<polyline points="([^"]+)"[^>]*data-dc="(dc-[ab])"', dom)
    drawn = {(dc, len(points.split())) for points, dc in lines}
    assert ("dc-a", 6) in drawn
    assert ("dc-b", 6) in drawn


async def _render(url: str, tmp_path: Path) -> str:
    """The page's DOM once Chromium has run its script and the events have ended."""
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        unavailable("chromium is not installed (./dev test installs Debian's)")
    process = await asyncio.create_subprocess_exec(
        browser,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        f"--user-data-dir={tmp_path / 'profile'}",
        "--virtual-time-budget=5000",
        "--dump-dom",
        url,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
    )
    out, _ = await asyncio.wait_for(process.communicate(), timeout=120)
    assert process.returncode == 0
    return out.decode()


@pytest.mark.kafka
async def test_the_controller_stops_on_sigterm_while_a_page_follows_its_events(
    kafka: Service,
) -> None:
    """An open event stream does not hold the process: it ends within the grace that
    ``tokenfleet down`` gives before SIGKILL (30 s), as does its view's stream."""
    port = free_port()
    process = await asyncio.create_subprocess_exec(
        *(sys.executable, "-m", "tokenfleet.cli", "controller", "--port", str(port)),
        env=os.environ | {"TOKENFLEET_KAFKA_BOOTSTRAP": kafka.address},
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(300):  # its imports and the broker's topics: seconds here
            if await asyncio.to_thread(answers_http, url + "/health"):
                break
            await asyncio.sleep(0.2)
        async with (
            httpx.AsyncClient(base_url=url, timeout=30) as http,
            http.stream("GET", "/events") as events,
        ):
            lines = events.aiter_lines()
            assert (await anext(lines)).startswith("retry: ")
            process.send_signal(signal.SIGTERM)
            assert await asyncio.wait_for(process.wait(), timeout=25) == 0
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()

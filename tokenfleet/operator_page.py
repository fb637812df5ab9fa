"""The operators' view over HTTP, served by the controller's process.

``/`` a page that redraws on every server-sent event (``/?limit=N``: it asks for N events
only); ``/events`` the view's state as server-sent events, one every ``every_s``;
``/api/state`` the same, once, as JSON; ``/metrics`` the controller's Prometheus gauges,
derived from the same state.
"""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator, Iterator
from importlib import resources
from typing import Any

import uvicorn
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from sim.emulator.server import SignalFreeServer
from streams.bus import EventBus
from streams.feeds import follow_envelopes
from tokenfleet.controller_host import PLACEMENT_TOPIC
from tokenfleet.loop_status import CONTROL_TOPICS, TABLE_TOPICS
from tokenfleet.operator_view import OperatorView

PAGE = resources.files("tokenfleet") / "static" / "operators.html"


VIEWED_TOPICS = (*TABLE_TOPICS, *CONTROL_TOPICS, PLACEMENT_TOPIC)


async def serve_operator_view(bus: EventBus, listening: socket.socket, every_s: float) -> None:
    """Follow the tables and controls on ``bus`` (from the start of their compacted
    topics) and serve their view on the ``listening`` socket until cancelled; open event
    streams get a second to end, then are closed."""
    view = OperatorView()
    readers = [
        asyncio.create_task(follow_envelopes(bus, topic, view.apply_envelope, "earliest"))
        for topic in VIEWED_TOPICS
    ]
    config = uvicorn.Config(  # no lifespan: the app has none, and one cancelled logged a traceback
        operator_app(view, every_s),
        log_level="warning",
        timeout_graceful_shutdown=1,
        lifespan="off",
    )
    server = SignalFreeServer(config)
    serving = asyncio.create_task(server.serve([listening]))
    try:
        await asyncio.shield(serving)
    finally:
        server.should_exit = True
        await asyncio.gather(serving, return_exceptions=True)
        for reader in readers:
            reader.cancel()
        await asyncio.gather(*readers, return_exceptions=True)


def operator_app(view: OperatorView, every_s: float = 1.0) -> Starlette:
    """The page, the events, the state and the gauges of ``view``."""
    registry = CollectorRegistry()
    registry.register(ViewMetrics(view))
    ProcessCollector(registry=registry)  # CPU and memory, as every other part serves

    async def page(_: Request) -> Response:
        return HTMLResponse(PAGE.read_text())

    async def state(_: Request) -> Response:
        return JSONResponse(view.state())

    async def events(request: Request) -> Response:
        """One event every ``every_s``; with ``?limit=N``, N events and the end (a
        headless browser's page load ends; an ``EventSource`` would reconnect)."""
        limit = request.query_params.get("limit")
        if limit is not None and not (limit.isascii() and limit.isdigit()):
            return JSONResponse({"error": "limit must be a whole number"}, status_code=400)
        retry_ms = 60_000 if limit else 2_000  # a bounded stream is not to be resumed

        async def stream() -> AsyncIterator[str]:
            sent = 0
            while limit is None or sent < int(limit):
                if await request.is_disconnected():
                    return
                yield f"retry: {retry_ms}\ndata: {json.dumps(view.state())}\n\n"
                sent += 1
                await asyncio.sleep(every_s)

        headers = {"cache-control": "no-store"}
        return StreamingResponse(stream(), media_type="text/event-stream", headers=headers)

    async def metrics(_: Request) -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    async def health(_: Request) -> Response:
        return Response("ok")

    return Starlette(
        routes=[
            Route("/", page),
            Route("/api/state", state),
            Route("/events", events),
            Route("/metrics", metrics),
            Route("/health", health),
        ]
    )


class ViewMetrics(Collector):
    """The view's state as Prometheus gauges, computed at each scrape."""

    def __init__(self, view: OperatorView) -> None:
        self.view = view

    def collect(self) -> Iterator[GaugeMetricFamily]:
        dcs = self.view.state()["dcs"]
        yield _per_dc(
            "tokenfleet_controller_table_age_seconds",
            "Age of the DC's older table (goodput, capacity) as the controller last read it.",
            dcs,
            lambda dc: dc["tables_age_s"],
        )
        yield _per_dc(
            "tokenfleet_controller_table_publishers",
            "Table workers (app ids) that published the DC's tables in the last minute: "
            "more than one is a deployment error.",
            dcs,
            lambda dc: len(dc["table_publishers"]),
        )
        yield _per_dc(
            "tokenfleet_controller_weight",
            "The DC's weight for chats: the lowest any edge's tf.control.weights snapshot in "
            "force holds.",
            dcs,
            lambda dc: dc["weight"],
        )
        yield _per_dc(
            "tokenfleet_controller_long_documents_limit",
            "Long documents in flight the DC's quotas allow.",
            dcs,
            lambda dc: dc["long_documents"],
        )
        yield _per_dc(
            "tokenfleet_controller_batch_limit",
            "Batch requests in flight the DC's quotas allow (absent: no ceiling). The "
            "controller sets one while chats miss with no long documents to blame, and lifts it "
            "once they have room again (minutes later: it doubles at most once a minute).",
            dcs,
            lambda dc: dc["batch"],
        )
        placed = GaugeMetricFamily(
            "tokenfleet_controller_placed_replicas",
            "Replicas of the model FleetMind's long cycle runs in the DC (tf.control.placement).",
            labels=("dc", "model"),
        )
        for dc in dcs:
            for model, replicas in (dc["replicas"] or {}).items():
                placed.add_metric((dc["dc"], model), replicas)
        yield placed
        left = GaugeMetricFamily(
            "tokenfleet_controller_control_ttl_left_seconds",
            "TTL left of the DC's newest quotas and of the edges' weights in force, the first "
            "to run out (negative: expired).",
            labels=("dc", "kind"),
        )
        for dc in dcs:
            for kind, seconds in dc["controls_left_s"].items():
                if seconds is not None:
                    left.add_metric((dc["dc"], kind), seconds)
        yield left
        yield from _per_class(dcs)


def _per_dc(name: str, text: str, dcs: list[dict[str, Any]], value: Any) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, text, labels=("dc",))
    for dc in dcs:
        if (figure := value(dc)) is not None:
            family.add_metric((dc["dc"],), figure)
    return family


def _per_class(dcs: list[dict[str, Any]]) -> Iterator[GaugeMetricFamily]:
    goodput = GaugeMetricFamily(
        "tokenfleet_controller_goodput_tokens_per_second",
        "Output tokens per second of requests that met their objective, over the table's "
        "window, by DC and class.",
        labels=("dc", "task_class"),
    )
    compliance = GaugeMetricFamily(
        "tokenfleet_controller_compliance",
        "Share of the class's completed requests that met their objective, over the window.",
        labels=("dc", "task_class"),
    )
    for dc in dcs:
        for row in dc["classes"]:
            labels = (dc["dc"], row["task_class"])
            goodput.add_metric(labels, row["goodput_tokens_per_s"])
            if row["compliance"] is not None:  # a class whose requests all failed or left
                compliance.add_metric(labels, row["compliance"])
    yield goodput
    yield compliance

"""A gateway in dc-a (eu-west) before an instance there and one in dc-b (us-east, 80 ms
away), each instance scripted: the DC-choice tests' fleet."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from schemas.fleet import FleetConfig
from tests.gateway_harness import (
    KEY,
    MODEL,
    PROFILE,
    Gateway,
    chat,
    chat_answer,
    gateway,
    http_server,
    until_ready,
    vllm_metrics,
)

EU_ONLY_KEY = "sk-eu-only"


@dataclass
class Gate:
    """Where an instance holds its answers: ``reached`` once a request waits, answered
    once ``opened``."""

    reached: asyncio.Event = field(default_factory=asyncio.Event)
    opened: asyncio.Event = field(default_factory=asyncio.Event)


def instance(
    served: list[str],
    dc: str,
    gate: Gate | None = None,
    failing: float | None = None,
    garbles: bool = False,
    waiting: int = 0,
) -> Starlette:
    """An instance that answers at once, or once its gate opens, or fails every request
    ``failing`` seconds after it came, or (``garbles``) answers 200 with a body that is
    no JSON; its metrics show ``waiting`` requests in its queue."""

    async def metrics(_: Request) -> Response:
        return vllm_metrics(waiting=waiting, running=0)

    async def answer(_: Request) -> Response:
        served.append(dc)
        if failing is not None:
            await asyncio.sleep(failing)
            return Response("engine dead", status_code=500)
        if garbles:
            return Response("{not json", media_type="application/json")
        if gate is not None:
            gate.reached.set()
            await gate.opened.wait()
        return chat_answer()

    return Starlette(
        routes=[
            Route("/metrics", metrics),
            Route("/v1/chat/completions", answer, methods=["POST"]),
            Route("/v1/embeddings", answer, methods=["POST"]),
            Route("/tokenize", answer, methods=["POST"]),
        ]
    )


@contextlib.asynccontextmanager
async def two_dcs(
    served: list[str],
    rps_per_instance: float | None = None,
    gate: Gate | None = None,
    home_fails: float | None = None,
    chat_ttft_s: float | None = None,
    home_garbles: bool = False,
    queues: tuple[int, int] = (0, 0),
    at_home: int = 1,
    **settings: Any,
) -> AsyncIterator[Gateway]:
    """A gateway in dc-a (eu-west) before ``at_home`` instances there (``i-dc-a``, then
    ``i-dc-a-2`` ...) and one in dc-b (us-east), and a standby instance in dc-a that no
    placement started; ``gate``: dc-a's instances answer only once it opens;
    ``home_fails``: dc-a's fail that many seconds after each request came; ``queues``: the
    queue each instance of dc-a and of dc-b reports; ``chat_ttft_s``: the chats'
    objective; ``settings``: the gateway's."""
    names = [("i-dc-a", "dc-a")]
    names += [(f"i-dc-a-{n}", "dc-a") for n in range(2, at_home + 1)] + [("i-dc-b", "dc-b")]
    async with contextlib.AsyncExitStack() as stack:
        urls = {
            (name, dc): await stack.enter_async_context(
                http_server(
                    instance(
                        served,
                        dc,
                        *((gate, home_fails, home_garbles) if dc == "dc-a" else ()),
                        waiting=queues[dc == "dc-b"],
                    )
                )
            )
            for name, dc in names
        }
        fleet = FleetConfig.model_validate(
            {
                "dcs": [
                    {"name": "dc-a", "region": "eu-west"},
                    {"name": "dc-b", "region": "us-east"},
                ],
                "network": [{"regions": ["eu-west", "us-east"], "rtt_ms": 80}],
                "objectives": {"interactive": {"ttft_s": chat_ttft_s}} if chat_ttft_s else {},
                "models": [
                    {"name": MODEL, "profile": PROFILE, "rps_per_instance": rps_per_instance}
                ],
                "instances": [
                    *(
                        {"id": name, "dc": dc, "url": url, "model": MODEL}
                        for (name, dc), url in urls.items()
                    ),
                    {
                        "id": "spare-a",
                        "dc": "dc-a",
                        "url": "http://127.0.0.1:9",
                        "model": MODEL,
                        "standby": True,
                    },
                ],
                "tenants": [
                    {"name": "anyone", "api_keys": [KEY]},
                    {"name": "eu-only", "api_keys": [EU_ONLY_KEY], "dcs": ["dc-a"]},
                ],
            }
        )
        front = await stack.enter_async_context(gateway(fleet, dc="dc-a", **settings))
        await until_ready(front)
        yield front


async def ask(http: httpx.AsyncClient, **headers: str) -> httpx.Response:
    return await http.post("/v1/chat/completions", json=chat("hi"), headers=headers)

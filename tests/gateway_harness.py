"""Building blocks for gateway tests: emulated instances, a fleet for them, a gateway."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import httpx
import uvicorn
from fastapi import FastAPI
from prometheus_client.parser import text_string_to_metric_families
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from gateway.settings import GatewaySettings
from schemas import topic_for
from schemas.fleet import FleetConfig
from sim.emulator.server import EmulatedInstance, serve
from sim.profiles import profile
from tokenfleet.gateway_wiring import running_gateway
from tokenfleet.services.process import free_port
from tokenfleet.settings import Settings

MODEL = "emulated"
KEY = "sk-test"
PROFILE = "llama3-70b-4xh100"
T = TypeVar("T")
WEATHER = [{"role": "user", "content": "What is the weather in Lyon? " * 10}]


def fleet_for(urls: Sequence[str], **extra: Any) -> FleetConfig:
    """One DC, one model, an instance per URL (ids ``i0``, ``i1``, ...), one tenant."""
    return FleetConfig.model_validate(
        {
            "dcs": [{"name": "dc-a", "region": "eu-west"}],
            "models": [{"name": MODEL, "profile": PROFILE, "context_tokens": 8192}],
            "instances": [
                {"id": f"i{n}", "dc": "dc-a", "url": url, "model": MODEL}
                for n, url in enumerate(urls)
            ],
            "tenants": [{"name": "tenant-a", "api_keys": [KEY]}],
            **extra,
        }
    )


@contextlib.asynccontextmanager
async def emulated(
    count: int, speedup: float = 10.0, reasoning: bool = False
) -> AsyncIterator[list[EmulatedInstance]]:
    async with serve(
        profile(PROFILE), MODEL, [0] * count, speedup, reasoning=reasoning
    ) as instances:
        yield instances


@dataclass
class Gateway:
    url: str
    app: FastAPI

    def client(self, key: str = KEY) -> httpx.AsyncClient:
        return httpx.AsyncClient(
            base_url=self.url, headers={"authorization": f"Bearer {key}"}, timeout=30
        )


@contextlib.asynccontextmanager
async def gateway(
    fleet: FleetConfig,
    kafka: str | None = None,
    redis: str | None = None,
    **settings: Any,
) -> AsyncIterator[Gateway]:
    services = Settings(kafka_bootstrap=kafka, redis_url=redis)
    async with contextlib.AsyncExitStack() as stack:
        for attempt in range(3):  # a port can be taken between choosing and binding it
            port = free_port()
            try:
                app = await stack.enter_async_context(
                    running_gateway(fleet, GatewaySettings(**settings), services, "127.0.0.1", port)
                )
                break
            except OSError:
                if attempt == 2:
                    raise
        yield Gateway(f"http://127.0.0.1:{port}", app)


async def latest_event(front: Gateway, request_id: str, kind: type[T]) -> T | None:
    """The request's latest event on ``kind``'s topic, once it is a ``kind`` (None after
    5 s)."""
    topic = topic_for(kind).name
    bus = front.app.state.gateway.parts.bus
    for _ in range(250):
        envelope = (await bus.read_latest(topic)).get(request_id)
        if envelope is not None and isinstance(envelope.payload, kind):
            return envelope.payload
        await asyncio.sleep(0.02)
    return None


async def scraped(url: str, name: str, **labels: str) -> float:
    """The sum of the samples named ``name`` (with these labels) on ``url``/metrics."""
    async with httpx.AsyncClient() as http:
        text = (await http.get(f"{url}/metrics")).text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items())
    )


async def until_ready(front: Gateway, timeout_s: float = 20.0) -> None:
    """Until the gateway's first scrapes have made its instances ready."""
    async with front.client() as http:
        for _ in range(int(timeout_s / 0.05)):
            if (await http.get("/ready")).status_code == 200:
                return
            await asyncio.sleep(0.05)
    raise AssertionError("the gateway never saw its instances ready")


def chat(content: str, max_tokens: int = 4, **extra: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        **extra,
    }


def fake_instance(path: str, answer: Callable[[Request], Awaitable[Response]]) -> Starlette:
    """An instance that answers ``POST path`` with ``answer`` and looks ready and idle (a
    vLLM ``/metrics``): for answers the emulator does not give."""

    async def metrics(_: Request) -> Response:
        return vllm_metrics(waiting=0, running=0, kv_usage=0.0)

    return Starlette(routes=[Route(path, answer, methods=["POST"]), Route("/metrics", metrics)])


def dying_instance(path: str, events: Sequence[bytes]) -> Starlette:
    """An instance that answers ``POST path`` with a stream of ``events`` (each a whole
    server-sent event), a moment apart, and then dies: its connection drops."""

    async def stream(_: Request) -> StreamingResponse:
        async def body() -> AsyncIterator[bytes]:
            for event in events:
                yield event
                await asyncio.sleep(0.01)
            raise RuntimeError("the engine died")

        return StreamingResponse(body(), media_type="text/event-stream")

    return fake_instance(path, stream)


def streaming_instance(events: Sequence[dict[str, Any]]) -> Starlette:
    """An instance that answers every chat completion with ``events`` as one server-sent
    stream, then ``data: [DONE]``."""
    body = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"

    async def stream(_: Request) -> StreamingResponse:
        return StreamingResponse(iter([body.encode()]), media_type="text/event-stream")

    return fake_instance("/v1/chat/completions", stream)


@contextlib.asynccontextmanager
async def http_server(app: Any) -> AsyncIterator[str]:
    """Serve an ASGI app on a free loopback port; yields its base URL."""
    listening = socket.create_server(("127.0.0.1", 0))
    port = listening.getsockname()[1]
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off")
    )
    task = asyncio.create_task(server.serve([listening]))
    while not server.started:
        if task.done():
            await task  # surfaces the start-up error
        await asyncio.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await task


def vllm_metrics(waiting: int, running: int, kv_usage: float = 0.1) -> Response:
    """A vLLM /metrics answer with these gauges (and a cache of 10,000 blocks of 16)."""
    model = f'{{model_name="{MODEL}"}}'
    return PlainTextResponse(
        f"vllm:num_requests_waiting{model} {waiting}\n"
        f"vllm:num_requests_running{model} {running}\n"
        f"vllm:kv_cache_usage_perc{model} {kv_usage}\n"
        'vllm:cache_config_info{block_size="16",num_gpu_blocks="10000"} 1.0\n'
    )


def chat_answer(content: str = "ok", completion_tokens: int = 2) -> Response:
    """A whole chat completion, as vLLM answers one."""
    return JSONResponse(
        {
            "id": "chatcmpl-1",
            "object": "chat.completion",
            "created": 0,
            "model": MODEL,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": content},
                    "finish_reason": "stop",
                }
            ],
            "usage": {
                "prompt_tokens": 10,
                "completion_tokens": completion_tokens,
                "total_tokens": 10 + completion_tokens,
            },
        }
    )

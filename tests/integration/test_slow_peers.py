"""Servers and clients that are slow, silent or keyed: a server started with an API key,
a client that stops reading its stream, a gateway that stops while a stream runs, and a
whole answer longer than the stream's read timeout."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from tests.gateway_harness import (
    KEY,
    MODEL,
    Gateway,
    chat,
    chat_answer,
    fake_instance,
    fleet_for,
    gateway,
    http_server,
    scraped,
    vllm_metrics,
)


def _endless_upstream(content: str, pause_s: float, ended: asyncio.Event) -> Starlette:
    """An instance whose streamed answer never ends: ``content`` a chunk, every
    ``pause_s``; ``ended`` is set once the gateway closes the call."""

    async def stream(_: Request) -> StreamingResponse:
        base = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "model": MODEL}
        delta = {"index": 0, "delta": {"content": content}, "finish_reason": None}
        event = f"data: {json.dumps({**base, 'choices': [delta]})}\n\n".encode()

        async def events() -> AsyncIterator[bytes]:
            try:
                while True:
                    yield event
                    await asyncio.sleep(pause_s)
            finally:
                ended.set()

        return StreamingResponse(events(), media_type="text/event-stream")

    return fake_instance("/v1/chat/completions", stream)


async def test_a_server_started_with_an_api_key_gets_its_key_not_the_client_s(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """vLLM's ``--api-key``: the gateway sends the server's own key, from the variable
    the fleet file names, on completions, pass-through calls and the scrapes."""
    monkeypatch.setenv("UPSTREAM_KEY_A", "sk-upstream")
    seen: list[tuple[str, str | None]] = []

    def keyed(answer: Callable[[Request], Awaitable[Response]]) -> Callable[..., Any]:
        async def check(request: Request) -> Response:
            seen.append((request.url.path, request.headers.get("authorization")))
            if request.headers.get("authorization") != "Bearer sk-upstream":
                return JSONResponse({"error": {"message": "Unauthorized"}}, status_code=401)
            return await answer(request)

        return check

    async def metrics(_: Request) -> Response:
        return vllm_metrics(waiting=0, running=0)

    async def completion(_: Request) -> Response:
        return chat_answer()

    async def tokenized(_: Request) -> Response:
        return JSONResponse({"count": 1, "max_model_len": 8192, "tokens": [1]})

    instance = Starlette(
        routes=[
            Route("/metrics", keyed(metrics)),
            Route("/v1/chat/completions", keyed(completion), methods=["POST"]),
            Route("/tokenize", keyed(tokenized), methods=["POST"]),
        ]
    )
    async with http_server(instance) as url:
        fleet = fleet_for([url])
        keyed_fleet = fleet.model_copy(
            update={
                "instances": (
                    fleet.instances[0].model_copy(update={"api_key_env": "UPSTREAM_KEY_A"}),
                )
            }
        )
        async with gateway(keyed_fleet) as front, front.client() as http:
            answer = await http.post("/v1/chat/completions", json=chat("hello " * 10))
            counted = await http.post("/tokenize", json={"model": MODEL, "prompt": "hello"})
    assert (answer.status_code, counted.status_code) == (200, 200)
    assert {path for path, _ in seen} == {"/metrics", "/v1/chat/completions", "/tokenize"}
    assert {key for _, key in seen} == {"Bearer sk-upstream"}  # never the tenant's KEY


async def test_a_client_that_stops_reading_its_stream_is_given_up(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Its connection stays open, so no disconnect is seen: without a limit the gateway
    waited on it for good, holding the instance's sequence and the request's slot."""
    monkeypatch.setattr("gateway.exchange.WRITE_STALL_S", 0.5)
    ended = asyncio.Event()
    async with (
        http_server(_endless_upstream("x" * 65536, 0.0, ended)) as upstream,  # large pieces
        gateway(fleet_for([upstream])) as front,
    ):
        host, port = front.url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        body = json.dumps(chat("a long answer please", stream=True)).encode()
        writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: gateway\r\n"
            + f"authorization: Bearer {KEY}\r\ncontent-type: application/json\r\n".encode()
            + f"content-length: {len(body)}\r\n\r\n".encode()
            + body
        )
        await writer.drain()
        await reader.read(1024)  # the answer began; then nothing more is read
        await asyncio.wait_for(ended.wait(), timeout=30)  # the upstream call was closed
        assert await scraped(front.url, "tokenfleet_gateway_requests_in_progress") == 0
        writer.close()


async def test_a_stopping_gateway_cuts_a_stream_that_outlasts_its_drain() -> None:
    ended = asyncio.Event()
    async with http_server(_endless_upstream("tok ", 0.05, ended)) as upstream:

        async def read_until_cut(front: Gateway) -> None:
            async with front.client() as http:
                request = chat("go on", stream=True)
                async with http.stream("POST", "/v1/chat/completions", json=request) as answer:
                    with contextlib.suppress(httpx.HTTPError):
                        async for _ in answer.aiter_bytes():
                            pass

        async def serve_then_stop() -> asyncio.Task[None]:
            async with gateway(fleet_for([upstream]), drain_s=1) as front:
                reading = asyncio.create_task(read_until_cut(front))
                await asyncio.sleep(0.5)  # streaming now; then the gateway stops
            return reading

        # without a drain the stop waited for the stream, which never ends
        reading = await asyncio.wait_for(serve_then_stop(), timeout=30)
        await asyncio.wait_for(ended.wait(), timeout=20)  # the upstream call was closed
        await asyncio.wait_for(reading, timeout=20)


async def test_a_whole_answer_cut_by_a_stopping_gateway_gets_the_stop_s_503(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """uvicorn cancels what runs past the drain: the client got the server's plain-text
    500, and the log a traceback for each, and one of the upstream call's failure, never
    retrieved."""
    called, ended = asyncio.Event(), asyncio.Event()

    async def endless(request: Request) -> Response:
        called.set()
        while (await request.receive())["type"] != "http.disconnect":
            pass
        ended.set()
        return Response(status_code=499)

    async with http_server(fake_instance("/v1/chat/completions", endless)) as upstream:

        async def asked(front: Gateway) -> httpx.Response:
            async with front.client() as http:
                return await http.post("/v1/chat/completions", json=chat("a long answer"))

        uvicorn_log = logging.getLogger("uvicorn.error")  # it does not propagate to caplog

        async def serve_then_stop() -> asyncio.Task[httpx.Response]:
            async with gateway(fleet_for([upstream]), drain_s=1) as front:
                uvicorn_log.addHandler(caplog.handler)  # once uvicorn has set its logging
                answer = asyncio.create_task(asked(front))
                await asyncio.wait_for(called.wait(), timeout=10)
            return answer

        try:
            answer = await asyncio.wait_for(serve_then_stop(), timeout=30)
            cut = await asyncio.wait_for(answer, timeout=10)
        finally:
            uvicorn_log.removeHandler(caplog.handler)
        await asyncio.wait_for(ended.wait(), timeout=10)  # the upstream call was closed
    assert cut.status_code == 503
    assert cut.headers["retry-after"] == "1"
    assert cut.json()["error"]["message"].startswith("The gateway stopped before this request")
    logged = [record.getMessage() for record in caplog.records]
    assert not [line for line in logged if "Exception in ASGI application" in line]
    assert not [line for line in logged if "never retrieved" in line]


async def test_a_whole_answer_slower_than_the_read_timeout_is_waited_for() -> None:
    """vLLM sends a whole answer's headers with its end: the silence is the generation,
    not a failed instance. A stream's silence still times out."""
    calls: list[bool] = []

    async def slow(request: Request) -> Response:
        streamed = bool((await request.json()).get("stream"))
        calls.append(streamed)
        if streamed:
            await asyncio.sleep(1.0)  # silent past the read timeout, then nothing
            return JSONResponse({}, status_code=200)
        await asyncio.sleep(1.0)  # a long generation
        return chat_answer()

    async with (
        http_server(fake_instance("/v1/chat/completions", slow)) as upstream,
        gateway(fleet_for([upstream]), upstream_read_timeout_s=0.3) as front,
        front.client() as http,
    ):
        whole = await http.post("/v1/chat/completions", json=chat("write a lot"))
        streamed = await http.post("/v1/chat/completions", json=chat("write", stream=True))
    assert whole.status_code == 200
    assert whole.json()["choices"][0]["message"]["content"] == "ok"
    assert streamed.status_code == 502  # the stream's first byte never came in time
    assert calls == [False, True]  # the whole answer was not tried again

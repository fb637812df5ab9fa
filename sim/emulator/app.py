"""One emulated vLLM instance as an OpenAI-compatible HTTP app.

Prompts become tokens and prefix blocks by ``control.tokens`` (the gateway's rule too);
the output is exactly the requested number of tokens (``max_tokens``, else the defaults in
``schemas.openai_api``), each the 4-byte text ``"tok "``. A client that disconnects
cancels its request and frees its blocks. Where asked to, ``/kv-events`` serves the
engine's KV events, which vLLM would publish on ZMQ, to the collector.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from control.tokens import block_hashes, chat_text, count_tokens
from schemas.openai_api import ApiError, ChatRequest, CompletionRequest, parse_request
from sim.emulator.driver import EngineDriver
from sim.emulator.kv_feed import KvEventFeed
from sim.emulator.metrics import EngineMetrics
from sim.engine import RequestTooLong, Sequence
from sim.workload import TraceRequest

TOKEN_TEXT = "tok "
KV_EVENTS_PER_PAGE = 10_000


@dataclass(frozen=True)
class _Call:
    """What a completion or chat request asks of the engine, and how to answer it."""

    chat: bool
    model: str
    prompt_tokens: int
    output_tokens: int
    stream: bool
    include_usage: bool
    request_id: str
    created: int


def create_app(
    driver: EngineDriver, model: str, metrics: EngineMetrics, kv_feed: KvEventFeed | None
) -> FastAPI:
    """The instance's HTTP API; ``/kv-events`` only with a ``kv_feed``."""
    app = FastAPI(title=f"TokenFleet emulated vLLM ({model})")

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {"id": model, "object": "model", "created": 0, "owned_by": "tokenfleet"}
        return {"object": "list", "data": [card]}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    if kv_feed is not None:
        _serve_kv_events(app, kv_feed)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = parse_request(CompletionRequest, await request.body())
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
            text, tokens = "", len(prompt)
        else:
            text = prompt if isinstance(prompt, str) else (prompt[0] if prompt else "")
            tokens = count_tokens(text)
        return await _serve(request, driver, model, body, False, text, tokens)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        body = parse_request(ChatRequest, await request.body())
        text = chat_text(body.messages)
        return await _serve(request, driver, model, body, True, text, count_tokens(text))

    return app


def _serve_kv_events(app: FastAPI, kv_feed: KvEventFeed) -> None:
    @app.get("/kv-events")
    async def kv_events(
        after: str = "0", limit: str = str(KV_EVENTS_PER_PAGE), epoch: str | None = None
    ) -> Response:
        """The engine's KV events numbered past ``after`` (``sim/emulator/kv_feed.py``),
        encoded by ``json`` itself: FastAPI's encoder took 23 ms for 6,000 events, time the
        instances sharing this event loop would lose."""
        most = min(_count(limit, "limit", 1), KV_EVENTS_PER_PAGE)
        page = kv_feed.page(_count(after, "after", 0), most, epoch)
        return Response(json.dumps(page.body()), media_type="application/json")


def _count(value: str, name: str, least: int) -> int:
    """A whole-number query parameter, or ApiError(400) naming it."""
    try:
        number = int(value)
    except ValueError:
        number = least - 1
    if number < least:
        raise ApiError(400, f"`{name}` must be a whole number of at least {least}.", param=name)
    return number


async def _serve(
    request: Request,
    driver: EngineDriver,
    model: str,
    body: CompletionRequest | ChatRequest,
    chat: bool,
    text: str,
    prompt_tokens: int,
) -> Response:
    if body.model != model:
        raise ApiError(404, f"The model `{body.model}` does not exist.", param="model")
    call = _Call(
        chat,
        model,
        prompt_tokens,
        body.output_tokens,
        body.stream,
        body.include_usage,
        f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
        int(time.time()),
    )
    work = TraceRequest(
        call.request_id, driver.now(), prompt_tokens, call.output_tokens, block_hashes(text)
    )
    try:
        sequence, tokens = driver.submit(work)
    except RequestTooLong as exc:
        limit = driver.engine.config.max_tokens_per_sequence
        raise ApiError(
            400,
            f"This model's maximum context length is {limit} tokens; the request needs {exc}.",
            param="max_tokens",
        ) from None
    if call.stream:
        return StreamingResponse(
            _sse(driver, sequence, tokens, call), media_type="text/event-stream"
        )
    return await _whole(request, driver, sequence, tokens, call)


async def _whole(
    request: Request,
    driver: EngineDriver,
    sequence: Sequence,
    tokens: asyncio.Queue[int | None],
    call: _Call,
) -> Response:
    collect = asyncio.ensure_future(_drain(tokens, driver.api_overhead_s()))
    gone = asyncio.ensure_future(_disconnected(request))
    done, _ = await asyncio.wait({collect, gone}, return_when=asyncio.FIRST_COMPLETED)
    if collect not in done:
        collect.cancel()
        driver.cancel(sequence)
        return Response(status_code=499)
    gone.cancel()
    generated = collect.result()
    return JSONResponse(_final_body(call, generated))


async def _drain(tokens: asyncio.Queue[int | None], overhead_s: float) -> int:
    generated = 0
    while (count := await tokens.get()) is not None:
        generated += count
    await asyncio.sleep(overhead_s)
    return generated


async def _disconnected(request: Request) -> None:
    """Returns when the client goes away (the body was read, so only that can arrive)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _sse(
    driver: EngineDriver, sequence: Sequence, tokens: asyncio.Queue[int | None], call: _Call
) -> AsyncIterator[str]:
    generated = 0
    try:
        if call.chat:
            yield _event(_chunk(call, {"role": "assistant", "content": ""}, None))
        while (count := await tokens.get()) is not None:
            if not generated:
                await asyncio.sleep(driver.api_overhead_s())
            generated += count
            done = generated >= call.output_tokens
            yield _event(_chunk(call, TOKEN_TEXT * count, "length" if done else None))
        if call.include_usage:
            yield _event(
                {**_chunk(call, None, None), "choices": [], "usage": _usage(call, generated)}
            )
        yield "data: [DONE]\n\n"
    finally:
        driver.cancel(sequence)  # a no-op once finished; frees blocks if the client left


def _event(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload)}\n\n"


def _chunk(call: _Call, content: str | dict[str, str] | None, finish: str | None) -> dict:
    if call.chat:
        delta = content if isinstance(content, dict) else ({"content": content} if content else {})
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        kind = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": content or "", "logprobs": None, "finish_reason": finish}
        kind = "text_completion"
    return _envelope(call, kind, choice)


def _final_body(call: _Call, generated: int) -> dict[str, Any]:
    text = TOKEN_TEXT * generated
    if call.chat:
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "logprobs": None,
            "finish_reason": "length",
        }
        kind = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": "length"}
        kind = "text_completion"
    return {**_envelope(call, kind, choice), "usage": _usage(call, generated)}


def _envelope(call: _Call, kind: str, choice: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": call.request_id,
        "object": kind,
        "created": call.created,
        "model": call.model,
        "choices": [choice],
    }


def _usage(call: _Call, generated: int) -> dict[str, int]:
    return {
        "prompt_tokens": call.prompt_tokens,
        "completion_tokens": generated,
        "total_tokens": call.prompt_tokens + generated,
    }
